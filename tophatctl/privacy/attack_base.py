"""The inversion attacks' common ground (tophatctl/privacy/attacks.py holds the attacks): the interface every
attack implements, the checks on its inputs, the attacker's budget and the report fit() returns."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Example = tuple[torch.Tensor, torch.Tensor]  # (states [S, H] fp32, ids [S] long)


class AttackError(ValueError):
    """Input an attack cannot use: wrong shape, empty training data, k out of range, or not fitted."""


@dataclass(frozen=True)
class TrainBudget:
    """How much an attacker spends. max_tokens caps the training tokens used (None: all given)."""

    steps: int = 2000
    batch_tokens: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    candidates: int = 8192  # softmax columns per step: the training text's token types + random fill
    max_tokens: int | None = None
    seed: int = 0
    ridge_init: bool = True  # learned attacks start from the ridge solution (its cost is in their wall_s)


def check_states(states: torch.Tensor, hidden_size: int) -> None:
    # states: [S, H]
    if not isinstance(states, torch.Tensor) or states.dim() != 2 or states.shape[1] != hidden_size:
        shape = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise AttackError(f"states must be one sequence [S, {hidden_size}], got {shape}")
    if states.shape[0] == 0 or not states.is_floating_point():
        raise AttackError("states must be a non-empty floating-point tensor")


def checked_train(train: Sequence[Example], hidden_size: int, max_tokens: int | None) -> list[Example]:
    """The examples to train on (cut at max_tokens), each checked: states [S, H] with ids [S]."""
    if not train:
        raise AttackError("no training examples")
    kept, total = [], 0
    for states, ids in train:
        check_states(states, hidden_size)
        if ids.dim() != 1 or ids.shape[0] != states.shape[0]:
            raise AttackError(f"ids {tuple(ids.shape)} do not match states {tuple(states.shape)}")
        if max_tokens is not None:
            states, ids = states[: max_tokens - total], ids[: max_tokens - total]
        if ids.numel():
            kept.append((states.float(), ids.long()))
            total += ids.numel()
    return kept


def cosine_topk(queries: torch.Tensor, unit_table: torch.Tensor, k: int) -> torch.Tensor:
    # queries: [S, D], unit_table: [V, D] (rows of norm 1) -> [S, k], best first
    if not 1 <= k <= unit_table.shape[0]:
        raise AttackError(f"k must be in 1..{unit_table.shape[0]}, got {k}")
    scores = F.normalize(queries.float(), dim=-1) @ unit_table.T  # [S, V]
    return scores.topk(k, dim=-1).indices


def fit_report(name: str, tokens: int, steps: int, tokens_seen: int, started: float, parameters: int, **extra) -> dict:
    return {
        "attack": name,
        "tokens": tokens,
        "steps": steps,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / tokens if tokens else 0.0,
        "wall_s": time.perf_counter() - started,
        "parameters": parameters,
        **extra,
    }


class Attack:
    name = "attack"

    def __init__(self, embedding_table: torch.Tensor):
        # embedding_table: [V, H] the public checkpoint's input embeddings
        if embedding_table.dim() != 2:
            raise AttackError("embedding_table must be [V, H]")
        self.embeddings = embedding_table.detach().float().clone()
        self.unit_embeddings = F.normalize(self.embeddings, dim=-1)  # [V, H]
        self.hidden_size = self.embeddings.shape[1]
        self.fitted = False

    def fit(self, train: Sequence[Example], budget: TrainBudget | None = None) -> dict:
        raise NotImplementedError

    def topk(self, states: torch.Tensor, k: int = 5) -> torch.Tensor:
        raise NotImplementedError

    def _ready(self, states: torch.Tensor) -> None:
        check_states(states, self.hidden_size)
        if not self.fitted:
            raise AttackError(f"{self.name}: fit() before topk()")
