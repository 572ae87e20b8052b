"""One round in a draft shape the draft budget has not measured yet, inside a request that runs another
(shared/planning/draft_budget.py's trials): the shape is tried for a round, so a trial costs one round, not a whole
request, and a shape that would run slow on a loaded verifier delays one round only."""

from __future__ import annotations

from dataclasses import dataclass

from shared.specdec.draft_config import DraftConfig


@dataclass
class TrialRound:
    name: str  # the shape tried (none, chain, tree<N>)
    config: DraftConfig  # its draft policy, for one round
    restore: DraftConfig | None = None  # the session's own policy while the trial round runs
    draft_s: float | None = None  # what its drafting took
    index: int | None = None  # its verification round's index in the session's accept_lengths, once verified

    @property
    def running(self) -> bool:
        return self.restore is not None

    @property
    def done(self) -> bool:
        return self.index is not None

    def measured(self, accept_lengths: list[int], round_rows: list[int]) -> tuple[int, int, float] | None:
        """(tokens, rows, drafting seconds) of the trial's round; None if it never got its verdict."""
        if self.index is None or self.draft_s is None or self.index >= min(len(accept_lengths), len(round_rows)):
            return None
        return accept_lengths[self.index], round_rows[self.index], self.draft_s
