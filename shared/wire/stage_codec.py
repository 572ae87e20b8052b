"""Pipeline-stage messages <-> msgpack bytes, driven by each dataclass's type annotations.

Stage processes talk over sockets (shared/wire/stage_link.py). Pickle would let a
peer run code in the receiver, so messages travel as msgpack and are rebuilt
only from a registry of allowed dataclasses: a frame is `[type name, [field
values in declaration order]]`, and every value is checked against its
field's annotation while it is decoded. Supported annotations: int, float,
str, bool, None (in a union), Enum subclasses (sent as the member's ordinal:
both ends run the same code), np.ndarray, nested registered or plain
dataclasses, list[X], tuple[X, Y], tuple[X, ...], dict[K, V] and X | None.

numpy arrays travel as `[dtype.str, shape, raw bytes]`; the dtype must be one
of ARRAY_DTYPES and the byte count must match the shape exactly. Decoded
arrays are writable copies (torch.from_numpy refuses to share read-only
memory without a warning).

Adding a message type is one line: put the dataclass in the tuple the
codec is built from (services/verifier_cloud/stages.py: STAGE_MESSAGES).

The msgpack layer (registry, packing, unpacking, the error base) is
shared/wire/msgpack_codec.py, the one the device <-> cloud wire schema uses too.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Iterable
from typing import Any

import numpy as np

from shared.wire.msgpack_codec import CodecError, MessageRegistry, NotMsgpack, UnpackLimits, pack, unpack

# Little-endian only (the hosts we run on); '|b1' is numpy's bool.
ARRAY_DTYPES = frozenset({"<f2", "<f4", "<f8", "<i4", "<i8", "|u1", "|i1", "|b1"})
MAX_ARRAY_DIMS = 8
# Map keys may be ints (dict[int, X] fields); every container is bounded by the frame's length.
_UNPACK_LIMITS = UnpackLimits(strict_map_key=False)
# The leaf annotations a field may have: each decoded by `_decode_scalar`, its type checked exactly (a bool is
# not an int; a float may arrive as an int)
_SCALARS = (bool, int, float, str, np.ndarray)


class StageLinkError(CodecError):
    """A frame that cannot be accepted: malformed, oversized, unknown type, or a broken link."""


class StageCodec:
    """Encode/decode the registered dataclasses; anything else is refused with StageLinkError."""

    def __init__(self, message_types: Iterable[type]):
        self._registry: MessageRegistry[str] = MessageRegistry("stage message")
        self.types: dict[str, type] = self._registry.by_tag  # class name -> class
        for cls in message_types:
            self._registry.register(cls.__name__, cls)  # TypeError: not a dataclass, or a name taken twice
        # Resolved once: (field name, annotation) per class, nested plain dataclasses included on demand.
        self._fields: dict[type, list[tuple[str, Any]]] = {}
        for cls in self.types.values():  # an annotation the decoder cannot check fails here, at import
            self._check_annotation(cls, cls.__name__)

    # -- encode (the sender's own objects: a bad one is the caller's bug, raised as TypeError) ----
    def encode(self, message: Any) -> bytes:
        cls = type(message)
        if not self._registry.holds(cls, cls.__name__):
            raise TypeError(f"{cls.__name__} is not a registered stage message")
        return pack([cls.__name__, self._encode_value(message)])

    def _encode_value(self, value: Any) -> Any:
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, np.generic):  # a numpy scalar: its Python value
            return value.item()
        if isinstance(value, enum.Enum):
            return list(type(value)).index(value)
        if isinstance(value, np.ndarray):
            if not value.dtype.isnative and value.dtype.byteorder not in "|=":
                value = value.astype(value.dtype.newbyteorder("="))
            return [value.dtype.str, list(value.shape), np.ascontiguousarray(value).tobytes()]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return [self._encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)]
        if isinstance(value, (list, tuple)):
            return [self._encode_value(v) for v in value]
        if isinstance(value, dict):
            return {self._encode_value(k): self._encode_value(v) for k, v in value.items()}
        raise TypeError(f"cannot encode {type(value).__name__} in a stage message")

    # -- decode (a peer's bytes: every failure is a StageLinkError) -------------------------------
    def decode(self, body: bytes) -> Any:
        try:
            # msgpack bounds every container by the buffer's length, so a short frame cannot claim a huge one.
            obj = unpack(body, limits=_UNPACK_LIMITS)
        except NotMsgpack as exc:  # the hop's header already bounded the body's size
            raise StageLinkError(str(exc)) from None
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)):
            raise StageLinkError("a frame must be [type name, fields]")
        cls = self.types.get(obj[0])
        if cls is None:
            raise StageLinkError(f"unknown message type {obj[0][:64]!r}")
        try:
            return self._decode_dataclass(cls, obj[1], cls.__name__)
        except (TypeError, ValueError, OverflowError) as exc:  # a constructor or numpy refusing a value
            if isinstance(exc, StageLinkError):
                raise
            raise StageLinkError(f"{cls.__name__}: {exc}") from None

    def _field_types(self, cls: type) -> list[tuple[str, Any]]:
        if cls not in self._fields:
            hints = typing.get_type_hints(cls)
            self._fields[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
        return self._fields[cls]

    def _check_annotation(self, annotation: Any, where: str) -> None:
        if annotation in _SCALARS or annotation is type(None):
            return
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            for name, field_type in self._field_types(annotation):
                self._check_annotation(field_type, f"{where}.{name}")
            return
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Union or origin is types.UnionType:
            if len([a for a in args if a is not type(None)]) == 1:
                for arg in args:
                    self._check_annotation(arg, where)
                return
        elif origin in (list, tuple, dict) and args:
            for arg in args:
                if arg is not Ellipsis:
                    self._check_annotation(arg, where)
            return
        raise TypeError(f"{where}: the stage codec cannot carry {annotation!r}")

    def _decode_dataclass(self, cls: type, raw: Any, where: str) -> Any:
        fields = self._field_types(cls)
        if not isinstance(raw, list) or len(raw) != len(fields):
            raise StageLinkError(f"{where}: expected {len(fields)} fields")
        return cls(
            *(self._decode(annotation, value, f"{where}.{name}") for (name, annotation), value in zip(fields, raw))
        )

    def _decode(self, annotation: Any, raw: Any, where: str) -> Any:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Union or origin is types.UnionType:
            if raw is None and type(None) in args:
                return None
            options = [a for a in args if a is not type(None)]
            if len(options) != 1:
                raise TypeError(f"{where}: only X | None unions are supported")
            return self._decode(options[0], raw, where)
        if annotation in _SCALARS:
            return _decode_scalar(annotation, raw, where)
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            members = list(annotation)
            _expect(raw, type(raw) is int and 0 <= raw < len(members), f"a {annotation.__name__} ordinal", where)
            return members[raw]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            return self._decode_dataclass(annotation, raw, where)
        if origin in (list, tuple, dict):
            return self._decode_container(origin, args, raw, where)
        raise TypeError(f"{where}: unsupported annotation {annotation!r}")

    def _decode_container(self, origin: type, args: tuple[Any, ...], raw: Any, where: str) -> Any:
        """A list, tuple (fixed or `X, ...`) or dict of decoded elements; msgpack carries tuples as lists."""
        if origin is list:
            _expect(raw, isinstance(raw, list), "a list", where)
            return [self._decode(args[0], v, f"{where}[]") for v in raw]
        if origin is tuple:
            _expect(raw, isinstance(raw, list), "a tuple", where)
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self._decode(args[0], v, f"{where}[]") for v in raw)
            _expect(raw, len(raw) == len(args), f"a {len(args)}-tuple", where)
            return tuple(self._decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, raw)))
        _expect(raw, isinstance(raw, dict), "a map", where)
        return {
            self._decode(args[0], k, f"{where}{{key}}"): self._decode(args[1], v, f"{where}{{}}")
            for k, v in raw.items()
        }


def _decode_scalar(annotation: type, raw: Any, where: str) -> Any:
    if annotation is bool:
        return _expect(raw, type(raw) is bool, "a bool", where)
    if annotation is int:
        return _expect(raw, type(raw) is int, "an int", where)
    if annotation is float:
        return float(_expect(raw, type(raw) in (int, float), "a number", where))
    if annotation is str:
        return _expect(raw, type(raw) is str, "a str", where)
    return _decode_array(raw, where)


def _expect(raw: Any, ok: bool, what: str, where: str) -> Any:
    if not ok:
        raise StageLinkError(f"{where}: expected {what}, got {type(raw).__name__}")
    return raw


def _decode_array(raw: Any, where: str) -> np.ndarray:
    if not (
        isinstance(raw, list)
        and len(raw) == 3
        and type(raw[0]) is str
        and isinstance(raw[1], list)
        and type(raw[2]) is bytes
    ):
        raise StageLinkError(f"{where}: an array must be [dtype, shape, bytes]")
    dtype_str, shape, data = raw
    if dtype_str not in ARRAY_DTYPES:
        raise StageLinkError(f"{where}: array dtype {dtype_str[:16]!r} is not allowed")
    if len(shape) > MAX_ARRAY_DIMS or not all(type(d) is int and d >= 0 for d in shape):
        raise StageLinkError(f"{where}: bad array shape")
    dtype = np.dtype(dtype_str)
    if math.prod(shape) * dtype.itemsize != len(data):
        raise StageLinkError(f"{where}: {len(data)} bytes do not fill a {dtype_str} array of shape {shape}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
