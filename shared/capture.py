"""Capture files: every hidden-state frame a verifier accepted, as the cloud received it.

An audit tool for measured privacy (issue 17): a verifier started with
`TOPHAT_VERIFIER_CAPTURE_PATH` appends one record per PrefillChunk and
VerifyRequest it accepts as work, so an attack harness sees exactly what a
cloud operator could keep. Frames refused with an error are not recorded;
token-mode traffic (token ids, not hidden states) is never recorded.

File layout: the magic line `MAGIC`, then records, each a 4-byte big-endian
length and that many bytes of msgpack:

    {"session_id": u64, "seq_no": u64, "kind": "prefill" | "verify", "start": u64,
     "rows": {"dtype": "float16" | "bfloat16" | "float32", "shape": [S, H], "raw": bin}}

`start` is the position of the first row: a prefill chunk's start_pos, a
verify request's commit_len. `rows` is the tensor exactly as decoded from the
wire (its dtype and shape, raw little-endian bytes), so comparisons are bitwise.

Each record is written and flushed whole, so a crash leaves at most a
truncated last record. `read_capture` then raises `CaptureFormatError` with
`truncated` set and the complete records before it in `frames`: the caller
decides whether a cut-off tail is acceptable (an audit of a crashed verifier)
or not. Any other damage raises the same error with `truncated` unset.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgpack
import torch

log = logging.getLogger("shared.capture")

MAGIC = b"tophat-capture/1\n"
_LENGTH = struct.Struct(">I")
MAX_RECORD_BYTES = 1 << 31  # far above any frame; a larger length prefix is damage, not a record
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_KINDS = ("prefill", "verify")
_KEYS = {"session_id", "seq_no", "kind", "start", "rows"}

FrameKind = Literal["prefill", "verify"]


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value; compare fields and rows.equal
class CapturedFrame:
    session_id: int
    seq_no: int
    kind: FrameKind
    start: int  # position of the first row: start_pos (prefill) or commit_len (verify)
    rows: torch.Tensor  # rows: [S, H] in the wire dtype


class CaptureFormatError(ValueError):
    """A capture file that is not one, or is damaged. `frames`: the complete records before the damage;
    `truncated`: the damage is only a cut-off last record (what a crash mid-write leaves)."""

    def __init__(self, message: str, frames: list[CapturedFrame], offset: int, truncated: bool) -> None:
        super().__init__(f"{message} (at byte {offset}; {len(frames)} complete record(s) before it)")
        self.frames, self.offset, self.truncated = frames, offset, truncated


def encode_record(session_id: int, seq_no: int, kind: FrameKind, start: int, rows: torch.Tensor) -> bytes:
    """One record, length prefix included. rows: [S, H] on the CPU in float16, bfloat16 or float32."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if rows.dtype not in _DTYPE_NAMES or rows.dim() != 2:
        raise ValueError(f"rows must be a 2-D float16/bfloat16/float32 tensor, got {rows.dtype} {tuple(rows.shape)}")
    raw = rows.detach().to("cpu").contiguous().view(torch.uint8).numpy()  # the bytes as held, no cast
    body = msgpack.packb(
        {
            "session_id": session_id,
            "seq_no": seq_no,
            "kind": kind,
            "start": start,
            "rows": {"dtype": _DTYPE_NAMES[rows.dtype], "shape": list(rows.shape), "raw": raw.data},
        },
        use_bin_type=True,
    )
    return _LENGTH.pack(len(body)) + body


