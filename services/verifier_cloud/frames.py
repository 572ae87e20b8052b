"""Between the wire and the engine: work items from request frames, reply frames from results.

The scheduler, runner and pipeline speak `WorkItem` / `EngineError` (work.py)
and never import the wire; the server speaks frames. These functions are the
whole translation, so each direction is written once; the frames answered without
the engine (a bandwidth probe's padding, an OpenSession's split check) are here too.
`BadFrameLog` is how a connection's bad frames are logged.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from services.verifier_cloud.token_mode import StreamedChunk
from services.verifier_cloud.work import EngineError, WorkKind
from services.verifier_cloud.work_item import Reply, WorkItem
from shared.specdec.draft_stream import ChunkVerdict, DraftChunk, StreamProtocolError
from shared.specdec.verify_layout import VerifyLayout
from shared.wire import schema as wire

log = logging.getLogger("services.verifier_cloud")

WorkMessage = wire.PrefillChunk | wire.VerifyRequest | wire.TokenPrefill | wire.TokenStep | wire.TokenDraft
TOKEN_WORK = (wire.TokenPrefill, wire.TokenStep, wire.TokenDraft)
MAX_PROBE_ROWS = 4096  # a probe reply is padding; cap it so a probe cannot ask for a huge frame


def to_wire(error: EngineError, session_id: int | None = None, seq_no: int | None = None) -> wire.WireError:
    """The engine's typed error as the wire's (same code names), addressed to the session and seq it concerns."""
    return wire.WireError(
        wire.ErrorCode[error.kind.name],
        error.message,
        error.session_id if error.session_id is not None else session_id,
        error.seq_no if error.seq_no is not None else seq_no,
    )


def probe_reply(message: wire.BandwidthProbe) -> wire.ProbeReply:
    """A bandwidth probe's answer: reply_rows rows of padding [rows, H] (no model data)."""
    # No amplification: the padding sent back is never more rows than came up (downlink probes pad uploads).
    if message.reply_rows > message.hidden.shape[0]:
        raise wire.WireError(
            wire.ErrorCode.BAD_SHAPE,
            f"reply_rows {message.reply_rows} > the probe's own {message.hidden.shape[0]} rows",
            message.session_id,
            message.seq_no,
        )
    rows = max(1, min(message.reply_rows, MAX_PROBE_ROWS))
    padding = torch.zeros(rows, message.hidden.shape[1], dtype=torch.float16)
    return wire.ProbeReply(message.session_id, message.seq_no, padding)


def check_split(message: wire.OpenSession, split_layers: int, fingerprint: int) -> None:
    """Refuse (SPLIT_MISMATCH) a device whose hidden states this verifier would misread: another split layer,
    or another checkpoint (config or layers m-1, m)."""
    if message.split_layers != split_layers:
        raise wire.WireError(
            wire.ErrorCode.SPLIT_MISMATCH,
            f"the device splits at layer {message.split_layers}, this verifier at layer {split_layers}",
            message.session_id,
        )
    if message.fingerprint != fingerprint:
        raise wire.WireError(
            wire.ErrorCode.SPLIT_MISMATCH,
            f"checkpoint fingerprint {message.fingerprint:016x} is not this verifier's {fingerprint:016x} "
            "(config or layers m-1, m differ)",
            message.session_id,
        )


def work_item(message: WorkMessage, reply: Reply) -> WorkItem:
    """The queued work a request frame asks for: a prefill appends at start_pos, a verify rolls back to
    commit_len and appends; token messages carry ids (the cloud embeds them) and always get the next token."""
    is_prefill = isinstance(message, (wire.PrefillChunk, wire.TokenPrefill))
    draft = streamed_chunk(message) if isinstance(message, wire.TokenDraft) else None
    return WorkItem(
        session_id=message.session_id,
        seq_no=message.seq_no,
        kind=WorkKind.PREFILL if is_prefill else WorkKind.VERIFY,
        hidden=None if isinstance(message, TOKEN_WORK) else message.hidden,
        # prefills and drafts append at start_pos; verifies and token steps roll back to commit_len first
        position=(
            message.start_pos
            if isinstance(message, (wire.PrefillChunk, wire.TokenPrefill, wire.TokenDraft))
            else message.commit_len
        ),
        is_last=message.is_last if isinstance(message, wire.PrefillChunk) else True,
        reply=reply,
        token_ids=torch.tensor(message.token_ids, dtype=torch.long) if isinstance(message, TOKEN_WORK) else None,
        draft=draft,
        layout=(
            VerifyLayout(message.parents, message.kept)
            if isinstance(message, wire.VerifyRequest) and (message.parents or message.kept)
            else None
        ),
    )


