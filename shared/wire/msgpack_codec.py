"""The one msgpack layer under every message the mesh sends: a registry of message dataclasses by tag,
packing, bounded unpacking, and the typed errors a refused frame raises.

Two schemas sit on it. shared/wire/schema.py (device <-> cloud) tags its frozen dataclasses with a one-byte
type code and validates each field by its declared wire kind; shared/wire/stage_codec.py (the pipeline
stages' hops) tags plain dataclasses by class name and validates each field by its annotation. Both
take their bytes through `pack` / `unpack` here, so the safety rules live in one place:

- never pickle: a frame is rebuilt only into a class its registry holds, so a peer cannot make the
  receiver construct (let alone run) anything else;
- a frame over its size limit is refused before a byte of it is parsed (`FrameTooLarge`);
- container limits (`UnpackLimits`) stop a small frame from inflating into a huge object graph;
- every way bytes fail to be msgpack is one exception type (`NotMsgpack`), whatever msgpack raised.

Each schema turns these into its own typed error (`WireError` with an error code; `StageLinkError`),
all of them `CodecError`s, so a caller that only needs "this frame was refused" catches one type.

Why not msgspec: it packs and unpacks the wire's verify frames 2-3x faster, but that is ~10 us of a
60-90 us encode/decode dominated by validation and tensor handling, and its untyped decoder has no
container-length limits, which the wire relies on for untrusted frames.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, is_dataclass
from functools import cached_property
from typing import Any, Generic, TypeVar

import msgpack

Tag = TypeVar("Tag", bound=Hashable)


class CodecError(ValueError):
    """A frame (or a message being built) that a msgpack schema refuses."""


class FrameTooLarge(CodecError):
    """A frame over its size limit; refused before unpacking."""


class NotMsgpack(CodecError):
    """Bytes that are not exactly one msgpack object within the limits (truncated, trailing data, bad
    utf-8, an ext type, a container over its limit, not bytes at all)."""


class MessageRegistry(Generic[Tag]):
    """The dataclasses a schema may decode into, each under a unique tag (a type code, a class name)."""

    def __init__(self, what: str) -> None:
        self.what = what  # for errors: "wire message", "stage message"
        # tag -> class; exposed as a plain dict because schemas and their tests read it as their table
        self.by_tag: dict[Tag, type] = {}

    def register(self, tag: Tag, cls: type) -> type:
        """Add `cls` under `tag`; TypeError for a non-dataclass or a tag already taken (a programming error,
        raised at import)."""
        if not is_dataclass(cls) or not isinstance(cls, type):
            raise TypeError(f"{cls!r} is not a dataclass: it cannot be a {self.what}")
        if tag in self.by_tag:
            raise TypeError(
                f"{self.what} tag {tag!r} is registered twice ({self.by_tag[tag].__name__}, {cls.__name__})"
            )
        self.by_tag[tag] = cls
        return cls

    def get(self, tag: Any) -> type | None:
        """The class registered under `tag`, None for an unknown (or unhashable) tag from a peer."""
        try:
            return self.by_tag.get(tag)
        except TypeError:  # a list or map where a tag belongs
            return None

    def holds(self, cls: type, tag: Tag) -> bool:
        """Whether `cls` itself (not a look-alike of the same name) is registered under `tag`."""
        return self.by_tag.get(tag) is cls


@dataclass(frozen=True)
class UnpackLimits:
    """Bounds on the containers of one frame. None: no bound beyond the frame's own length (msgpack never
    allocates a container longer than the bytes that could fill it). The frame's byte limit is per call
    (`unpack`'s max_frame_bytes): a receiver may know it only at run time."""

    max_map_len: int | None = None
    max_array_len: int | None = None
    max_str_len: int | None = None
    max_ext_len: int | None = None
    strict_map_key: bool = True  # map keys must be str or bytes

    def __post_init__(self) -> None:
        for name in _CONTAINER_LIMITS:
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")

    @cached_property
    def unpacker_options(self) -> dict[str, Any]:
        """msgpack.unpackb's keyword arguments for these limits (computed once: unpack is on the hot path)."""
        options: dict[str, Any] = {"strict_map_key": self.strict_map_key}
        options.update({name: getattr(self, name) for name in _CONTAINER_LIMITS if getattr(self, name) is not None})
        return options


_CONTAINER_LIMITS = ("max_map_len", "max_array_len", "max_str_len", "max_ext_len")
NO_LIMITS = UnpackLimits()


def pack(obj: Any) -> bytes:
    """A msgpack-ready object -> bytes; str as str and bytes/memoryview as bin (never the legacy raw type)."""
    return msgpack.packb(obj, use_bin_type=True)


def frame_size(frame: Any) -> int:
    """Bytes in a frame; NotMsgpack for anything that is not a bytes-like object."""
    if isinstance(frame, memoryview):
        return frame.nbytes
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    raise NotMsgpack(f"frame must be bytes, got {type(frame).__name__}")


def unpack(frame: Any, *, max_frame_bytes: int | None = None, limits: UnpackLimits = NO_LIMITS) -> Any:
    """Bytes -> one msgpack object (str as str, bin as bytes, arrays as lists), within the limits.

    Raises FrameTooLarge (checked first: an oversized frame is never parsed) or NotMsgpack."""
    size = frame_size(frame)
    if max_frame_bytes is not None and size > max_frame_bytes:
        raise FrameTooLarge(f"frame of {size} bytes > {max_frame_bytes}")
    try:
        return msgpack.unpackb(frame, raw=False, use_list=True, **limits.unpacker_options)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise NotMsgpack(f"not msgpack: {exc}") from None
