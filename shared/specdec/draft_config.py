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
    max_draft: int = 8  # hard cap on draft tokens per round (a tree's depth); 0 turns speculation off (U-shape)
    tree_nodes: int = 0  # draft nodes per round in a tree (EAGLE-2); 0: a chain, stopped by eta
    tree_width: int = 4  # children per expanded node, and nodes expanded per level
    tree_min_prob: float = 0.15  # grow a node (greedy) or a level (sampled) while its path probability reaches this

    @property
    def uses_tree(self) -> bool:
        return self.tree_nodes > 0 and self.max_draft > 0

    def __post_init__(self):
        if not 0 <= self.eta <= 1:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")
        if self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {self.max_draft}")
        if not 0 <= self.tree_min_prob <= 1:
            raise ValueError(f"tree_min_prob must be in [0, 1], got {self.tree_min_prob}")
        if self.tree_nodes < 0 or self.tree_width < 1:
            raise ValueError(f"tree_nodes must be >= 0 and tree_width >= 1, got {self.tree_nodes}, {self.tree_width}")
