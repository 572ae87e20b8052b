"""The pure rule for adopting a pre-drafted branch (shared/specdec/draft.py, HAT §3.5)."""

from __future__ import annotations

import torch

from shared.specdec.draft import Branch, Draft, branch_for, only_last_corrected


class _Cache:
    def free(self) -> None:
        pass


def _branch(candidate: int) -> Branch:
    draft = Draft(commit_len=4, tokens=[candidate], probs=None, shallow=torch.zeros(2, 3))  # shallow: [2, H=3]
    return Branch(candidate, _Cache(), None, (None, None), draft)


def test_only_a_correction_of_the_last_draft_token_can_adopt_a_branch():
    assert only_last_corrected(num_drafted=3, num_accepted=2)
    assert not only_last_corrected(num_drafted=3, num_accepted=3)  # all accepted: the bonus, nothing corrected
    assert not only_last_corrected(num_drafted=3, num_accepted=1)  # an earlier token was wrong


def test_the_branch_adopted_is_the_one_drafted_from_the_correction():
    branches = [_branch(7), _branch(9)]
    assert branch_for(branches, 9) is branches[1]
    assert branch_for(branches, 8) is None
    assert branch_for([], 7) is None
