"""What a device measured of its draft shapes (shared/planning/draft_budget.py has the policy): per shape, EMAs
of its rounds (accept length, rows, drafting seconds) and of its slowdown k, the priors of the shapes never run,
and which shapes got their one trial round. The device agent keeps one; the planner chooses among its options.
Pure: no I/O, no torch (the chunk planner and the token streamer import the policy beside it)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.planning.draft_budget import (
    MAX_ACCEPT,
    MAX_ROWS,
    SLOWDOWN_RANGE,
    TRIAL_SHARE,
    BudgetError,
    BudgetOption,
    DraftShape,
    number_or_none,
)
from shared.planning.ema import Ema


@dataclass
class ShapeStats:
    accept: Ema = field(default_factory=Ema)
    rows: Ema = field(default_factory=Ema)
    draft_s: Ema = field(default_factory=Ema)
    slowdown: Ema = field(default_factory=Ema)


class BudgetTracker:
    """What each shape did on this device, per round (EMA over requests, HAT's a = 0.8): the options the
    planner chooses among. A shape never run yet offers its prior: the accept length and rows its adapter's
    held-out evaluation measured (`priors`, from `priors_from_adapter_report`) or else `DraftShape.prior`,
    with the measured chains' drafting time per step times its steps. A tree's steps are its levels, which
    cost about what a chain's steps do: the chain's steps plus one (its paths run about as deep as a chain,
    and its kept leaves take one more pass; measured, a tree-16 round drafts in 1.5-1.8x a chain round's time).
    Without a measured chain, a tree's steps are its rows, capped at the draft cap."""

    def __init__(self, shapes: Iterable[DraftShape], priors: Mapping[str, tuple[float, float]] | None = None):
        self.shapes = {s.name: s for s in shapes}
        if not self.shapes:
            raise BudgetError("a budget tracker needs at least one draft shape")
        self.priors = {name: prior for name, prior in (priors or {}).items() if name in self.shapes}
        self.stats = {name: ShapeStats() for name in self.shapes}
        self.tried: set[str] = set()
        self.async_slowdown = Ema()  # hat-async's k: its requests' speed against the chain's round model

    def observe(self, name: str, accept_lengths: list[int], rows_per_round: float, draft_s_per_round: float) -> None:
        """One request's rounds in shape `name` (a request with no rounds says nothing)."""
        if name not in self.stats or not accept_lengths:
            return
        stats = self.stats[name]
        stats.accept.update(sum(accept_lengths) / len(accept_lengths))
        stats.rows.update(max(1.0, rows_per_round))
        stats.draft_s.update(max(0.0, draft_s_per_round))

    def observe_speed(self, name: str, modelled_tokens_per_s: float, measured_tokens_per_s: float) -> None:
        """One request's decoding speed in shape `name` against what the planner's round model gave it: a sample
        of k_s (modelled over measured, clamped to SLOWDOWN_RANGE). Non-positive or non-finite figures say
        nothing."""
        sample = slowdown_sample(modelled_tokens_per_s, measured_tokens_per_s)
        if name in self.stats and sample is not None:
            self.stats[name].slowdown.update(sample)

    def observe_async_speed(self, chain_modelled_tokens_per_s: float, measured_tokens_per_s: float) -> None:
        """One hat-async request's speed against the chain's round model (its rounds are chains, drafted ahead)."""
        sample = slowdown_sample(chain_modelled_tokens_per_s, measured_tokens_per_s)
        if sample is not None:
            self.async_slowdown.update(sample)

    def measured_slowdown(self, name: str) -> float | None:
        """Shape `name`'s measured k (None: not measured, or not one of this device's shapes)."""
        return self.stats[name].slowdown.value if name in self.stats else None

    def async_pays(self) -> bool | None:
        """Whether hat-async's drafting ahead measured no slower than HAT's own chain rounds (its k no larger than
        the chain's); None until both are measured."""
        chain = self.measured_slowdown("chain")
        if self.async_slowdown.value is None or chain is None:
            return None
        return self.async_slowdown.value <= chain

    def _drafting_slowdown(self) -> float:
        """k of a drafting shape never measured: the mean of the measured drafting shapes' (their drafting shares
        the device and the verifier alike), 1 with none."""
        measured = [
            stats.slowdown.value
            for name, stats in self.stats.items()
            if self.shapes[name].max_draft > 0 and stats.slowdown.value is not None
        ]
        return sum(measured) / len(measured) if measured else 1.0

    def next_trial(self, predicted: Mapping[str, float] | None = None, running: str | None = None) -> str | None:
        """A drafting shape never handed out yet, other than the one the request `running` it runs, marked as
        handed out, or None (no drafts need no trial: its figures are exact). Each is handed out once (the
        device runs it for one round of a request: agent.draft_config), whatever that round then measures, and
        only when the planner's last answer (`predicted`: tokens/s per shape, from its prior where it never
        ran) puts it within TRIAL_SHARE of the best: on a verifier under load a tree's round runs several times
        slower than a round without drafts. Without a prediction nothing is tried; a shape the planner chooses
        runs, and is measured, all the same."""
        if not predicted:
            return None
        best = max(predicted.values())
        for name, shape in self.shapes.items():
            if name == running:
                continue
            if shape.max_draft > 0 and name not in self.tried and predicted.get(name, 0.0) >= TRIAL_SHARE * best:
                self.tried.add(name)
                return name
        return None

    def _chain_steps(self) -> tuple[float, float | None]:
        """(drafting seconds per step, steps per round) of the chains measured (a chain's steps are its rows but
        the root); (0, None) before any."""
        rates, steps = [], []
        for name, stats in self.stats.items():
            d, r = stats.draft_s.value, stats.rows.value
            if self.shapes[name].tree_nodes == 0 and d is not None and r is not None and r > 1:
                rates.append(d / (r - 1))
                steps.append(r - 1)
        if not rates:
            return 0.0, None
        return sum(rates) / len(rates), sum(steps) / len(steps)

    def options(self) -> list[BudgetOption]:
        (per_step, chain_steps), drafting_slowdown = self._chain_steps(), self._drafting_slowdown()
        out = []
        for name, shape in self.shapes.items():
            stats = self.stats[name]
            prior_accept, prior_rows = self.priors.get(name) or shape.prior()
            rows = stats.rows.value if stats.rows.value is not None else prior_rows
            steps = min(rows - 1, shape.max_draft)
            if shape.tree_nodes and chain_steps is not None:
                steps = min(chain_steps + 1.0, shape.max_draft)  # levels, however wide (see the class)
            draft_s = stats.draft_s.value if stats.draft_s.value is not None else per_step * steps
            accept = stats.accept.value if stats.accept.value is not None else prior_accept
            slowdown = stats.slowdown.value
            if slowdown is None:
                slowdown = drafting_slowdown if shape.max_draft > 0 else 1.0
            out.append(BudgetOption(name, max(1.0, accept), rows, draft_s, slowdown))
        return out


def priors_from_adapter_report(report: Any, shapes: Iterable[DraftShape]) -> dict[str, tuple[float, float]]:
    """(accept length, rows) a round for each of `shapes` that an adapter's held-out evaluation measured
    (`tophat evaluate-adapter`: adapter_report.json's `held_out` for the chain, `held_out.trees.<N>` for
    tree<N>). Figures that are missing, non-finite or out of range are skipped: that shape keeps its default."""
    held_out = report.get("held_out") if isinstance(report, Mapping) else None
    if not isinstance(held_out, Mapping):
        return {}
    trees = held_out.get("trees")
    out = {}
    for shape in shapes:
        if shape.max_draft == 0:
            continue
        measured = held_out if not shape.tree_nodes else (trees or {}).get(str(shape.tree_nodes))
        if not isinstance(measured, Mapping):
            continue
        accept, rows = number_or_none(measured.get("mean_accept_length")), number_or_none(measured.get("mean_rows"))
        if accept is None or rows is None or not (math.isfinite(accept) and math.isfinite(rows)):
            continue
        if 1.0 <= accept <= MAX_ACCEPT and 1.0 <= rows <= MAX_ROWS:
            out[shape.name] = (accept, rows)
    return out


def slowdown_sample(modelled_tokens_per_s: float, measured_tokens_per_s: float) -> float | None:
    """k from one request: modelled over measured tokens/s, clamped to SLOWDOWN_RANGE; None from non-positive or
    non-finite figures."""
    figures = (modelled_tokens_per_s, measured_tokens_per_s)
    if not all(math.isfinite(x) and x > 0 for x in figures):
        return None
    low, high = SLOWDOWN_RANGE
    return min(high, max(low, modelled_tokens_per_s / measured_tokens_per_s))


def predicted_rates(rates: Any, shapes: Mapping[str, Any]) -> dict[str, float]:
    """The planner's tokens/s for this device's shapes: finite and >= 0 only; anything else is no prediction."""
    if not isinstance(rates, Mapping):
        return {}
    out = {}
    for name, rate in rates.items():
        if name in shapes and isinstance(rate, (int, float)) and not isinstance(rate, bool):
            if math.isfinite(rate) and rate >= 0:
                out[name] = float(rate)
    return out
