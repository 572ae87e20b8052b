"""One record per open verifier session: everything the main process knows about it.

The KV itself lives with the model runner that computes it (in this process,
or one slice per pipeline stage worker); everything else about a session is
here, in one place: who opened it, what it asked for, its queue of work, what
of it is being computed, and when it was last heard from.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.verifier_cloud.work import WorkKind

if TYPE_CHECKING:
    from services.verifier_cloud.work_item import WorkItem
    from shared.specdec.sampling import SamplingParams


@dataclass(eq=False)
class Session:
    session_id: int
    owner: object  # the connection that opened it: only it may use the session
    privacy: bool = True  # opened with privacy on: token messages are refused
    sampling: "SamplingParams | None" = None  # set for token-mode sessions (OpenTokenSession)
    wire_dtype: Any = None  # how replies encode hidden states (the server's wire dtype; opaque here)
    queue: "deque[WorkItem]" = field(default_factory=deque)
    in_flight: list[WorkKind] = field(default_factory=list)  # kinds of its items being computed, oldest first
    # What budgets.py charges it (see there): the capacity its KV may reach, in positions; an upper bound of its
    # length when its next item runs (no frame starting past it can ever run); the bytes its queued items hold.
    kv_capacity: int = 0
    kv_end: int = 0
    queued_bytes: int = 0
    # A fork copies in a worker thread: while it runs, the child (`opening`) and the parent (`copies` > 0, one
    # per copy reading it) are not scheduled, so no pass changes a KV being copied or runs on one not there yet.
    opening: bool = False
    copies: int = 0
    opened_at: float = field(default_factory=time.monotonic)
    # When its prompt's first prefill item came (None: not prefilling): the order prompts take their turns in.
    prefill_since: float | None = None
    decoding_at: float | None = None  # when it last sent a verify (None: none since its prompt began)
    last_active: float = field(default_factory=time.monotonic)  # last request or reply (idle TTL)

    @property
    def is_token(self) -> bool:
        return self.sampling is not None

    @property
    def is_busy(self) -> bool:
        """Work queued or being computed: such a session is never idle, however long the work takes."""
        return bool(self.queue or self.in_flight)

    @property
    def is_held(self) -> bool:
        """A fork's copy is reading or filling its KV: none of its items may run yet."""
        return self.opening or self.copies > 0

    def dequeued(self, item: "WorkItem") -> None:
        """`item` left the queue (to run, or dropped): its bytes are no longer charged to the queue."""
        self.queued_bytes -= item.queued_bytes

    def touch(self, now: float | None = None) -> None:
        self.last_active = time.monotonic() if now is None else now

    def idle_for(self, now: float) -> float:
        return 0.0 if self.is_busy or self.is_held else now - self.last_active