def streamed_chunk(message: wire.TokenDraft) -> StreamedChunk:
    try:
        chunk = DraftChunk(
            message.epoch, message.start_pos, message.token_ids, message.num_final, message.draft_probs, message.more
        )
    except StreamProtocolError as exc:
        raise wire.WireError(wire.ErrorCode.BAD_SHAPE, str(exc), message.session_id, message.seq_no) from None
    return StreamedChunk(chunk, message.top_k)


def verdict_frame(session_id: int, seq_no: int, verdict: ChunkVerdict) -> wire.TokenVerdict:
    """A streamed chunk's verdict on the wire: only what changed (tens of bytes unless a row goes down)."""
    payload = verdict.rejection
    if payload is None or payload.kind == "token":
        token = verdict.token if payload is None else payload.token
        return wire.TokenVerdict(
            session_id,
            seq_no,
            verdict.epoch,
            verdict.num_accepted,
            rejected=payload is not None,
            stale=verdict.stale,
            token=token,
        )
    assert payload.values is not None  # "topk" and "full" payloads carry the target's row
    indices = None
    if payload.kind == "topk":
        assert payload.indices is not None  # and "topk" its token ids
        indices = tuple(payload.indices.tolist())
    return wire.TokenVerdict(
        session_id,
        seq_no,
        verdict.epoch,
        verdict.num_accepted,
        rejected=True,
        vocab_size=payload.vocab_size,
        probs=payload.values.float().contiguous(),
        indices=indices,
    )


def reply_frame(item: WorkItem, out: torch.Tensor | ChunkVerdict | None, error: EngineError | None) -> wire.Message:
    """What the device gets for a finished item (out: deep states [S, H], sampled ids [1] for token items,
    or the verdict on a streamed draft)."""
    if error is not None:
        return to_wire(error, item.session_id, item.seq_no).to_frame()
    if item.draft is not None:
        assert isinstance(out, ChunkVerdict)  # a streamed draft's result is its verdict
        return verdict_frame(item.session_id, item.seq_no, out)
    if item.is_token:
        assert isinstance(out, torch.Tensor)  # token items always sample (is_last)
        return wire.TokenResult(item.session_id, item.seq_no, tuple(out.tolist()))  # the wire keeps a tuple
    assert isinstance(out, torch.Tensor)  # a hidden item's deep states
    if item.kind is WorkKind.VERIFY:
        return wire.VerifyResult(item.session_id, item.seq_no, out)
    if item.is_last:
        return wire.DeepHidden(item.session_id, item.seq_no, out[-1:])
    return wire.ChunkAck(item.session_id, item.seq_no)


BAD_FRAME_SUMMARY_S = 10.0  # at most one INFO line about a connection's bad frames per this many seconds


class BadFrameLog:
    """One connection's bad frames: each at DEBUG, and an INFO summary (count by code) at most once per
    interval and when the connection ends, so a peer sending garbage cannot flood the log."""

    def __init__(
        self, peer: object, interval_s: float = BAD_FRAME_SUMMARY_S, on_count: Callable[[str], None] | None = None
    ) -> None:
        """`on_count(code name)`: every bad frame, as it comes (the verifier's metrics); must not raise."""
        self.peer, self.interval_s, self.on_count = peer, interval_s, on_count
        self.counts: Counter[str] = Counter()
        self.since = time.monotonic()
        self.traced_internal = False

    def bad_frame(self, error: wire.WireError) -> None:
        log.debug("bad frame from %s: %s", self.peer, error)
        self._count(error.code)

    def internal(self, exc: Exception) -> None:
        """Call inside the except block: the first bug of a connection is logged with its traceback."""
        if not self.traced_internal:
            self.traced_internal = True
            log.exception("bad frame from %s raised %s; answering INTERNAL", self.peer, type(exc).__name__)
        else:
            log.debug("bad frame from %s raised %s; answering INTERNAL", self.peer, type(exc).__name__, exc_info=True)
        self._count(wire.ErrorCode.INTERNAL)

    def _count(self, code: wire.ErrorCode) -> None:
        self.counts[code.name] += 1
        if self.on_count is not None:
            self.on_count(code.name)
        if time.monotonic() - self.since >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        if self.counts:
            total = sum(self.counts.values())
            log.info(
                "%d bad frame(s) from %s in %.0f s: %s",
                total,
                self.peer,
                time.monotonic() - self.since,
                ", ".join(f"{code} {n}" for code, n in self.counts.most_common()),
                extra={"bad_frames": total},
            )
            self.counts.clear()
        self.since = time.monotonic()
