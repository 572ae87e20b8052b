"""Between the wire and the engine: work items from request frames, reply frames from results.

The scheduler, runner and pipeline speak `WorkItem` / `EngineError` (work.py)
and never import the wire; the server speaks frames. These functions are the
whole translation, so each direction is written once.
"""

from __future__ import annotations

import torch

from services.verifier_cloud.scheduler import Reply, WorkItem
from services.verifier_cloud.work import EngineError, WorkKind
from shared import wire

WorkMessage = wire.PrefillChunk | wire.VerifyRequest | wire.TokenPrefill | wire.TokenStep


def to_wire(error: EngineError, session_id: int | None = None, seq_no: int | None = None) -> wire.WireError:
    """The engine's typed error as the wire's (same code names), addressed to the session and seq it concerns."""
    return wire.WireError(wire.ErrorCode[error.kind.name], error.message,
                          error.session_id if error.session_id is not None else session_id,
                          error.seq_no if error.seq_no is not None else seq_no)


def work_item(message: WorkMessage, reply: Reply) -> WorkItem:
    """The queued work a request frame asks for: a prefill appends at start_pos, a verify rolls back to
    commit_len and appends; token messages carry ids (the cloud embeds them) and always get the next token."""
    is_prefill = isinstance(message, (wire.PrefillChunk, wire.TokenPrefill))
    is_token = isinstance(message, (wire.TokenPrefill, wire.TokenStep))
    return WorkItem(
        session_id=message.session_id,
        seq_no=message.seq_no,
        kind=WorkKind.PREFILL if is_prefill else WorkKind.VERIFY,
        hidden=None if is_token else message.hidden,
        position=message.start_pos if is_prefill else message.commit_len,
        is_last=message.is_last if is_prefill and not is_token else True,
        reply=reply,
        token_ids=torch.tensor(message.token_ids, dtype=torch.long) if is_token else None,
    )


def reply_frame(item: WorkItem, out: torch.Tensor | None, error: EngineError | None) -> wire.Message:
    """What the device gets for a finished item (out: deep states [S, H], or sampled ids [1] for token items)."""
    if error is not None:
        return to_wire(error, item.session_id, item.seq_no).to_frame()
    if item.is_token:
        return wire.TokenResult(item.session_id, item.seq_no, out.tolist())
    if item.kind is WorkKind.VERIFY:
        return wire.VerifyResult(item.session_id, item.seq_no, out)
    if item.is_last:
        return wire.DeepHidden(item.session_id, item.seq_no, out[-1:])
    return wire.ChunkAck(item.session_id, item.seq_no)
