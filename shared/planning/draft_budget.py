"""The draft budget of a round: how many draft rows a device sends per verification, from the measured
link and the cloud's load. Pure functions; the chunk planner serves the choice (`POST /draft-budget`)
and the device agent keeps the per-shape measurements (`BudgetTracker`).

A device can draft in several shapes: none (a U-shape round: one row, one token), a chain stopped by
eta (HAT eq. 5), or a tree of N nodes (EAGLE-2). Each shape s has, as measured on this device,

    L_s      tokens a round yields (accept length, >= 1)
    r_s      rows a round sends (the root plus its drafts)
    d_s      device seconds of drafting per round

A round of shape s takes

    T_s = RTT + o + d_s + (r_s - 1)*A/beta_up + (r_s - 1)*A/beta_down + g(S * r_s)

where RTT is a one-row round trip (what the device's probes measure: latency both ways and a row each
way, so only the rows beyond it are added), o is the device's per-round time outside drafting and the
cloud wait (the head, the accept rule: the same for every shape, so it favours shapes with fewer rounds
per token), g the cloud's compute delay
at a batched size (HAT eq. 2) and S the sessions sharing a verifier step. Why S * r_s and not the rows
of this device alone: every row a device adds is computed in the same step as every other session's
rows, so the whole batch waits for it. Assuming the other sessions draft like this one (they run the
same policy), maximising this session's L_s / T_s is maximising the verifier's goodput. With one
session, g(r_s) is nearly flat on a memory-bound cloud (one weight read serves every row) and wide trees
pay; as S grows, g(S * r_s) climbs into its compute-bound part, each extra row costs S rows of compute,
and the budget falls to a chain, then to no drafts at all: speculation stops burning a busy verifier on
rows it will reject.

The choice is by L_s / (k_s * T_s), where k_s is the shape's measured slowdown on this device: its requests'
measured decoding speed (a typical round's) against the speed T_s gave them (1 until measured; a drafting
shape never run takes the measured drafting shapes' mean). T_s has no term for what drafting costs a
verifier that shares the device's cores, for queueing, or for anything else the model leaves out; k_s
closes the loop on what each shape did (TurboSpec's goodput feedback), so a shape that runs slower than
modelled is charged for it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.planning.ema import Ema
from shared.planning.monitor_plans import PlannerInputs, positive_field, usable_state

MAX_OPTIONS = 32
# shared.wire.schema.MAX_TREE_ROWS (no frame carries more), written out: importing shared.wire.schema loads torch, which
# the chunk planner and the token streamer (both import this module) otherwise never need, and which costs each of them
# ~2 s of CPU at start-up; tests/shared/planning/test_draft_budget.py checks that the two agree
MAX_ROWS = 1024
MAX_ACCEPT = MAX_ROWS + 1.0
MAX_DRAFT_S = 600.0
SLOWDOWN_RANGE = (0.25, 8.0)  # k_s is clamped here: one odd request cannot make a shape free or unusable
SWITCH_MARGIN = 0.05  # a device leaves its current shape only for one predicted this much faster
TRIAL_SHARE = 0.8  # a shape never run gets its trial request only if predicted this share of the best's tokens/s
SHAPE_PATTERN = r"^(none|chain|tree[1-9][0-9]{0,3})$"  # what a request may name (DraftShape.parse checks the rest)
DEVICE_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # as the planner's GET endpoints take it


class BudgetError(ValueError):
    """Options or link figures the policy cannot use (empty, non-finite, out of range)."""


@dataclass(frozen=True)
class DraftShape:
    """One way to draft a round. `max_draft` 0 is no drafting; `tree_nodes` 0 a chain."""

    name: str
    max_draft: int
    tree_nodes: int = 0

    @classmethod
    def parse(cls, name: str, chain_max_draft: int) -> DraftShape:
        """'none', 'chain' or 'tree<N>' (e.g. tree16)."""
        if name == "none":
            return cls(name, 0)
        if name == "chain":
            return cls(name, chain_max_draft)
        if name.startswith("tree") and name[4:].isdigit() and 0 < int(name[4:]) < MAX_ROWS:
            return cls(name, chain_max_draft, int(name[4:]))
        raise BudgetError(f"unknown draft shape {name!r}: use none, chain or tree<N>")

    def prior(self) -> tuple[float, float]:
        """(accept length, rows) before anything is measured: what no drafting gives, and a
        cautious guess for drafting (tokens a round yields grow slowly with the rows sent)."""
        if self.max_draft == 0:
            return 1.0, 1.0
        rows = float(self.tree_nodes + 1 if self.tree_nodes else min(self.max_draft, 3) + 1)
        return 1.0 + 0.25 * math.log2(rows), rows


@dataclass(frozen=True)
class BudgetOption:
    name: str
    accept: float  # L: tokens per round
    rows: float  # r: rows per verification
    draft_s: float  # d: device drafting seconds per round
    slowdown: float = 1.0  # k: measured round time over the modelled one (1: as modelled, or not measured)

    def __post_init__(self):
        bounds = (
            ("accept", self.accept, 1.0, MAX_ACCEPT),
            ("rows", self.rows, 1.0, MAX_ROWS),
            ("draft_s", self.draft_s, 0, MAX_DRAFT_S),
            ("slowdown", self.slowdown, *SLOWDOWN_RANGE),
        )
        for label, value, low, high in bounds:
            if not (math.isfinite(value) and low <= value <= high):
                raise BudgetError(f"option {self.name!r}: {label} must be in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class LinkLoad:
    rtt_s: float  # a one-row round trip (latency, framing and a row each way)
    bytes_per_row: float  # A: one hidden state on the wire
    beta_up: float  # bytes/s
    beta_down: float
    sessions: float  # S: sessions in a verifier step (>= 1)
    overhead_s: float = 0.0  # the device's per-round time outside drafting and the cloud wait (head, accept)

    def __post_init__(self):
        values = (self.rtt_s, self.bytes_per_row, self.beta_up, self.beta_down, self.sessions, self.overhead_s)
        if not all(math.isfinite(v) for v in values):
            raise BudgetError(f"link and load figures must be finite: {self}")
        if min(self.rtt_s, self.overhead_s) < 0 or min(self.bytes_per_row, self.beta_up, self.beta_down) <= 0:
            raise BudgetError(f"need rtt_s, overhead_s >= 0 and positive bytes and bandwidths: {self}")
        if self.sessions < 1:
            raise BudgetError(f"sessions must be >= 1, got {self.sessions!r}")


def round_seconds(option: BudgetOption, link: LinkLoad, g: Callable[[float], float]) -> float:
    """T_s above, as modelled (without k_s): one round of this shape while S sessions share each verifier step."""
    transfer = (option.rows - 1.0) * link.bytes_per_row * (1.0 / link.beta_up + 1.0 / link.beta_down)
    return link.rtt_s + link.overhead_s + option.draft_s + transfer + max(0.0, g(link.sessions * option.rows))


def choose_budget(
    options: Iterable[BudgetOption],
    link: LinkLoad,
    g: Callable[[float], float],
    current: str | None = None,
    margin: float = SWITCH_MARGIN,
) -> tuple[str, dict[str, float]]:
    """The option with the most tokens per second (its round as modelled, times its measured slowdown), and
    every option's tokens/s. Ties go to the fewer rows (the verifier's time is everyone's). The `current` shape
    is kept unless another is more than `margin` faster: near-ties would otherwise flip with every noisy
    measurement."""
    options = list(options)
    if not options:
        raise BudgetError("no draft shapes to choose from")
    rates = {o.name: modelled_rate(o, link, g) / o.slowdown for o in options}
    best = max(options, key=lambda o: (round(rates[o.name], 9), -o.rows))
    if current in rates and rates[best.name] <= rates[current] * (1.0 + margin):
        return current, rates
    return best.name, rates


def modelled_rate(option: BudgetOption, link: LinkLoad, g: Callable[[float], float]) -> float:
    """Tokens per second of this shape as the round model has it (k_s = 1)."""
    return option.accept / max(round_seconds(option, link, g), 1e-9)


@dataclass
class ShapeStats:
    accept: Ema = field(default_factory=Ema)
    rows: Ema = field(default_factory=Ema)
    draft_s: Ema = field(default_factory=Ema)
    slowdown: Ema = field(default_factory=Ema)


class BudgetTracker:
    """What each shape did on this device, per round (EMA over requests, HAT's a = 0.8): the options the
    planner chooses among. A shape never run yet offers its prior, with the drafting time per step of
    the measured chains times its steps (a tree's levels cost about what a chain's steps do)."""

    def __init__(self, shapes: Iterable[DraftShape]):
        self.shapes = {s.name: s for s in shapes}
        if not self.shapes:
            raise BudgetError("a budget tracker needs at least one draft shape")
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

    def _draft_s_per_step(self) -> float:
        """Drafting seconds per step, from the chains measured (a chain's steps are its rows but the root)."""
        rates = []
        for name, stats in self.stats.items():
            d, r = stats.draft_s.value, stats.rows.value
            if self.shapes[name].tree_nodes == 0 and d is not None and r is not None and r > 1:
                rates.append(d / (r - 1))
        return sum(rates) / len(rates) if rates else 0.0

    def options(self) -> list[BudgetOption]:
        per_step, drafting_slowdown = self._draft_s_per_step(), self._drafting_slowdown()
        out = []
        for name, shape in self.shapes.items():
            stats = self.stats[name]
            prior_accept, prior_rows = shape.prior()
            rows = stats.rows.value if stats.rows.value is not None else prior_rows
            # a tree drafts level by level (one adapter pass per level, however wide): its levels, not its rows
            steps = min(rows - 1, shape.max_draft)
            draft_s = stats.draft_s.value if stats.draft_s.value is not None else per_step * steps
            accept = stats.accept.value if stats.accept.value is not None else prior_accept
            slowdown = stats.slowdown.value
            if slowdown is None:
                slowdown = drafting_slowdown if shape.max_draft > 0 else 1.0
            out.append(BudgetOption(name, max(1.0, accept), rows, draft_s, slowdown))
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


def budget_from_state(
    cloud: Mapping[str, Any] | None,
    device: Mapping[str, Any] | None,
    inputs: PlannerInputs,
    options: list[BudgetOption],
    default: str,
    current: str | None = None,
) -> tuple[str, str, dict[str, Any]]:
    """The planner's answer from the state monitor's JSON: (shape, "budget" or "default:<reason>", detail).
    `default` is the device's configured shape, kept where the telemetry cannot decide; `current` the shape
    it runs now (kept through near-ties)."""
    state = usable_state(cloud, device, inputs)
    if isinstance(state, str):
        return default, f"default:{state}", {}
    bytes_per_token, g, _, dev = state
    beta_up, beta_down = (positive_field(dev, key, "missing-beta") for key in ("beta_up", "beta_down"))
    if isinstance(beta_up, str) or isinstance(beta_down, str):
        return default, f"default:{beta_up if isinstance(beta_up, str) else beta_down}", {}
    rtt = _number(dev.get("rtt_s"))
    if rtt is None or not math.isfinite(rtt) or rtt < 0:
        return default, "default:missing-rtt", {}
    last = (cloud or {}).get("last")
    sessions = _number(last.get("num_sessions")) if isinstance(last, Mapping) else None
    sessions = max(1.0, sessions) if sessions is not None and math.isfinite(sessions) else 1.0
    overhead = _number(dev.get("round_overhead_s"))
    overhead = overhead if overhead is not None and math.isfinite(overhead) and overhead >= 0 else 0.0
    try:
        link = LinkLoad(rtt, bytes_per_token, beta_up, beta_down, sessions, overhead)
        name, rates = choose_budget(options, link, g, current)
        modelled = {o.name: modelled_rate(o, link, g) for o in options}
    except ValueError as exc:  # a curve that cannot be read at these sizes: keep the device's shape
        return default, f"default:bad-telemetry ({exc})", {}
    detail = {
        "sessions": sessions,
        "tokens_per_s": {k: round(v, 4) for k, v in rates.items()},
        # the round model alone (k = 1): what a device measures its shape's speed against (observe_speed)
        "modelled_tokens_per_s": {k: round(v, 4) for k, v in modelled.items()},
    }
    return name, "budget", detail


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class BudgetRequest:
    """`POST /draft-budget`'s body: the device, its A, its configured shape and its measured options."""

    device_id: str
    bytes_per_token: int | None
    default: str
    options: list[BudgetOption]
    current: str | None = None  # the shape the device runs now

    @classmethod
    def from_json(cls, body: Any) -> BudgetRequest:
        if not isinstance(body, Mapping):
            raise BudgetError("the body must be a JSON object")
        device_id, default, raw = body.get("device_id"), body.get("default"), body.get("options")
        if not isinstance(device_id, str) or not DEVICE_ID.match(device_id):
            raise BudgetError("device_id must be 1..128 letters, digits, '_', '.' or '-'")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_OPTIONS:
            raise BudgetError(f"options must be a list of 1..{MAX_OPTIONS} shapes")
        options = []
        for item in raw:
            name = item.get("name") if isinstance(item, Mapping) else None
            if not isinstance(item, Mapping) or not isinstance(name, str) or not 0 < len(name) <= 32:
                raise BudgetError("each option needs a name (1..32 characters), accept, rows and draft_s")
            numbers = [_number(item.get(k)) for k in ("accept", "rows", "draft_s")]
            slowdown = _number(item.get("slowdown", 1.0))
            if None in numbers or slowdown is None:
                raise BudgetError(f"option {name!r}: accept, rows, draft_s and slowdown must be numbers")
            accept, rows, draft_s = (float(x or 0) for x in numbers)
            options.append(BudgetOption(name, accept, rows, draft_s, slowdown))
        names = [o.name for o in options]
        if len(set(names)) != len(names):
            raise BudgetError("option names must be distinct")
        if default not in names:
            raise BudgetError("default must name one of the options")
        current = body.get("current")
        if current is not None and current not in names:
            raise BudgetError("current, when given, must name one of the options")
        bytes_per_token = body.get("bytes_per_token")
        if bytes_per_token is not None and (
            not isinstance(bytes_per_token, int)
            or isinstance(bytes_per_token, bool)
            or not 0 < bytes_per_token <= 1 << 24
        ):
            raise BudgetError("bytes_per_token must be an integer in 1..2**24")
        return cls(device_id, bytes_per_token, default, options, current)

    def to_json(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "bytes_per_token": self.bytes_per_token,
            "default": self.default,
            "options": [vars(o) for o in self.options],
            "current": self.current,
        }
