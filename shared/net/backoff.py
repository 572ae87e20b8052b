"""Exponential backoff: the one schedule every retry loop in the mesh sleeps by.

The telemetry sink's reconnect, a session's failover replay, the verifier's pipeline restarts and
the launcher's process supervisor all wait `initial_s`, then twice that, and so on up to `max_s`.
A loop keeps the last delay it used and asks for the next one (`after`), or walks `delays()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float
    max_s: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor}")

    def after(self, previous_s: float | None) -> float:
        """The delay that follows `previous_s` (None: the first try's)."""
        if previous_s is None:
            return self.initial_s
        return min(max(previous_s, self.initial_s) * self.factor, self.max_s)

    def delays(self) -> Iterator[float]:
        """initial_s, initial_s * factor, ... capped at max_s, without end."""
        delay = None
        while True:
            delay = self.after(delay)
            yield delay