class CaptureWriter:
    """Appends records to a capture file; owned by the verifier, closed when it stops.

    Writes are synchronous on the caller's thread (the event loop): one write of at most a frame's size to
    the page cache and a flush, no fsync. A failed write (disk full, file gone) is logged and ends the
    capture: the file then holds every accepted frame up to the failure and none after, never a gap."""

    def __init__(self, path: str | Path, file: BinaryIO) -> None:
        self.path = Path(path)
        self._file: BinaryIO | None = file
        self.records = 0
        self.failed = False

    @classmethod
    def open(cls, path: str | Path) -> "CaptureWriter":
        """Append to `path` (created with its magic if new or empty; an existing file must be a capture)."""
        file = open(path, "ab")
        try:
            if file.tell() == 0:
                file.write(MAGIC)
                file.flush()
            else:
                with open(path, "rb") as existing:
                    if existing.read(len(MAGIC)) != MAGIC:
                        raise CaptureFormatError(f"{path} exists and is not a capture file", [], 0, False)
        except BaseException:
            file.close()
            raise
        return cls(path, file)

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def record(self, session_id: int, seq_no: int, kind: FrameKind, start: int, rows: torch.Tensor) -> None:
        """Append one accepted frame. Never raises on I/O: see the class docstring."""
        if self._file is None:
            return
        record = encode_record(session_id, seq_no, kind, start, rows)
        try:
            self._file.write(record)
            self._file.flush()
        except OSError as exc:
            log.error(
                "capture %s: writing failed (%s); capture stopped after %d record(s)", self.path, exc, self.records
            )
            self.failed = True
            self._close_quietly()
            return
        self.records += 1

    def close(self) -> None:
        if self._file is not None:
            log.info("capture %s closed: %d record(s)", self.path, self.records)
        self._close_quietly()

    def _close_quietly(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as exc:  # a failed final flush: what was flushed before is in the file
                log.error("capture %s: closing failed (%s)", self.path, exc)


def read_capture(path: str | Path) -> list[CapturedFrame]:
    """Every record of a capture file, in the order the verifier accepted them. Raises CaptureFormatError
    (see the module docstring) for a file that is not a capture or is damaged or truncated."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise CaptureFormatError(
            f"{path} is not a capture file (no {MAGIC!r} header)", [], 0, truncated=MAGIC.startswith(data)
        )
    frames: list[CapturedFrame] = []
    offset = len(MAGIC)
    while offset < len(data):
        if len(data) - offset < _LENGTH.size:
            raise CaptureFormatError("truncated length prefix", frames, offset, truncated=True)
        (length,) = _LENGTH.unpack_from(data, offset)
        if length > MAX_RECORD_BYTES:
            raise CaptureFormatError(f"record length {length} is not plausible", frames, offset, truncated=False)
        body = data[offset + _LENGTH.size : offset + _LENGTH.size + length]
        if len(body) < length:
            raise CaptureFormatError(f"truncated record: {len(body)} of {length} bytes", frames, offset, truncated=True)
        try:
            frames.append(_decode_record(body))
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise CaptureFormatError(f"bad record: {exc}", frames, offset, truncated=False) from None
        offset += _LENGTH.size + length
    return frames


def _decode_record(body: bytes) -> CapturedFrame:
    obj: Any = msgpack.unpackb(body, raw=False)
    if not isinstance(obj, dict) or obj.keys() != _KEYS:
        raise ValueError(f"a record is a map with keys {sorted(_KEYS)}")
    ints = [obj["session_id"], obj["seq_no"], obj["start"]]
    if not all(type(v) is int and v >= 0 for v in ints) or obj["kind"] not in _KINDS:
        raise ValueError("session_id, seq_no, start must be non-negative ints and kind prefill or verify")
    rows = obj["rows"]
    if not isinstance(rows, dict) or rows.keys() != {"dtype", "shape", "raw"}:
        raise ValueError("rows must be a map with keys dtype, shape, raw")
    dtype, shape, raw = _DTYPES.get(rows["dtype"]), rows["shape"], rows["raw"]
    if dtype is None:
        raise ValueError(f"unknown dtype {rows['dtype']!r}")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(type(d) is int and d > 0 for d in shape)
        or not isinstance(raw, bytes)
    ):
        raise ValueError("shape must be two positive ints and raw bytes")
    if len(raw) != shape[0] * shape[1] * dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes do not hold {shape} {rows['dtype']}")
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape[0], shape[1])  # [S, H]
    return CapturedFrame(obj["session_id"], obj["seq_no"], obj["kind"], obj["start"], tensor)
