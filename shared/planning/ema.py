"""The exponential moving average behind HAT's state model (§3.2, eqs. 1-2): v = a*v + (1-a)*x, a = 0.8."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEFAULT_ALPHA = 0.8


def check_alpha(alpha: float) -> float:
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")
    return float(alpha)


def check_sample(x: float, name: str) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return x


@dataclass
class Ema:
    """Exponential moving average v = a*v + (1-a)*x; the first sample sets v."""

    alpha: float = DEFAULT_ALPHA
    value: float | None = None
    count: int = 0

    def __post_init__(self) -> None:
        check_alpha(self.alpha)

    def update(self, sample: float) -> float:
        sample = check_sample(sample, "sample")
        if self.value is None:
            self.value = sample
        else:
            self.value = self.alpha * self.value + (1.0 - self.alpha) * sample
        self.count += 1
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "value": self.value, "count": self.count}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ema:
        value = data.get("value")
        return cls(
            alpha=float(data.get("alpha", DEFAULT_ALPHA)),
            value=None if value is None else float(value),
            count=int(data.get("count", 0)),
        )
