"""The verifier engine's own vocabulary: kinds of work and typed errors.

Shared by the scheduler (policy), the model runner (compute, in this process
or in a stage worker) and the pipeline; none of them imports the wire format.
The server maps an `EngineError` to a wire ErrorFrame by the code's name.
"""

from __future__ import annotations

import enum
from typing import Any


class WorkKind(enum.StrEnum):
    """What an item asks of a session's KV (a str: equal to "prefill" / "verify" in logs and records)."""

    PREFILL = "prefill"  # append at the end: position must equal the cached length
    VERIFY = "verify"  # roll back to position (commit_len), then append (a token step is one too)


class TokenItem:
    """What a queued item (scheduler) and a running one (runner) both know: its rows, hidden or token ids."""

    hidden: Any  # [S, H] states, or None for token items
    token_ids: Any  # [S] ids for token items, else None
    draft: Any = None  # token items of a streamed draft: the StreamedChunk to verify (token_mode.py)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0] if self.token_ids is not None else self.hidden.shape[0]

    @property
    def is_token(self) -> bool:
        return self.token_ids is not None


class ErrorKind(enum.IntEnum):
    """Why an item or a session request failed; names match shared.wire.schema.ErrorCode's."""

    MALFORMED = 1
    BAD_SHAPE = 5
    UNKNOWN_SESSION = 7
    INTERNAL = 10
    OVERLOADED = 11
    KV_BUDGET = 14  # the KV it would take passes a KV budget in bytes (budgets.py)
    QUEUE_BUDGET = 15  # its queued bytes would pass a queue budget (budgets.py)


class EngineError(Exception):
    """A typed failure of one item or one session request (never of the engine itself)."""

    def __init__(self, kind: ErrorKind, message: str, session_id: int | None = None, seq_no: int | None = None):
        super().__init__(f"{kind.name}: {message}")
        self.kind, self.message = kind, message
        self.session_id, self.seq_no = session_id, seq_no


def check_item(
    kind: WorkKind, position: int, num_tokens: int, cache_length: int, context_length: int
) -> EngineError | None:
    """Why an item cannot run against a cache of `cache_length` positions (None: it can).

    The one check used by the in-process runner and every pipeline stage, so both
    refuse exactly the same requests with exactly the same errors.
    """
    if kind is WorkKind.PREFILL and position != cache_length:
        return EngineError(ErrorKind.MALFORMED, f"chunk starts at {position}, session holds {cache_length}")
    if kind is WorkKind.VERIFY and not 0 <= position <= cache_length:
        return EngineError(ErrorKind.MALFORMED, f"commit_len {position} beyond {cache_length} cached positions")
    base = cache_length if kind is WorkKind.PREFILL else position
    if base + num_tokens > context_length:
        return EngineError(ErrorKind.BAD_SHAPE, f"session would exceed the context length {context_length}")
    return None
