"""One queued unit of verifier work: a prefill chunk or a verify step of one session, and its reply hook.

Its own module, below both the scheduler (which queues and splits items) and the session record
(which holds a session's queue of them), so neither imports the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.verifier_cloud.work import EngineError, TokenItem, WorkKind
from shared.specdec.draft_stream import ChunkVerdict
from shared.specdec.verify_layout import VerifyLayout

if TYPE_CHECKING:  # token_mode loads the model code; this module stays below it
    from services.verifier_cloud.token_mode import StreamedChunk

# (item, output, error) -> None. Output: deep states [S, H]; for token items, the sampled ids [1] (or None),
# or the verdict on a streamed draft chunk.
Reply = Callable[["WorkItem", torch.Tensor | ChunkVerdict | None, EngineError | None], None]


@dataclass(eq=False)
class WorkItem(TokenItem):
    session_id: int
    seq_no: int
    kind: WorkKind  # a token step is a VERIFY: roll back to position, append, answer ("prefill"/"verify" accepted)
    hidden: torch.Tensor | None  # [S, H] shallow (or previous-stage) states; None for token items
    position: int  # prefill: start_pos; verify: commit_len
    is_last: bool = False  # prefill: reply with the last deep state (token items: sample the next token)
    reply: Reply | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)
    token_ids: torch.Tensor | None = None  # [S] int64: token mode (the cloud embeds them itself)
    draft: StreamedChunk | None = None  # a streamed draft chunk to verify; never split
    layout: VerifyLayout | None = None  # a verify's draft tree and the rows kept of the last one; never split
    # The open session it was scheduled on (set by the scheduler): a closed id can be opened again while
    # this item is computed, and the new session must get none of its result, in-flight slot or rollback.
    session: object | None = None  # compared by identity only (`is`), so any record type will do
    queued_bytes: int = 0  # what its queue budget was charged when it was admitted (budgets.py)

    def __post_init__(self) -> None:
        self.kind = WorkKind(self.kind)

    def split_front(self, size: int, reply: Reply) -> "WorkItem":
        """Detach the first `size` positions as a piece of their own; this item keeps the rest."""
        piece = WorkItem(
            self.session_id,
            self.seq_no,
            self.kind,
            None if self.hidden is None else self.hidden[:size],
            self.position,
            False,
            reply,
            self.enqueued_at,
            None if self.token_ids is None else self.token_ids[:size],
        )
        if self.hidden is not None:
            self.hidden = self.hidden[size:]
        if self.token_ids is not None:
            self.token_ids = self.token_ids[size:]
        self.position += size
        return piece
