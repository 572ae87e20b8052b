"""Log-once bookkeeping of a peer that telemetry is dropped for while it is away (the Redis sink, the
monitor client): one warning when it goes, one line with the count dropped when it returns."""

from __future__ import annotations

import logging

log = logging.getLogger("shared.telemetry.sink")


class Outage:
    """Log-once bookkeeping shared by the sink and the HTTP client."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.down = False
        self.dropped = 0

    def failed(self, exc: BaseException, dropped: int = 1) -> None:
        """`dropped`: how many records went with the failure (0: none, the caller keeps them)."""
        self.dropped += int(dropped)
        if not self.down:
            self.down = True
            log.warning(
                "%s unavailable (%s: %s); dropping telemetry until it returns", self.what, type(exc).__name__, exc
            )

    def recovered(self) -> None:
        if self.down:
            self.down = False
            log.info("%s reachable again; telemetry resumed (%d records dropped)", self.what, self.dropped)
