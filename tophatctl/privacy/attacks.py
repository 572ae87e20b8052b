"""Inversion attacks: what a curious cloud recovers from the hidden states it sees.

Every attack maps one sequence of layer-m hidden states [S, H] to its k best
guesses per position [S, k]. Weakest to strongest:

1. NearestEmbedding  - cosine-nearest row of the public input embedding table; no training.
2. LinearInverter    - ridge regression state -> token embedding (closed form), then cosine-nearest.
3. MLPInverter       - a per-position MLP state -> embedding space, trained by cross-entropy over the vocab.
4. ContextInverter   - a small bidirectional transformer over the whole prompt's states (the cloud sees
                       them all at once), same head and training as the MLP.

The learned attacks score tokens against the public embedding table (cosine, learned temperature), so
a token the attacker never trained on is still reachable through the embedding geometry, and the
softmax is over the training text's tokens plus random others (full-vocab softmax at V = 49152 costs
~30 GFLOP a step, too much for a 2-core attacker budget; evaluation always ranks the full vocabulary).

fit(train, budget) returns the budget actually spent, so every accuracy comes with what it cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tophatctl.privacy.attack_base import (
    Attack,
    AttackError,
    Example,
    TrainBudget,
    checked_train,
    cosine_topk,
    fit_report,
)


class NearestEmbedding(Attack):
    """The state read as if it were still an embedding: exact at m = 0, the floor for m >= 1."""

    name = "nearest-embedding"

    def __init__(self, embedding_table: torch.Tensor):
        super().__init__(embedding_table)
        self.fitted = True

    def fit(self, train: Sequence[Example] = (), budget: TrainBudget | None = None) -> dict:
        return fit_report(self.name, 0, 0, 0, time.perf_counter(), 0)

    @torch.no_grad()
    def topk(self, states: torch.Tensor, k: int = 5) -> torch.Tensor:
        self._ready(states)
        return cosine_topk(states, self.unit_embeddings, k)


class Standardiser:
    """Per-dimension mean/std of the training states: shallow layers carry a few huge-activation
    dimensions that would otherwise dominate both the normal equations and SGD."""

    def __init__(self, states: torch.Tensor):
        # states: [N, H]
        self.mean = states.mean(0)
        self.std = states.std(0).clamp_min(1e-6)

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return (states.float() - self.mean) / self.std


class LinearInverter(Attack):
    """Ridge regression state -> embedding in fp64 normal equations; lambda picked on the last
    holdout_fraction of the training sequences (top-1), then refitted on all of them."""

    name = "linear"
    LAMBDAS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # times the token count: scale-free on standardised states

    def __init__(self, embedding_table: torch.Tensor, holdout_fraction: float = 0.1):
        super().__init__(embedding_table)
        self.holdout_fraction = holdout_fraction
        self.weight: torch.Tensor | None = None  # [H, H_e]
        self.bias: torch.Tensor | None = None  # [H_e]
        self.standardise: Standardiser | None = None
        self.lam: float | None = None

    @staticmethod
    def _solve(gram: torch.Tensor, cross: torch.Tensor, lam: float) -> torch.Tensor:
        eye = torch.eye(gram.shape[0], dtype=gram.dtype)
        return torch.linalg.solve(gram + lam * eye, cross)  # [H, H_e]

    def _moments(self, examples: list[Example], standardise: Standardiser):
        x = standardise(torch.cat([s for s, _ in examples])).double()  # [N, H]
        y = self.embeddings[torch.cat([i for _, i in examples])].double()  # [N, H_e]
        y_mean = y.mean(0)
        return x.T @ x, x.T @ (y - y_mean), y_mean, x.shape[0]

    @torch.no_grad()
    def fit(self, train: Sequence[Example], budget: TrainBudget | None = None) -> dict:
        started = time.perf_counter()
        examples = checked_train(train, self.hidden_size, budget.max_tokens if budget else None)
        tokens = sum(i.numel() for _, i in examples)
        self.standardise = standardise = Standardiser(torch.cat([s for s, _ in examples]))
        cut = len(examples) - max(1, round(len(examples) * self.holdout_fraction))
        scores: dict[float, float] = {}
        if cut >= 1:  # enough sequences to hold some out: choose lambda on them
            gram, cross, y_mean, n = self._moments(examples[:cut], standardise)
            for lam in self.LAMBDAS:
                self.weight, self.bias, self.fitted = self._solve(gram, cross, lam * n).float(), y_mean.float(), True
                scores[lam] = recovery(self, examples[cut:], k=1)["top1"]
            self.lam = lam = max(scores, key=lambda lam: (scores[lam], lam))  # ties: the stronger regulariser
        else:
            self.lam = lam = 1e-3
        gram, cross, y_mean, n = self._moments(examples, standardise)
        weight, bias = self._solve(gram, cross, lam * n).float(), y_mean.float()
        self.weight, self.bias, self.fitted = weight, bias, True
        return fit_report(
            self.name,
            tokens,
            0,
            tokens,
            started,
            weight.numel() + bias.numel(),
            ridge_lambda=self.lam,
            holdout_top1=scores,
        )

    @torch.no_grad()
    def topk(self, states: torch.Tensor, k: int = 5) -> torch.Tensor:
        self._ready(states)
        assert self.standardise is not None and self.weight is not None and self.bias is not None  # set by fit()
        predicted = self.standardise(states) @ self.weight + self.bias  # [S, H_e]
        return cosine_topk(predicted, self.unit_embeddings, k)


class _TiedHead(torch.nn.Module):
    """Cosine against the frozen public embedding table with a learned temperature."""

    table: torch.Tensor  # [V, H_e], a buffer

    def __init__(self, unit_embeddings: torch.Tensor):
        super().__init__()
        self.register_buffer("table", unit_embeddings, persistent=False)  # [V, H_e]
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(20.0)))

    def forward(self, predicted: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        # predicted: [..., H_e] -> logits [..., C] over `columns` (all V when None)
        table = self.table if columns is None else self.table[columns]
        return self.log_scale.exp() * F.normalize(predicted, dim=-1) @ table.T


class _ReadOutNet(torch.nn.Module):
    """A learned attack's network: a linear per-position read-out, skip, that the ridge solution can start, and
    what the subclass adds to it."""

    skip: torch.nn.Linear


class _LearnedInverter(Attack):
    """Shared training loop: AdamW on cross-entropy over candidate columns, a fixed step budget."""

    def __init__(self, embedding_table: torch.Tensor):
        super().__init__(embedding_table)
        self.net: _ReadOutNet | None = None
        self.head = _TiedHead(self.unit_embeddings)
        self.standardise: Standardiser | None = None

    def _build(self) -> _ReadOutNet:
        raise NotImplementedError

    def _batch(
        self,
        examples: list[Example],
        flat_states: torch.Tensor,
        flat_ids: torch.Tensor,
        budget: TrainBudget,
        gen: torch.Generator,
    ):
        """(predicted [N, H_e], target ids [N]) for one step's batch."""
        raise NotImplementedError

    def _candidates(self, train_types: torch.Tensor, budget: TrainBudget, gen: torch.Generator):
        """Softmax columns: every token type of the training text, then random fill up to budget.candidates."""
        fill = max(0, budget.candidates - train_types.numel())
        return torch.cat([train_types, torch.randint(0, self.embeddings.shape[0], (fill,), generator=gen)])

    def fit(self, train: Sequence[Example], budget: TrainBudget | None = None) -> dict:
        budget = budget or TrainBudget()
        if budget.steps < 0 or budget.batch_tokens < 1:
            raise AttackError("budget.steps must be >= 0 and budget.batch_tokens >= 1")
        started = time.perf_counter()
        torch.manual_seed(budget.seed)
        gen = torch.Generator().manual_seed(budget.seed)
        examples = checked_train(train, self.hidden_size, budget.max_tokens)
        flat_states, flat_ids = torch.cat([s for s, _ in examples]), torch.cat([i for _, i in examples])
        self.standardise = standardise = Standardiser(flat_states)
        raw_examples, examples = examples, [(standardise(s), i) for s, i in examples]
        flat_states = standardise(flat_states)  # [N, H]
        train_types = flat_ids.unique()
        column_of = torch.full((self.embeddings.shape[0],), -1, dtype=torch.long)  # vocab id -> candidate column
        column_of[train_types] = torch.arange(train_types.numel())
        self.net = net = self._build()
        ridge = None
        if budget.ridge_init:  # start where the linear attack ends: the learned ones can only add to it
            ridge = LinearInverter(self.embeddings)
            ridge.fit(raw_examples)  # standardises with the same statistics as self.standardise (same data)
            assert ridge.weight is not None and ridge.bias is not None  # set by fit()
            with torch.no_grad():
                net.skip.weight.copy_(ridge.weight.T)
                net.skip.bias.copy_(ridge.bias)
        params = [p for p in net.parameters()] + [self.head.log_scale]
        optimiser = torch.optim.AdamW(params, lr=budget.lr, weight_decay=budget.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine decay: stable at any step budget
            optimiser,
            lambda step: min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / max(1, budget.steps))),
        )
        net.train()
        tokens_seen, last_loss = 0, float("nan")
        for _ in range(budget.steps):
            predicted, targets = self._batch(examples, flat_states, flat_ids, budget, gen)
            columns = self._candidates(train_types, budget, gen)
            loss = F.cross_entropy(self.head(predicted, columns), column_of[targets])
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            schedule.step()
            tokens_seen += targets.numel()
            last_loss = float(loss.detach())
        net.eval()
        self.fitted = True
        return fit_report(
            self.name,
            flat_ids.numel(),
            budget.steps,
            tokens_seen,
            started,
            sum(p.numel() for p in params),
            final_loss=last_loss,
            candidates=budget.candidates,
            ridge_init_lambda=ridge.lam if ridge else None,
        )

    @torch.no_grad()
    def topk(self, states: torch.Tensor, k: int = 5) -> torch.Tensor:
        self._ready(states)
        assert self.standardise is not None  # set by fit()
        predicted = self._predict(self.standardise(states))  # [S, H_e]
        if not 1 <= k <= self.embeddings.shape[0]:
            raise AttackError(f"k must be in 1..{self.embeddings.shape[0]}, got {k}")
        return self.head(predicted).topk(k, dim=-1).indices

    def _predict(self, standardised: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _ResidualMLP(_ReadOutNet):
    def __init__(self, hidden_size: int, width: int, out_size: int):
        super().__init__()
        self.skip = torch.nn.Linear(hidden_size, out_size)  # the ridge map's role; the MLP adds what it misses
        read_in, read_out = torch.nn.Linear(hidden_size, width), torch.nn.Linear(width, out_size)
        # at step 0 the model is its skip (the ridge map when initialised so)
        torch.nn.init.zeros_(read_out.weight)
        torch.nn.init.zeros_(read_out.bias)
        self.mlp = torch.nn.Sequential(read_in, torch.nn.GELU(), read_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H_e]
        return self.skip(x) + self.mlp(x)


class MLPInverter(_LearnedInverter):
    """Per position, no context: state -> embedding space by a one-hidden-layer MLP (plus a linear skip)."""

    name = "mlp"

    def __init__(self, embedding_table: torch.Tensor, width: int = 1024):
        super().__init__(embedding_table)
        self.width = width

    def _build(self) -> _ReadOutNet:
        return _ResidualMLP(self.hidden_size, self.width, self.embeddings.shape[1])

    def _batch(self, examples, flat_states, flat_ids, budget, gen):
        rows = torch.randint(0, flat_ids.numel(), (budget.batch_tokens,), generator=gen)
        return self.net(flat_states[rows]), flat_ids[rows]

    def _predict(self, standardised: torch.Tensor) -> torch.Tensor:
        assert self.net is not None  # built by fit()
        return self.net(standardised)


class _ContextNet(_ReadOutNet):
    def __init__(self, hidden_size: int, out_size: int, d_model: int, layers: int, heads: int, max_positions: int):
        super().__init__()
        self.project_in = torch.nn.Linear(hidden_size, d_model)
        self.positions = torch.nn.Embedding(max_positions, d_model)
        block = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.project_out = torch.nn.Linear(d_model, out_size)
        self.skip = torch.nn.Linear(hidden_size, out_size)  # the per-position read-out; context adds to it
        torch.nn.init.zeros_(self.project_out.weight)  # starts as its skip
        torch.nn.init.zeros_(self.project_out.bias)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B, S, H], padding: [B, S] True where padded -> [B, S, H_e]
        h = self.project_in(x) + self.positions(torch.arange(x.shape[1]))
        return self.project_out(self.encoder(h, src_key_padding_mask=padding)) + self.skip(x)


