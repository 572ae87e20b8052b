"""The draft budget in the simulator: each round's shape chosen by shared.planning.draft_budget.choose_budget.

The device asks the chunk planner before every request, and the planner answers with the shape that
makes the most tokens per second given the device's link, the verifier's load and the device's own
measured options (shared/planning/draft_budget.py). Here the same pure function is called before every round
(the real device asks per request; per round is what it converges to under a steady load), with:

* options `none` (a U-shape round: one row, one token, one input-layers step), `chain` (the
  calibration's accept lengths, the rows and drafting seconds this simulator charges a chain round on
  this device) and, where the calibration has measured trees, `tree<N>` (their mean tokens and rows a
  round, and the drafting trees.py charges): what a device's BudgetTracker converges to once every shape
  has run (the device offers none, chain and tree16);
* the link as the planner reads it: a one-row round trip (2 x one-way latency + a row each way, what the
  device's probes measure), the bytes per row, the device's bandwidths, and S = the sessions of the
  verifier's last step;
* g = the cloud's g(mu) in this deployment; overhead = the calibration's device time per round.
"""

from __future__ import annotations

from collections.abc import Callable

from loadgen.simulate.calibration import Calibration, DeviceProfile
from shared.planning.draft_budget import BudgetOption, LinkLoad, choose_budget


def chain_figures(cal: Calibration) -> tuple[float, float]:
    """(mean accept length, mean rows) of a chain round: rows = drafted tokens + 1, drafts run to the
    rejected token (k = min(L, K)) or, with a measured full-accept rate, stop one short when all pass."""
    K, full = cal.max_draft, cal.full_accept_rate or 0.0
    rows = 0.0
    for i, p in enumerate(cal.accept_dist):
        natural = i + 1
        k_run, k_full = min(natural, K), min(natural - 1, K)
        rows += p * ((1 - full) * (k_run + 1) + full * (k_full + 1))
    return cal.mean_accept_length, max(1.0, rows)


def tree_draft_s(cal: Calibration, gamma_s: float) -> float:
    """A tree round's drafting on a device whose draft step takes `gamma_s`: the measured tree/chain ratio
    times this simulator's mean chain round there (trees.py)."""
    if cal.tree_draft_ratio is None:
        raise ValueError("the calibration has no tree drafting ratio")
    return cal.tree_draft_ratio * gamma_s * chain_figures(cal)[1]


def budget_options(cal: Calibration, gamma_s: float) -> list[BudgetOption]:
    """`none`, `chain` and (measured trees only) `tree<N>` as this simulator charges them on a device whose
    draft step takes `gamma_s`.

    The chain is charged its whole drafting every round, with the calibration's accept length. A device measures
    both from its rounds: less drafting (a round that adopted a pre-drafted branch waits only on the drafts past
    it) and fewer tokens (final rounds cut to the tokens left). Charging only the first of those made the choice
    worse, not better: the chain over a tree that simulates 5 % faster at one idle device with graph passes.
    Measuring the simulated rounds as the device does (its BudgetTracker and trials) would fix both."""
    accept, rows = chain_figures(cal)
    options = [
        BudgetOption("none", 1.0, 1.0, gamma_s * cal.nosd_step_factor),
        BudgetOption("chain", max(1.0, accept), rows, gamma_s * rows),
    ]
    if cal.has_trees:
        tokens, tree_rows = cal.tree_means()
        options.append(BudgetOption(cal.tree_shape, max(1.0, tokens), tree_rows, tree_draft_s(cal, gamma_s)))
    return options


def link_load(cal: Calibration, profile: DeviceProfile, sessions: int) -> LinkLoad:
    """What the planner knows of this device's link and the verifier's load."""
    row = cal.bytes_per_token + cal.frame_overhead_bytes
    rtt = 2 * profile.latency_s + sum(row / b for b in (profile.beta_up, profile.beta_down) if b != float("inf"))
    big = 1e30  # an unlimited link, for the budget's finite-only figures
    up = profile.beta_up if profile.beta_up != float("inf") else big
    down = profile.beta_down if profile.beta_down != float("inf") else big
    return LinkLoad(rtt, float(cal.bytes_per_token), up, down, float(max(1, sessions)), cal.round_overhead_s)


def choose_shape(
    cal: Calibration,
    profile: DeviceProfile,
    gamma_s: float,
    sessions: int,
    g: Callable[[float], float],
    current: str | None = None,
) -> str:
    """The budget's shape for the next round ('none', 'chain' or the calibration's tree)."""
    name, _ = choose_budget(budget_options(cal, gamma_s), link_load(cal, profile, sessions), g, current)
    return name
