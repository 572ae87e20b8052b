"""What a device session is configured with, and what it refuses: the draft policy (HAT eq. 5) and
`SessionError`. Kept apart from the session so callers that only build a config or catch the error
need not import the model code."""

from __future__ import annotations

from dataclasses import dataclass


class SessionError(ValueError):
    """A request that cannot be served as given (empty prompt, too long, bad ids)."""


@dataclass(frozen=True)
class DraftConfig:
    eta: float = 0.6  # stop drafting when the draft token's probability < eta (HAT eq. 5)
    max_draft: int = 8  # hard cap on draft tokens per round; 0 turns speculation off (U-shape)

    def __post_init__(self):
        if not 0 <= self.eta <= 1:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")
        if self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {self.max_draft}")