class ContextInverter(_LearnedInverter):
    """All of a prompt's states at once, bidirectional: what a whole-prompt attacker can exploit."""

    name = "context"

    def __init__(
        self,
        embedding_table: torch.Tensor,
        d_model: int = 256,
        layers: int = 2,
        heads: int = 4,
        max_positions: int = 2048,
    ):
        super().__init__(embedding_table)
        self.shape = (d_model, layers, heads, max_positions)

    def _build(self) -> _ReadOutNet:
        return _ContextNet(self.hidden_size, self.embeddings.shape[1], *self.shape)

    def _batch(self, examples, flat_states, flat_ids, budget, gen):
        chosen, tokens = [], 0
        while tokens < budget.batch_tokens:  # whole sequences until the batch holds batch_tokens
            states, ids = examples[int(torch.randint(0, len(examples), (1,), generator=gen))]
            chosen.append((states[: self.shape[3]], ids[: self.shape[3]]))
            tokens += chosen[-1][1].numel()
        length = max(i.numel() for _, i in chosen)
        x = torch.zeros(len(chosen), length, self.hidden_size)  # [B, S, H]
        padding = torch.ones(len(chosen), length, dtype=torch.bool)
        for row, (states, ids) in enumerate(chosen):
            x[row, : ids.numel()], padding[row, : ids.numel()] = states, False
        predicted = self.net(x, padding)[~padding]  # [N, H_e]
        return predicted, torch.cat([i for _, i in chosen])

    def _predict(self, standardised: torch.Tensor) -> torch.Tensor:
        if standardised.shape[0] > self.shape[3]:
            raise AttackError(f"{self.name}: sequences longer than {self.shape[3]} positions are not supported")
        assert self.net is not None  # built by fit()
        return self.net(standardised[None])[0]


def recovery(attack: Attack, examples: Sequence[Example], k: int = 5) -> dict:
    """Exact-token (top-1) and top-k recovery over examples, one sequence at a time."""
    hits1 = hitsk = tokens = 0
    for states, ids in examples:
        guesses = attack.topk(states, k=k)  # [S, k]
        hits1 += int((guesses[:, 0] == ids).sum())
        hitsk += int((guesses == ids[:, None]).any(dim=1).sum())
        tokens += ids.numel()
    if not tokens:
        raise AttackError("no evaluation tokens")
    return {"top1": hits1 / tokens, f"top{k}": hitsk / tokens, "tokens": tokens}
