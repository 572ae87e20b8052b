"""A round's draft and a pre-drafted branch (HAT §3.4-3.5), and the pure rule for when a branch is
adopted: only if the cloud corrected the last draft token and nothing before it, to a token some
branch was pre-drafted from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.model.kv_cache import SessionKV
    from shared.specdec.verify_layout import VerifyLayout


@dataclass
class Draft:
    commit_len: int  # positions the cloud keeps before appending this draft
    tokens: list[int]  # d_1..d_k
    probs: torch.Tensor | None  # q: [k, V], only when sampling
    shallow: torch.Tensor  # [k+1, H]: shallow states of (pending token, d_1..d_k)
    # What it takes to draft on from d_k (a pre-drafted branch cut short by the cloud's answer):
    can_continue: bool = False  # stopped by a budget or the caller, not by eta / EOS
    last_hidden: torch.Tensor | None = None  # [1, H]: the adapter's state at d_k's position
    # Trees (shared/specdec/tree_drafting.py): tokens[i - 1] is row i's token, and the layout says how
    # the rows hang together and what the cloud keeps of the last tree; None: a chain after commit_len.
    layout: VerifyLayout | None = None


@dataclass
class Branch:
    """A continuation pre-drafted from one candidate for the last draft position (HAT §3.5)."""

    candidate: int
    input_cache: SessionKV
    adapter_cache: SessionKV | None
    # (draft logits at the branch's last drafted position, the adapter state they came from)
    last: tuple[torch.Tensor | None, torch.Tensor | None]
    draft: Draft  # commit_len = positions before the candidate; shallow rows = (candidate, e_1..e_j)

    def free(self) -> None:
        self.input_cache.free()
        if self.adapter_cache is not None:
            self.adapter_cache.free()


def only_last_corrected(num_drafted: int, num_accepted: int) -> bool:
    """The cloud accepted d_1..d_{k-1} and replaced d_k: the one outcome pre-drafting prepares for."""
    return num_accepted == num_drafted - 1


def branch_for(branches: Sequence[Branch], correction: int) -> Branch | None:
    """The branch pre-drafted from the cloud's correction, if one was."""
    return next((branch for branch in branches if branch.candidate == correction), None)
