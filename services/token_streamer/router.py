"""Which device agent serves a request: the placement policy and what it knows of each device.

`Router` is the placement policy (least outstanding requests, round-robin on
ties, skip devices that recently failed). It is deliberately tiny and has one
decision method, `pick()`, so a DiSCo-style cost-aware dispatcher (and later
token-level migration) can replace it without touching the HTTP layer. The
network side lives in dispatcher.py (opening a generation, failover) and
device_stream.py (one open NDJSON stream); this module imports neither, so
admission.py can build on it without a cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

BUSY_HOLD_S = 0.25  # a device that answered 'busy' gets no new request this long, unless it frees a slot


class DeviceError(Exception):
    """A device refused or failed; `status`/`code` become the OpenAI-shaped error reply."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass
class DeviceState:
    """What the streamer knows about one device agent (all local, no coordination)."""

    url: str
    index: int
    outstanding: int = 0  # requests of this streamer currently on the device
    down_until: float = 0.0  # monotonic time before which pick() skips the device
    device_id: str | None = None  # from GET /info, when a probe has fetched it
    max_sessions: int | None = None  # from /info; None: unknown, the device's 'busy' tells
    speed_class: str | None = None  # from /info: prices its energy (DiSCo's cost model)
    eos_token_id: int | None = None  # from /info: an answer that ended is never migrated
    held_until: float = 0.0  # after a 'busy' answer: not offered new requests until then
    opening: int = 0  # requests sent whose first line has not come back yet
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    retired: bool = False  # discovery no longer lists it: never picked (kept only while its streams finish)


class Router:
    """Least-outstanding-requests placement with round-robin among ties."""

    def __init__(
        self, urls: Iterable[str], *, down_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.devices = [DeviceState(url, i) for i, url in enumerate(urls)]
        self.down_s = down_s
        self._clock = clock
        self._cursor = 0

    def healthy(self, device: DeviceState) -> bool:
        return not device.retired and self._clock() >= device.down_until

    def sync(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the announced devices the routable set: new URLs join, missing ones retire (a stream
        already on a retired device runs on; it gets no new request) and leave the router once no request
        holds them (this call or a later one), so churn does not grow it. Returns (added, retired) URLs."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        known = {d.url: d for d in self.devices}
        added = [u for u in wanted if u not in known]
        for url in added:
            self.devices.append(DeviceState(url, len(self.devices)))
        retired = []
        for device in self.devices:
            gone = device.url not in wanted
            if gone and not device.retired:
                retired.append(device.url)
            device.retired = gone
        self._drop_idle_retired()
        return added, retired

    def _drop_idle_retired(self) -> None:
        """Forget retired devices no request holds (one that is announced again rejoins as new)."""
        kept = [d for d in self.devices if not d.retired or d.outstanding or d.opening]
        if len(kept) == len(self.devices):
            return
        for index, device in enumerate(kept):
            device.index = index
        self.devices[:] = kept  # in place: others may hold the list
        self._cursor = self._cursor % len(kept) if kept else 0

    def has_free_slot(self, device: DeviceState) -> bool:
        """Healthy, not held off after a 'busy', and below its known session count. A device of
        unknown capacity takes one new request at a time: its answer (started or busy) decides
        the next, so requests reach it in queue order."""
        if not self.healthy(device) or self._clock() < device.held_until:
            return False
        if device.max_sessions is None:
            return device.opening == 0
        return device.outstanding < device.max_sessions

    def capacity(self) -> int:
        """Sessions the healthy devices can hold (a device of unknown capacity: what it holds now)."""
        return sum(
            d.max_sessions if d.max_sessions is not None else max(1, d.outstanding)
            for d in self.devices
            if self.healthy(d)
        )

    def pick(self, exclude: Iterable[str] = (), *, free_only: bool = False) -> DeviceState | None:
        """The healthy device (not in `exclude`, by URL) with the fewest outstanding requests.

        Scanning starts just after the previous pick, so equally loaded devices
        take turns. None when every device is excluded or marked down (or, with
        `free_only`, has no free slot).
        """
        skip = set(exclude)
        n = len(self.devices)
        best: DeviceState | None = None
        for k in range(n):
            device = self.devices[(self._cursor + k) % n]
            if device.url in skip or not (self.has_free_slot(device) if free_only else self.healthy(device)):
                continue
            if best is None or device.outstanding < best.outstanding:
                best = device
        if best is not None:
            self._cursor = (best.index + 1) % n
        return best

    def acquire(self, device: DeviceState) -> None:
        """Take a slot for a request about to be sent; `opened()` once the device has answered."""
        device.outstanding += 1
        device.opening += 1

    def opened(self, device: DeviceState) -> None:
        device.opening = max(0, device.opening - 1)

    def release(self, device: DeviceState, *, busy: bool = False) -> None:
        """Give a slot back; `busy`: the device refused it, so hold it off for a moment."""
        device.outstanding = max(0, device.outstanding - 1)
        device.held_until = self._clock() + BUSY_HOLD_S if busy else 0.0

    def mark_down(self, device: DeviceState, reason: str) -> None:
        if self.healthy(device):
            log.warning("device %s marked down for %.1f s: %s", device.url, self.down_s, reason)
        device.down_until = self._clock() + self.down_s
        device.failures += 1
        device.last_error = reason

    def mark_up(self, device: DeviceState) -> None:
        if not self.healthy(device):
            log.info("device %s is back", device.url)
        device.down_until = 0.0

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "url": d.url,
                "device_id": d.device_id,
                "healthy": self.healthy(d),
                "outstanding": d.outstanding,
                "max_sessions": d.max_sessions,
                "served": d.served,
                "failures": d.failures,
                "last_error": d.last_error,
            }
            for d in self.devices
            if not d.retired or d.outstanding
        ]
