"""The draft budget of a round: how many draft rows a device sends per verification, from the measured
link and the cloud's load. Pure functions; the chunk planner serves the choice (`POST /draft-budget`)
and the device agent keeps the per-shape measurements (`shared/planning/budget_tracker.py`).

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
from dataclasses import dataclass
from typing import Any

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
    rtt = number_or_none(dev.get("rtt_s"))
    if rtt is None or not math.isfinite(rtt) or rtt < 0:
        return default, "default:missing-rtt", {}
    last = (cloud or {}).get("last")
    sessions = number_or_none(last.get("num_sessions")) if isinstance(last, Mapping) else None
    sessions = max(1.0, sessions) if sessions is not None and math.isfinite(sessions) else 1.0
    overhead = number_or_none(dev.get("round_overhead_s"))
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


def number_or_none(value: Any) -> float | None:
    """A JSON number as a float; None for anything else (bools included)."""
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
            numbers = [number_or_none(item.get(k)) for k in ("accept", "rows", "draft_s")]
            slowdown = number_or_none(item.get("slowdown", 1.0))
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
