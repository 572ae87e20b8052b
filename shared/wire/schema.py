"""The one schema for every device <-> cloud WebSocket message (wire version 3).

Why a hand-written schema: frames are untrusted input on the cloud side and the
hot path on the device side, so every frame is a small msgpack map (no JSON, no
pickle) with one-/two-letter keys, validated field by field into a frozen
dataclass. A failed check raises `WireError` carrying an `ErrorCode` (and the
session/seq it concerned, when known) so the server can answer with an
`ErrorFrame` instead of dropping the connection.

Frame layout: ``{"v": WIRE_VERSION, "t": <type code>, <short key>: <value>, ...}``.
Keys are fixed per field (see `_f(...)` below); every message that names a
session uses "s" for session_id and "q" for seq_no, so errors can be addressed
even for frames whose type is unknown. Unknown keys are rejected (MALFORMED):
a strict schema means nothing extra (e.g. prompt text) can ride along.

Tensors are ``{"d": dtype code, "s": [rows, H], "b": raw little-endian bytes}``;
dtype codes: 'f2' float16 (default), 'f4' float32, 'bf' bfloat16 (raw 16 bits).
Decoding wraps the bin payload without copying (`torch.frombuffer`); the tensor
is backed by a private bytes object msgpack allocated, so treat it as read-only
or ``.clone()`` it before writing in place.

Type-code table (one byte each: every code < 128 is a msgpack positive fixint):

    0x01 OpenSession   d->c    0x02 SessionOpened c->d
    0x03 CloseSession  d->c    0x04 SessionClosed c->d
    0x05 ForkSession   d->c    (reply SessionOpened: a new session whose KV is a copy of a parent's prefix)
    0x06 Reauthenticate d->c   (no reply: a fresh token for the open connection; refused: ErrorFrame
                               CREDENTIAL, then close 1008)
    0x10 PrefillChunk  d->c    0x11 ChunkAck      c->d   0x12 DeepHidden c->d
    0x20 VerifyRequest d->c    0x21 VerifyResult  c->d
    0x30 BandwidthProbe d->c   0x31 ProbeReply    c->d   (link measurement, no model data)
    0x40-0x5f  "token mode": messages carrying token ids (and, later, draft
               probabilities) instead of hidden states. Every class registered in
               this range gets ``carries_token_ids = True`` from the registry, so
               `assert_privacy_safe` flags it, and a cloud refuses it with
               PRIVACY_VIOLATION on sessions opened with ``privacy=True``.
        0x40 OpenTokenSession d->c (reply SessionOpened; the session has privacy off)
        0x41 TokenPrefill     d->c    0x42 TokenStep d->c    0x43 TokenResult c->d
        0x44 TokenDraft       d->c    0x45 TokenVerdict c->d  (PicoSpec's streamed drafts, separate
                                                               rejection sampling; draft_stream.py)
    0x7f ErrorFrame    either direction

Token ids travel as one bin of little-endian uint32 (``TOKENS`` fields), not a
msgpack array: a prompt of thousands of ids stays one allocation, and the
unpacker's small container limits stay in force.

Adding a message = one decorated dataclass with a free code and `_f` fields;
encode/decode/validation are generic over the registry. Packing, the size and
container limits and the registry itself are shared/wire/msgpack_codec.py's, the
layer the pipeline stages' messages use too. A new type needs no
version bump (an old peer answers UNKNOWN_TYPE); changing an existing one does.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import field
from typing import Any, ClassVar, TypeGuard, TypeVar, dataclass_transform

import numpy as np
import torch

from shared.wire.msgpack_codec import CodecError, FrameTooLarge, MessageRegistry, NotMsgpack, UnpackLimits, pack, unpack

logger = logging.getLogger(__name__)

if sys.byteorder != "little":  # the wire is little-endian; we never byte-swap
    raise ImportError("shared.wire.schema assumes a little-endian host")

WIRE_VERSION = 3  # 2: OpenSession carries split_layers and the checkpoint fingerprint; 3: draft trees (VerifyRequest)
MAX_TREE_ROWS = 1024  # rows of one tree verification (each a node); a frame cannot ask the cloud for more
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_OVERHEAD_BYTES = 128  # generous bound on non-tensor bytes of a hidden-state frame
_U64_MAX = 2**64 - 1
_TOKEN_ID_MAX = 2**32 - 1  # ids travel as uint32
TOKEN_MODE_CODES = range(0x40, 0x60)  # message types that carry token ids (privacy mode refuses them)
_MAX_ERROR_TEXT = 512
MAX_CREDENTIAL_CHARS = 4096  # a Reauthenticate's token (a JWT: a few hundred printable ASCII characters)
# Our frames are structurally tiny (a map of <= ~8 keys, 2-element shapes); capping
# container sizes stops a 16 MiB frame of 1-byte nils from inflating into ~128 MB of
# Python objects before validation even starts.
_UNPACK_LIMITS = UnpackLimits(max_map_len=32, max_array_len=8, max_str_len=4096, max_ext_len=0)

# Decoded tensors wrap msgpack's (immutable) bytes zero-copy, which torch warns
# about once per process (TORCH_WARN_ONCE). Spend that one warning here, silently,
# so it does not surface on the first real frame; a module-level warnings filter
# would not survive pytest's per-test filter reset.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0", dtype=torch.float16)


class WireDtype(enum.Enum):
    """Dtype of a tensor on the wire (string code as sent)."""

    F16 = "f2"
    F32 = "f4"
    BF16 = "bf"


_TORCH_DTYPE = {WireDtype.F16: torch.float16, WireDtype.F32: torch.float32, WireDtype.BF16: torch.bfloat16}
_FROM_TORCH = {v: k for k, v in _TORCH_DTYPE.items()}
_BY_CODE = {wd.value: wd for wd in WireDtype}
_BITS_DTYPE = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


class ErrorCode(enum.IntEnum):
    MALFORMED = 1
    UNKNOWN_TYPE = 2
    BAD_VERSION = 3
    BAD_DTYPE = 4
    BAD_SHAPE = 5
    LENGTH_MISMATCH = 6
    UNKNOWN_SESSION = 7
    OVERSIZED = 8
    PRIVACY_VIOLATION = 9
    INTERNAL = 10
    OVERLOADED = 11
    SPLIT_MISMATCH = 12  # the device's split point or checkpoint is not the verifier's: its states would be wrong
    BAD_VALUE = 13  # a hidden state holds NaN or +-Inf (refused where the frame is decoded with finite_only)
    KV_BUDGET = 14  # the KV this would take passes the verifier's KV budget in bytes (the device's or the total)
    QUEUE_BUDGET = 15  # the frame would pass the verifier's budget of queued bytes (the device's or the total)
    CREDENTIAL = 16  # a Reauthenticate's token is refused (another device's, expired, revoked...): the connection ends


class WireError(CodecError):
    """A frame (or a message being built) violates the schema."""

    def __init__(self, code: ErrorCode, message: str, session_id: int | None = None, seq_no: int | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message
        self.session_id, self.seq_no = session_id, seq_no

    def to_frame(self) -> ErrorFrame:
        """The ErrorFrame answering this error. An id that is not a valid u64 (the very thing that may have
        been wrong with the frame) is left out, so building the answer can never raise in its turn."""
        return ErrorFrame(
            self.code, self.message[:_MAX_ERROR_TEXT], _u64_or_none(self.session_id), _u64_or_none(self.seq_no)
        )


# ---------------------------------------------------------------- tensors


def encode_tensor(t: torch.Tensor, wire_dtype: WireDtype | str = WireDtype.F16) -> dict:
    """Tensor -> msgpack-ready map; casts to `wire_dtype` (the only copy besides packing)."""
    wd = _as_dtype(wire_dtype)
    target = _TORCH_DTYPE[wd]
    if t.requires_grad:
        t = t.detach()
    if t.dtype != target or not t.is_cpu:  # each skipped no-op saves ~1 us per frame
        t = t.to("cpu", target)
    if not t.is_contiguous():
        t = t.contiguous()
    # numpy has no bfloat16: ship its 16 bits through an int16 view (no copy either way)
    raw = (t.view(torch.int16) if wd is WireDtype.BF16 else t).numpy().data  # a memoryview of the array
    return {"d": wd.value, "s": list(t.shape), "b": raw}


def decode_tensor(obj: Any, expected_hidden_size: int | None = None, *, finite_only: bool = False) -> torch.Tensor:
    """Validated map -> tensor [rows, H] in its wire dtype, sharing the payload's memory.

    `finite_only` refuses NaN and +-Inf (BAD_VALUE): one min/max pass, no copy (about 2 ms for
    a full 16 MiB frame on one core), paid where untrusted states enter the model."""
    if not isinstance(obj, dict) or obj.keys() != {"d", "s", "b"}:
        raise WireError(ErrorCode.MALFORMED, "tensor must be a map with keys d, s, b")
    dtype, shape, raw = obj["d"], obj["s"], obj["b"]
    wd = _BY_CODE.get(dtype) if isinstance(dtype, str) else None
    if wd is None:
        raise WireError(ErrorCode.BAD_DTYPE, f"unknown dtype {dtype!r}")
    if type(shape) is not list or not all(type(d) is int for d in shape):
        raise WireError(ErrorCode.MALFORMED, "shape must be a list of ints")
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        raise WireError(ErrorCode.BAD_SHAPE, f"shape must be 2-D positive, got {shape}")
    if expected_hidden_size is not None and shape[1] != expected_hidden_size:
        raise WireError(ErrorCode.BAD_SHAPE, f"hidden size {shape[1]} != expected {expected_hidden_size}")
    if not isinstance(raw, bytes):
        raise WireError(ErrorCode.MALFORMED, "tensor payload must be bin")
    torch_dtype = _TORCH_DTYPE[wd]
    want = shape[0] * shape[1] * torch_dtype.itemsize
    if len(raw) != want:
        raise WireError(ErrorCode.LENGTH_MISMATCH, f"{len(raw)} bytes, shape {shape} needs {want}")
    tensor = torch.frombuffer(raw, dtype=torch_dtype).view(shape[0], shape[1])  # [rows, H]
    if finite_only:
        low, high = torch.aminmax(tensor)  # NaN propagates into both; an infinity shows in one
        if not (math.isfinite(low.item()) and math.isfinite(high.item())):
            raise WireError(ErrorCode.BAD_VALUE, "hidden states must be finite (NaN or Inf found)")
    return tensor


def dtype_bytes(wire_dtype: WireDtype | str) -> int:
    """Bytes per element of a tensor sent in `wire_dtype`."""
    return _TORCH_DTYPE[_as_dtype(wire_dtype)].itemsize


def max_rows_per_frame(
    hidden_size: int, wire_dtype: WireDtype | str = WireDtype.F16, max_frame_bytes: int = MAX_FRAME_BYTES
) -> int:
    """Largest [rows, H] that fits one frame, so the device can size prefill chunks."""
    return max(0, (max_frame_bytes - MAX_OVERHEAD_BYTES) // (hidden_size * dtype_bytes(wire_dtype)))


def _as_dtype(wd: WireDtype | str) -> WireDtype:
    try:
        return wd if isinstance(wd, WireDtype) else WireDtype(wd)
    except ValueError:
        raise WireError(ErrorCode.BAD_DTYPE, f"unknown dtype {wd!r}") from None


def _is_int(v: Any) -> TypeGuard[int]:
    return type(v) is int  # excludes bool (and IntEnum); msgpack yields exact ints


def _u64_or_none(v: Any) -> int | None:
    return v if _is_int(v) and 0 <= v <= _U64_MAX else None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, distinguishes -0.0), the right notion for frames."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS_DTYPE.get(a.dtype)
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


# ---------------------------------------------------------------- messages

# field kinds: how `_check` validates a value and `encode` writes it
U64, OPT_U64, BOOL, TEXT = "u64", "opt_u64", "bool", "text"
TENSOR, DTYPE, CODE = "tensor", "dtype", "code"
FLOAT, TOKENS = "float", "tokens"  # finite float; non-empty tuple of uint32 token ids
OPT_TOKENS, OPT_PROBS = "opt_tokens", "opt_probs"  # absent, or ids / float32 probabilities in [0, 1] as one bin
OPT_ROWS = "opt_rows"  # absent, or row indices (uint32, one bin like token ids; not token ids: no privacy concern)
CREDENTIAL = "credential"  # a bearer token: 1..MAX_CREDENTIAL_CHARS printable ASCII, no spaces (never prompt text)
_REGISTRY: MessageRegistry[int] = MessageRegistry("wire message")
_TYPES: dict[int, type[Message]] = _REGISTRY.by_tag  # type code -> class: the table decode dispatches on


def _f(key: str, kind: str, **kw: Any) -> Any:
    """Declare a field with its short wire key and its validation kind."""
    return field(metadata={"key": key, "kind": kind}, **kw)


class Message:
    """Base of all frames. Subclasses are frozen dataclasses registered by `_message`."""

    __slots__ = ()
    type: ClassVar[int]
    carries_token_ids: ClassVar[bool] = False
    _spec: ClassVar[tuple[tuple[str, str, str, bool], ...]]  # (name, key, kind, has_default)
    _keys: ClassVar[frozenset[str]]  # every key a frame of this type may hold
    __dataclass_fields__: ClassVar[dict[str, Any]]  # set by dataclass() in `_message`

    def __post_init__(self) -> None:
        for name, _key, kind, _has_default in self._spec:
            value = getattr(self, name)
            if value is None and kind in (OPT_U64, OPT_TOKENS, OPT_PROBS, OPT_ROWS):
                continue
            checked = _check(kind, name, value)
            if checked is not value:
                object.__setattr__(self, name, checked)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for name, _key, kind, _opt in self._spec:
            a, b = getattr(self, name), getattr(other, name)
            if kind == OPT_PROBS and (a is None or b is None):
                same = a is b
            else:
                same = _same_tensor(a, b) if kind in (TENSOR, OPT_PROBS) else a == b
            if not same:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # tensors make messages unhashable


def _check_u64(name: str, value: Any) -> Any:
    if not _is_int(value) or not 0 <= value <= _U64_MAX:
        raise WireError(ErrorCode.MALFORMED, f"{name} must be a u64, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise WireError(ErrorCode.MALFORMED, f"{name} must be a bool")
    return value


def _check_text(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        raise WireError(ErrorCode.MALFORMED, f"{name} must be a string")
    return value


def _check_credential(name: str, value: Any) -> Any:
    if not isinstance(value, str) or not value or not (value.isascii() and value.isprintable()) or " " in value:
        raise WireError(ErrorCode.MALFORMED, f"{name} must be a non-empty token of printable ASCII, no spaces")
    if len(value) > MAX_CREDENTIAL_CHARS:
        raise WireError(ErrorCode.OVERSIZED, f"{name} is {len(value)} characters, over {MAX_CREDENTIAL_CHARS}")
    return value


def _check_dtype(_name: str, value: Any) -> WireDtype:
    return _as_dtype(value)


def _check_code(_name: str, value: Any) -> ErrorCode:
    try:
        if type(value) is bool:  # True is not MALFORMED's 1
            raise ValueError(value)
        return ErrorCode(value)
    except ValueError:
        raise WireError(ErrorCode.MALFORMED, f"unknown error code {value!r}") from None


def _check_tensor(name: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or min(value.shape) <= 0:
        raise WireError(ErrorCode.BAD_SHAPE, f"{name} must be a 2-D tensor with positive dims")
    return value


def _check_float(name: str, value: Any) -> Any:
    if type(value) is int:  # an int from a hand-built frame or a caller is an exact float
        value = float(value)
    if type(value) is not float or not math.isfinite(value):
        raise WireError(ErrorCode.MALFORMED, f"{name} must be a finite float, got {value!r}")
    return value


def _check_probs(name: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != torch.float32 or not value.numel():
        raise WireError(ErrorCode.BAD_SHAPE, f"{name} must be a non-empty 1-D float32 tensor")
    if not bool(((value >= 0) & (value <= 1)).all()):  # NaN fails both comparisons
        raise WireError(ErrorCode.BAD_VALUE, f"{name} must hold probabilities in [0, 1]")
    return value


def _uint32_sequence(what: str) -> Callable[[str, Any], Any]:
    """The check of a field of uint32 `what` (token ids, row indices): a non-empty sequence, kept as a tuple."""

    def check(name: str, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or not all(_is_int(t) and 0 <= t <= _TOKEN_ID_MAX for t in value):
            raise WireError(ErrorCode.MALFORMED, f"{name} must be a sequence of uint32 {what}")
        if not value:
            raise WireError(ErrorCode.BAD_SHAPE, f"{name} must hold at least one entry")
        return value if type(value) is tuple else tuple(value)

    return check


_check_token_ids = _uint32_sequence("token ids")

# field kind -> its check(name, value): the value to store (coerced where the kind says so), or WireError
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    U64: _check_u64,
    OPT_U64: _check_u64,
    BOOL: _check_bool,
    TEXT: _check_text,
    CREDENTIAL: _check_credential,
    DTYPE: _check_dtype,
    CODE: _check_code,
    TENSOR: _check_tensor,
    FLOAT: _check_float,
    OPT_PROBS: _check_probs,
    TOKENS: _check_token_ids,
    OPT_TOKENS: _check_token_ids,
    OPT_ROWS: _uint32_sequence("row indices"),
}


def _check(kind: str, name: str, value: Any) -> Any:
    """Validate (and coerce enums of) one field; raises WireError. A kind without a check passes its value."""
    check = _CHECKS.get(kind)
    return value if check is None else check(name, value)


def encode_tokens(ids: tuple[int, ...]) -> bytes:
    """Token ids -> little-endian uint32 bytes."""
    return np.asarray(ids, dtype="<u4").tobytes()


def decode_tokens(raw: Any) -> tuple[int, ...]:
    """Little-endian uint32 bytes -> token ids (validated: a non-empty whole number of ids)."""
    if not isinstance(raw, bytes):
        raise WireError(ErrorCode.MALFORMED, "token ids must be bin")
    if len(raw) % 4:
        raise WireError(ErrorCode.LENGTH_MISMATCH, f"{len(raw)} bytes is not a whole number of uint32 ids")
    if not raw:
        raise WireError(ErrorCode.BAD_SHAPE, "no token ids")
    return tuple(np.frombuffer(raw, dtype="<u4").tolist())


def decode_probs(raw: Any) -> torch.Tensor:
    """Little-endian float32 bytes -> probabilities [n] (range-checked by the field)."""
    if not isinstance(raw, bytes):
        raise WireError(ErrorCode.MALFORMED, "probabilities must be bin")
    if len(raw) % 4 or not raw:
        raise WireError(ErrorCode.LENGTH_MISMATCH, f"{len(raw)} bytes is not a whole, non-zero number of float32")
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())


M = TypeVar("M", bound=Message)


# dataclass_transform: tells the type checker what the run-time dataclass() call below makes of a
# message class (its __init__ from the `_f` fields, frozen), so constructor calls are checked.
@dataclass_transform(frozen_default=True, eq_default=False, field_specifiers=(_f,))
def _message(code: int) -> Callable[[type[M]], type[M]]:
    """Class decorator: frozen dataclass + registration under a unique type code."""

    def wrap(cls: type[M]) -> type[M]:
        if not 0 <= code < 128:  # a positive fixint: one byte on the wire
            raise TypeError(f"bad type code {code:#x}: not a positive fixint")
        cls = dataclasses.dataclass(frozen=True, eq=False, slots=True)(cls)
        cls.type = code
        cls._spec = tuple(
            (f.name, f.metadata["key"], f.metadata["kind"], f.default is not dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        )
        keys = [s[1] for s in cls._spec]
        if len(set(keys)) != len(keys) or {"v", "t"} & set(keys):
            raise TypeError(f"{cls.__name__}: wire keys must be unique and not v/t")
        cls._keys = frozenset(keys) | {"v", "t"}
        if code in TOKEN_MODE_CODES:  # the range *is* the declaration: no token message can forget the flag
            cls.carries_token_ids = True
        return _REGISTRY.register(code, cls)  # refuses a code taken twice

    return wrap


@_message(0x01)
class OpenSession(Message):
    """Device asks the cloud for a KV-cache session; session_id is device-chosen (u64).

    `split_layers` and `fingerprint` (`shared.model.checkpoint.split_fingerprint`: config plus the
    weights of layers m-1 and m) let the verifier refuse a device whose hidden states it would
    misread (SPLIT_MISMATCH) instead of answering with silently wrong ones. Both are required: a
    peer that predates them gets MALFORMED naming the missing or unexpected keys."""

    session_id: int = _f("s", U64)
    hidden_size: int = _f("H", U64)
    wire_dtype: WireDtype = _f("d", DTYPE, default=WireDtype.F16)
    privacy: bool = _f("pv", BOOL, default=True)  # True: cloud refuses token-id messages
    split_layers: int = _f("m", U64, kw_only=True)  # m: the device ran layers [0, m)
    fingerprint: int = _f("f", U64, kw_only=True)  # u64, not text: assert_privacy_safe refuses text fields


@_message(0x02)
class SessionOpened(Message):
    session_id: int = _f("s", U64)


@_message(0x03)
class CloseSession(Message):
    session_id: int = _f("s", U64)


@_message(0x04)
class SessionClosed(Message):
    session_id: int = _f("s", U64)


@_message(0x05)
class ForkSession(Message):
    """Open `session_id` as a copy of the first `length` positions of `parent_id` (None: all it holds), a
    session of the same connection with nothing queued or running: a prefix computed once (a kept prompt)
    goes on in many sessions without being sent or computed again. The child inherits the parent's privacy
    and wire dtype. Refused with UNKNOWN_SESSION (no such parent on this connection), OVERLOADED (the parent
    is busy, or no room), KV_BUDGET (the copy would pass the device's KV budget in bytes) or BAD_SHAPE
    (`length` beyond the parent's positions; with stage workers the main
    process does not know the lengths, so there a stage refuses it and the child's first item comes back
    UNKNOWN_SESSION, which the device's replay answers); answered SessionOpened."""

    session_id: int = _f("s", U64)
    parent_id: int = _f("ps", U64)
    length: int | None = _f("n", OPT_U64, default=None)


@_message(0x06)
class Reauthenticate(Message):
    """A fresh access token for the open connection (the one it connected with would expire): the verifier checks
    it as the handshake checked the first (audience, role, and the connection's own device) and keeps the
    connection open under it. No reply; a refused token is answered with ErrorFrame CREDENTIAL and the
    connection is closed (1008). With auth off it is accepted and ignored. The token is a credential, never
    prompt text, so `assert_privacy_safe` lets it through."""

    token: str = _f("k", CREDENTIAL)

    def __repr__(self) -> str:  # never a token in a log line
        return f"Reauthenticate(token=<{len(self.token)} chars>)"


@_message(0x10)
class PrefillChunk(Message):
    """Shallow hidden states of prompt positions start_pos..start_pos+S-1."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    start_pos: int = _f("p", U64)
    is_last: bool = _f("l", BOOL)
    hidden: torch.Tensor = _f("h", TENSOR)  # hidden: [S, H]


@_message(0x11)
class ChunkAck(Message):
    """Reply to a non-last PrefillChunk (flow control: the device may send the next)."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)


@_message(0x12)
class DeepHidden(Message):
    """Reply to the last PrefillChunk: deep hidden state(s) of the last position(s)."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    hidden: torch.Tensor = _f("h", TENSOR)  # hidden: [1, H]


@_message(0x20)
class VerifyRequest(Message):
    """Cloud truncates the session KV to commit_len (rollback), then runs `hidden`.

    A draft tree (shared/specdec/tree.py): `parents[i - 1]` is the parent row of row i (row 0, the pending
    token, is the root; every parent comes before its child), and the cloud runs the rows with tree
    attention (committed KV + each row's ancestors, positions commit_len + depth). `kept`: the rows of the
    previous tree the device accepted (absolute cache rows, increasing); before rolling back, the cloud moves
    them to positions commit_len - len(kept) .. commit_len - 1, so only that path stays in its KV."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    commit_len: int = _f("c", U64)
    hidden: torch.Tensor = _f("h", TENSOR)  # hidden: [K, H] shallow states of K drafts
    parents: tuple[int, ...] | None = _f("pa", OPT_ROWS, default=None)  # [K - 1]: tree rows' parents
    kept: tuple[int, ...] | None = _f("kp", OPT_ROWS, default=None)  # previous tree rows to keep, in order

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        rows = self.hidden.shape[0]
        if self.parents is not None:
            if len(self.parents) != rows - 1 or rows > MAX_TREE_ROWS:
                raise WireError(
                    ErrorCode.BAD_SHAPE,
                    f"a tree of {rows} rows (at most {MAX_TREE_ROWS}) needs {rows - 1} parents, "
                    f"got {len(self.parents)}",
                )
            bad = next((i for i, parent in enumerate(self.parents, start=1) if parent >= i), None)
            if bad is not None:
                raise WireError(
                    ErrorCode.BAD_SHAPE, f"tree row {bad}'s parent {self.parents[bad - 1]} does not come before it"
                )
        if self.kept is not None:
            if len(self.kept) > self.commit_len or any(b <= a for a, b in zip(self.kept, self.kept[1:])):
                raise WireError(ErrorCode.BAD_SHAPE, "kept rows must be increasing and no more than commit_len")
            if self.kept and self.kept[0] < self.commit_len - len(self.kept):
                raise WireError(ErrorCode.BAD_SHAPE, "kept rows cannot move to later positions")


@_message(0x21)
class VerifyResult(Message):
    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    hidden: torch.Tensor = _f("h", TENSOR)  # hidden: [K, H] deep states


@_message(0x30)
class BandwidthProbe(Message):
    """Device -> cloud: carries `hidden` up and asks for `reply_rows` rows back. Timing a
    big-up/small-down probe against a small/small one measures the uplink, and a big/big one
    against the big-up/small-down one the downlink, with the same framing as real traffic
    (hidden rows are only padding). The verifier refuses reply_rows above the rows it was sent
    (BAD_SHAPE), so a small frame cannot ask for a big one."""

    session_id: int = _f("s", U64)  # 0: not tied to a session
    seq_no: int = _f("q", U64)
    reply_rows: int = _f("r", U64)
    hidden: torch.Tensor = _f("h", TENSOR)  # padding: [rows, H]


@_message(0x31)
class ProbeReply(Message):
    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    hidden: torch.Tensor = _f("h", TENSOR)  # padding: [reply_rows, H]


@_message(0x40)
class OpenTokenSession(Message):
    """Token mode (HAT's "cloud" baseline): the cloud runs the whole model on token ids and samples.

    A separate message rather than new OpenSession fields: the strict schema makes an
    added key MALFORMED for an older peer, so extending OpenSession would be a version
    bump, while a new type costs an old verifier only an UNKNOWN_TYPE answer. The
    session has privacy off by construction; sampling parameters live here because the
    cloud, not the device, draws every token.
    """

    session_id: int = _f("s", U64)
    temperature: float = _f("T", FLOAT, default=0.0)  # 0 = greedy
    top_p: float = _f("P", FLOAT, default=1.0)
    seed: int | None = _f("r", OPT_U64, default=None)  # None: the generator's fixed default seed

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise WireError(
                ErrorCode.MALFORMED,
                f"temperature {self.temperature} must be >= 0 and top_p {self.top_p} in (0, 1]",
                self.session_id,
            )


@_message(0x41)
class TokenPrefill(Message):
    """Prompt ids at positions start_pos..; the cloud answers TokenResult with the next token."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    token_ids: tuple[int, ...] = _f("i", TOKENS)
    start_pos: int = _f("p", U64, default=0)


@_message(0x42)
class TokenStep(Message):
    """Roll back to commit_len, append token_ids (usually the last sampled one), answer the next token."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    commit_len: int = _f("c", U64)
    token_ids: tuple[int, ...] = _f("i", TOKENS)


@_message(0x43)
class TokenResult(Message):
    """The token(s) the cloud sampled (one per step in autoregressive cloud mode)."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    token_ids: tuple[int, ...] = _f("i", TOKENS)


@_message(0x44)
class TokenDraft(Message):
    """One chunk of a streamed draft (shared/specdec/draft_stream.py): ids at positions start_pos..; the
    first `num_final` (0 or 1) are final, the rest drafts with q(x) each (`draft_probs`, absent when greedy).
    `more`: another chunk follows in this epoch (no bonus on full acceptance). `top_k`: on a rejection send
    the target row's top-K (0: the whole row). Answered by TokenVerdict; a chunk of an earlier epoch is
    answered `stale` without being run."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    epoch: int = _f("e", U64)
    start_pos: int = _f("p", U64)
    token_ids: tuple[int, ...] = _f("i", TOKENS)
    num_final: int = _f("f", U64)
    more: bool = _f("m", BOOL)
    top_k: int = _f("k", U64, default=10)
    draft_probs: torch.Tensor | None = _f("dq", OPT_PROBS, default=None)  # [len(token_ids) - num_final]

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        if self.num_final > 1 or (
            self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids) - self.num_final
        ):
            raise WireError(
                ErrorCode.BAD_SHAPE,
                f"num_final {self.num_final} must be 0 or 1 and draft_probs hold one probability per draft",
                self.session_id,
                self.seq_no,
            )


@_message(0x45)
class TokenVerdict(Message):
    """The verdict on a TokenDraft: `num_accepted` drafts accepted; then, unless `stale`, either the bonus
    (`token`, all accepted and no more promised), nothing (all accepted, more promised), or a rejection
    (`rejected`): the correction itself (`token`, greedy) or the target row at the rejected position for the
    device to sample it, as top-K `probs` + `indices`, or the whole row (`probs` of `vocab_size`).
    `epoch` is the stream's epoch after this verdict."""

    session_id: int = _f("s", U64)
    seq_no: int = _f("q", U64)
    epoch: int = _f("e", U64)
    num_accepted: int = _f("n", U64)
    rejected: bool = _f("r", BOOL, default=False)
    stale: bool = _f("st", BOOL, default=False)
    token: int | None = _f("x", OPT_U64, default=None)
    vocab_size: int | None = _f("V", OPT_U64, default=None)
    probs: torch.Tensor | None = _f("pv", OPT_PROBS, default=None)
    indices: tuple[int, ...] | None = _f("pi", OPT_TOKENS, default=None)

    def __post_init__(self) -> None:
        Message.__post_init__(self)
        probs = self.probs
        has_row = probs is not None
        ok = (
            not (self.stale and (self.rejected or self.token is not None or has_row))
            and (has_row == (self.rejected and self.token is None))
            and (not has_row or self.vocab_size is not None)
            and (self.indices is None or (probs is not None and len(self.indices) == probs.shape[0]))
            and (probs is None or self.indices is not None or probs.shape[0] == self.vocab_size)
        )
        if not ok:
            raise WireError(ErrorCode.MALFORMED, "inconsistent TokenVerdict", self.session_id, self.seq_no)


@_message(0x7F)
class ErrorFrame(Message):
    code: ErrorCode = _f("e", CODE)
    message: str = _f("m", TEXT)
    session_id: int | None = _f("s", OPT_U64, default=None)
    seq_no: int | None = _f("q", OPT_U64, default=None)


# ---------------------------------------------------------------- frames


def encode(msg: Message, *, wire_dtype: WireDtype | str | None = None) -> bytes:
    """Message -> frame. Tensors go in `wire_dtype`; None keeps a wire dtype as-is, else f16."""
    out: dict[str, Any] = {"v": WIRE_VERSION, "t": msg.type}
    for name, key, kind, _has_default in msg._spec:
        value = getattr(msg, name)
        if value is None:
            continue  # absent optional fields cost zero bytes
        if kind == TENSOR:
            wd = wire_dtype or _FROM_TORCH.get(value.dtype, WireDtype.F16)
            value = encode_tensor(value, wd)
        elif kind in (TOKENS, OPT_TOKENS, OPT_ROWS):
            value = encode_tokens(value)
        elif kind == OPT_PROBS:
            value = value.numpy().astype("<f4").tobytes()
        elif kind in (DTYPE, CODE):
            value = value.value
        out[key] = value
    return pack(out)


def decode(
    frame: bytes,
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    expected_hidden_size: int | None = None,
    finite_only: bool = False,
) -> Message:
    """Frame -> validated Message; raises WireError (with session/seq when known).
    `finite_only`: tensors holding NaN/Inf are BAD_VALUE (the verifier's receive path)."""
    try:  # the size is checked before unpacking: an oversized frame is never parsed
        m = unpack(frame, max_frame_bytes=max_frame_bytes, limits=_UNPACK_LIMITS)
    except FrameTooLarge as exc:
        raise WireError(ErrorCode.OVERSIZED, str(exc)) from None
    except NotMsgpack as exc:  # truncated, trailing data, bad utf-8, not bytes at all...
        raise WireError(ErrorCode.MALFORMED, str(exc)) from None
    if not isinstance(m, dict):
        raise WireError(ErrorCode.MALFORMED, "frame must be a map")
    if "v" not in m:
        raise WireError(ErrorCode.MALFORMED, "missing version")
    if m["v"] != WIRE_VERSION or not _is_int(m["v"]):
        raise WireError(ErrorCode.BAD_VERSION, f"version {m['v']!r} != {WIRE_VERSION}")
    sid, seq = m.get("s"), m.get("q")
    try:
        return _decode_map(m, expected_hidden_size, finite_only)
    except WireError as err:
        if err.session_id is None:  # address the error only with ids that are themselves valid
            err.session_id = _u64_or_none(sid)
        if err.seq_no is None:
            err.seq_no = _u64_or_none(seq)
        logger.debug("rejecting frame: %s", err)
        raise


def _decode_map(m: dict, expected_hidden_size: int | None, finite_only: bool = False) -> Message:
    code = m.get("t")
    if not _is_int(code):
        raise WireError(ErrorCode.MALFORMED, "missing or non-int type")
    cls = _TYPES.get(code)
    if cls is None:
        raise WireError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {code!r}")
    extra = m.keys() - cls._keys
    if extra:
        raise WireError(ErrorCode.MALFORMED, f"{cls.__name__}: unexpected keys {sorted(extra)}")
    kwargs = {}
    for name, key, kind, has_default in cls._spec:
        if key not in m:
            if has_default:
                continue
            raise WireError(ErrorCode.MALFORMED, f"{cls.__name__}: missing field {name}")
        value = m[key]
        if kind == TENSOR:
            value = decode_tensor(value, expected_hidden_size, finite_only=finite_only)
        elif kind in (TOKENS, OPT_TOKENS, OPT_ROWS):
            value = decode_tokens(value)
        elif kind == OPT_PROBS:
            value = decode_probs(value)
        kwargs[name] = value
    msg = cls(**kwargs)
    if expected_hidden_size is not None and isinstance(msg, OpenSession) and msg.hidden_size != expected_hidden_size:
        raise WireError(ErrorCode.BAD_SHAPE, f"hidden_size {msg.hidden_size} != expected {expected_hidden_size}")
    return msg


def assert_privacy_safe(frame: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Raise PRIVACY_VIOLATION if a frame could leak the prompt: token ids or free text.

    Only ErrorFrame.message may hold text (it is written by our own code, never
    from prompt data); enum codes like the dtype are not free text.
    """
    msg = decode(frame, max_frame_bytes=max_frame_bytes)
    sid, seq = getattr(msg, "session_id", None), getattr(msg, "seq_no", None)
    if msg.carries_token_ids:
        raise WireError(ErrorCode.PRIVACY_VIOLATION, f"{type(msg).__name__} carries token ids", sid, seq)
    for name, _key, kind, _opt in msg._spec:
        value = getattr(msg, name)
        if kind == CREDENTIAL:  # a bearer token, not prompt data
            continue
        if isinstance(value, str) and not (isinstance(msg, ErrorFrame) and name == "message"):
            raise WireError(ErrorCode.PRIVACY_VIOLATION, f"text in field {name}", sid, seq)
    return msg
