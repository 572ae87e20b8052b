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
    opened_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)  # last request or reply (idle TTL)

    @property
    def is_token(self) -> bool:
        return self.sampling is not None

    @property
    def is_busy(self) -> bool:
        """Work queued or being computed: such a session is never idle, however long the work takes."""
        return bool(self.queue or self.in_flight)

    def touch(self, now: float | None = None) -> None:
        self.last_active = time.monotonic() if now is None else now

    def idle_for(self, now: float) -> float:
        return 0.0 if self.is_busy else now - self.last_active
