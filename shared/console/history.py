"""What the web console plots over the last minutes: finished requests and the verifier's load beside each
device's draft shape. Pure bookkeeping, no I/O: the token streamer adds a point when a request it served
ends and when it gathers the mesh's state (services/token_streamer/console.py); both rings forget points
older than `window_s` and keep at most `max_points`, so memory is bounded whatever the traffic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestPoint:
    """One finished request as the user saw it (times from its arrival at the streamer)."""

    t: float  # unix s, when it ended
    device_id: str | None
    ttft_s: float | None
    tbt_s: float | None
    accept_length: float | None  # mean tokens per verification round (1.0: no draft accepted)
    mode: str | None


@dataclass(frozen=True)
class LoadPoint:
    """The verifier's load when the console gathered the mesh's state, and the draft shape each device runs."""

    t: float
    rows_per_step: float | None  # mu: tokens in a verifier step (HAT eq. 1)
    sessions: int | None  # live sessions in the verifier's last step
    step_ms: float | None  # eta: a step's compute time
    shapes: Mapping[str, str] = field(default_factory=dict)  # device id -> draft shape


def _finite(value: Any) -> float | None:
    """`value` as a float when it is a finite number (not a bool), else None: JSON has no NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class Ring:
    """Points in time order, none older than `window_s` before the newest, at most `max_points`."""

    def __init__(self, window_s: float, max_points: int) -> None:
        if not window_s > 0 or max_points < 1:
            raise ValueError("need window_s > 0 and max_points >= 1")
        self.window_s = window_s
        self.points: deque[Any] = deque(maxlen=max_points)

    def add(self, point: Any) -> None:
        self.points.append(point)
        self.trim(point.t)

    def trim(self, now: float) -> None:
        while self.points and self.points[0].t < now - self.window_s:
            self.points.popleft()

    def since(self, t: float) -> list[Any]:
        return [p for p in self.points if p.t > t]


class ConsoleHistory:
    """The console's two series: requests (TTFT, TBT, accept length per device) and load (mu, shapes)."""

    def __init__(self, window_s: float = 600.0, max_points: int = 5000) -> None:
        self.requests = Ring(window_s, max_points)
        self.load = Ring(window_s, max_points)

    def request_done(
        self,
        t: float,
        device_id: str | None,
        ttft_s: float | None,
        tbt_s: float | None,
        accept_length: float | None,
        mode: str | None,
    ) -> None:
        self.requests.add(RequestPoint(t, device_id, _finite(ttft_s), _finite(tbt_s), _finite(accept_length), mode))

    def load_seen(
        self, t: float, rows_per_step: Any, sessions: Any, step_ms: Any, shapes: Mapping[str, str | None]
    ) -> None:
        """One load point; skipped when nothing in it is known (no verifier step and no shape yet)."""
        mu, eta = _finite(rows_per_step), _finite(step_ms)
        count = _finite(sessions)
        known = {device: shape for device, shape in shapes.items() if shape}
        if mu is None and count is None and not known:
            return
        self.load.add(LoadPoint(t, mu, None if count is None else int(count), eta, known))

    def mean_accept(self, now: float) -> dict[str, float]:
        """Per device, the mean accept length of its requests within the window (those that have one)."""
        self.requests.trim(now)
        sums: dict[str, list[float]] = {}
        for point in self.requests.points:
            if point.device_id is not None and point.accept_length is not None:
                sums.setdefault(point.device_id, []).append(point.accept_length)
        return {device: sum(values) / len(values) for device, values in sums.items()}

    def to_dict(self, now: float, since: float = 0.0) -> dict[str, Any]:
        """The points newer than `since` (unix s), for GET /console/history."""
        self.requests.trim(now)
        self.load.trim(now)
        return {
            "now": now,
            "window_s": self.requests.window_s,
            "requests": [asdict(p) for p in self.requests.since(since)],
            "load": [{**asdict(p), "shapes": dict(p.shapes)} for p in self.load.since(since)],
        }
