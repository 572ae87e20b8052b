"""What the simulator needs to know about the mesh: latency models and their defaults.

A `Calibration` holds everything timing-related: the cloud's compute delay g(mu) as a
table of (batched tokens, seconds) points, one `DeviceProfile` per measured device
(draft step gamma, prefill cost per prompt token, uplink/downlink bandwidth, one-way
latency), the accept-length distribution of speculative decoding, the parallel-drafting
hit rate, and the model shape (hidden size, n layers, m on the device).

Two documented bases (`base` in the JSON; missing keys take the base's value):

* ``paper`` (default): HAT's testbed with Vicuna-7B on SpecBench. g(mu) follows Fig. 1(c)
  (+10% from 1 to 32 tokens, linear above 512; 0.28 s for 2k tokens, §2.3) and Fig. 8
  (per-GPU step 6.8-8.4 ms at P = 4); links are HAT's three WiFi groups (shared.net.links
  near/mid/far: up 10/7.5/5 MB/s, down 15/12.5/10 MB/s); an AGX Orin drafts a step in
  6 ms and runs the input layers at 45 us per prompt token (2k tokens: 0.09 s, §2.3);
  accept lengths have mean 2.08 (HAT Table 4: 2.06). Where the paper gives no number
  (gamma, latency), the value is our estimate.
* ``demo``: the committed demo model on this box (docs/benchmarks/, `make bench-core`): hidden 256,
  8 layers, m = 2, draft step 2.25 ms, verify pass 3.2-4.2 ms, accept lengths as measured
  (mean 1.63); links are the `mid` profile scaled to hidden 256; ~10 ms per round of
  device-side head/sampling/bookkeeping (bench-core: ushape 15.8 ms/token in-process against
  a 2.3 ms step + 3.2 ms verify). These are the fallbacks `from_telemetry` uses for
  anything the state monitor does not report.

Heterogeneity (HAT §4.1): when more devices are simulated than profiles given, profiles
are treated as Orin-class templates laid out in contiguous groups (one per template, like
HAT's three distance groups) and a `slow_fraction` of devices (2/3: 20 Xavier of 30) is
slowed by `slow_factor` (3.0, shared.planning.device_speed's "xavier"); `mode_cycle` (e.g.
[1, 2, 5, 10]) further changes every device's speed every `mode_switch_every` requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.net.links import PROFILES, scaled_for_hidden
from shared.planning.device_speed import SPEED_CLASSES, SpeedSchedule
from shared.planning.planners import hidden_bytes_per_token
from shared.planning.prefill_pieces import DEFAULT_MAX_PREFILL_STEP_MS


class GTable:
    """g(mu): seconds of one whole pass of the middle layers over `mu` batched tokens.

    Same rule as `shared.planning.state_model.ComputeDelayPredictor.predict` on its bucket points:
    running max (monotone), linear inside the table, linear extrapolation from the edge
    segment outside (least-squares slope if that segment is flat), never below 0; a single
    point is a constant. Kept separate so a table from a JSON file needs no bucketing.
    """

    def __init__(self, points: list[tuple[float, float]] | list[list[float]]) -> None:
        pts = sorted((float(m), float(s)) for m, s in points)
        if not pts:
            raise ValueError("g table needs at least one (mu, seconds) point")
        for m, s in pts:
            if not (math.isfinite(m) and math.isfinite(s) and m >= 0 and s >= 0):
                raise ValueError(f"bad g point ({m}, {s}): need finite mu >= 0, seconds >= 0")
        top, mono = -math.inf, []
        for m, s in pts:
            top = max(top, s)
            mono.append((m, top))
        self.points = mono

    def _lsq_slope(self) -> float:
        n = len(self.points)
        mx = sum(p[0] for p in self.points) / n
        my = sum(p[1] for p in self.points) / n
        sxx = sum((p[0] - mx) ** 2 for p in self.points)
        return 0.0 if sxx <= 0 else sum((p[0] - mx) * (p[1] - my) for p in self.points) / sxx

    def __call__(self, mu: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        if pts[0][0] < mu < pts[-1][0]:
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                if x0 <= mu <= x1:
                    return y0 if x1 <= x0 else y0 + (y1 - y0) * (mu - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = (pts[0], pts[1]) if mu <= pts[0][0] else (pts[-2], pts[-1])
        anchor_x, anchor_y = (x0, y0) if mu <= pts[0][0] else (x1, y1)
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        if slope <= 0:
            slope = max(self._lsq_slope(), 0.0)
        return max(anchor_y + slope * (mu - anchor_x), 0.0)


@dataclass(frozen=True)
class DeviceProfile:
    """One device: seconds per draft step, per prompt token (input layers), links, speed.

    `slowdown` multiplies gamma and prefill_token_s: the real device agent measures gamma
    *before* its emulated slowdown stretches the wall time (shared.planning.device_speed.slowed),
    so a profile read from telemetry of a `--speed xavier` device needs slowdown 3.
    """

    device_id: str
    gamma_s: float
    prefill_token_s: float
    beta_up: float  # bytes/s, inf = unlimited
    beta_down: float  # bytes/s
    latency_s: float  # one-way, per message
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        for name in ("gamma_s", "prefill_token_s", "latency_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"DeviceProfile.{name} must be finite and >= 0, got {value!r}")
        for name in ("beta_up", "beta_down"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceProfile.{name} must be > 0 (inf = unlimited), got {getattr(self, name)!r}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ValueError(f"DeviceProfile.slowdown must be >= 1, got {self.slowdown!r}")

    @property
    def step_s(self) -> float:
        return self.gamma_s * self.slowdown

    @property
    def token_s(self) -> float:
        return self.prefill_token_s * self.slowdown


def _paper_devices() -> list[DeviceProfile]:
    return [
        DeviceProfile(
            f"orin-{name}",
            0.006,
            45e-6,
            PROFILES[name].uplink_bytes_s,
            PROFILES[name].downlink_bytes_s,
            PROFILES[name].latency_s,
        )
        for name in ("near", "mid", "far")
    ]


_PAPER_G = [(1, 0.020), (32, 0.022), (128, 0.028), (512, 0.070), (2048, 0.280), (4096, 0.560)]
_PAPER_ACCEPT = [0.42, 0.31, 0.14, 0.07, 0.03, 0.02, 0.01]


@dataclass
class Calibration:
    """Every timing input of the simulator (defaults: HAT's testbed, see the module docstring)."""

    g_table: list[tuple[float, float]] = field(default_factory=lambda: list(_PAPER_G))
    devices: list[DeviceProfile] = field(default_factory=_paper_devices)
    accept_dist: list[float] = field(default_factory=lambda: list(_PAPER_ACCEPT))  # P(L = 1..K+1)
    pd_hit_rate: float = 0.5  # P(correction is a pre-drafted candidate | last draft token rejected)
    full_accept_rate: float | None = None  # P(a round accepts every drafted token): its draft was L - 1
    # long; None: drafts always run to the rejected token (k = min(L, K))
    # Draft trees (loadgen/simulate/trees.py): N nodes (0: none measured), P(a tree round sends `rows` and
    # yields `tokens`) as [rows, tokens, p] triples, and its drafting over a chain round's (measured ratio)
    tree_nodes: int = 0
    tree_joint: list[list[float]] | None = None
    tree_draft_ratio: float | None = None
    pd_candidates: int = 2  # branches pre-drafted per round (TOPHAT_DEVICE_PARALLEL_CANDIDATES)
    pd_steps: int | None = None  # fixed lambda; None = eq. 6 every round
    pd_batched: bool = True  # candidates drafted as one batch (HAT: "in parallel"); the real
    # CPU agent drafts them one after another (demo base: False)
    pc_chunk: int | None = None  # fixed client chunk; None = eq. 3 (default 128 before any cloud step)
    hidden_size: int = 4096
    wire_dtype_bytes: int = 2
    num_layers: int = 32  # n
    split_layers: int = 2  # m
    cloud_compute_scale: float | None = None  # cloud mode's whole model vs the middle; None = n / (n - m)
    token_bytes: int = 4  # a token id on the wire (cloud mode)
    frame_overhead_bytes: int = 64  # per message (shared/wire/schema.py: <= 64 bytes beyond the tensor)
    round_overhead_s: float = 0.0  # device-side per round (head, sampling, framing), not in gamma
    # Its median: when 0 < median < mean, each round draws a lognormal overhead with this median
    # and round_overhead_s as its mean (measured per-round times are skewed); None = constant.
    round_overhead_median_s: float | None = None
    step_overhead_s: float = 0.0  # per cloud step beyond g(mu) (scheduling, thread hop, replies)
    session_open_rtt: bool = True  # split modes open a cloud session (one round trip) first
    nosd_step_factor: float = 1.0  # a non-speculative decode step in units of gamma
    max_batch_tokens: int = 4096  # TOPHAT_VERIFIER_MAX_BATCH_TOKENS
    max_prefill_step_s: float = DEFAULT_MAX_PREFILL_STEP_MS / 1e3  # the verifier's bound on prompts' pieces
    chunk_pipelining: bool = True  # a session's prefill chunks overlap in the stages (eq. 3; the
    # verifier's prefill_pipelining with P > 1)
    min_chunk: int = 16
    max_chunk: int = 1024
    default_chunk: int = 128
    context_limit: int = 2048
    max_new_tokens: int = 128
    alpha: float = 0.8  # EMA of the cloud's batched tokens mu (eq. 1), used by eq. 3
    slow_fraction: float = 2 / 3
    slow_factor: float = SPEED_CLASSES["xavier"].modes[0]
    mode_cycle: list[float] | None = None
    mode_switch_every: int = 5
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.g = GTable(self.g_table)
        self.g_table = list(self.g.points)
        if not self.devices:
            raise ValueError("calibration needs at least one device profile")
        total = sum(self.accept_dist)
        if not self.accept_dist or min(self.accept_dist) < 0 or total <= 0:
            raise ValueError("accept_dist must be non-negative probabilities of 1..K+1 tokens per round")
        self.accept_dist = [p / total for p in self.accept_dist]
        if (
            not 0 <= self.pd_hit_rate <= 1
            or not 0 <= self.slow_fraction <= 1
            or not (self.full_accept_rate is None or 0 <= self.full_accept_rate <= 1)
        ):
            raise ValueError("pd_hit_rate, full_accept_rate and slow_fraction must be in [0, 1]")
        if self.tree_joint is not None:
            self.tree_joint = _tree_joint(self.tree_joint)
        bad_ratio = self.tree_draft_ratio is not None and self.tree_draft_ratio <= 0
        if self.has_trees != (self.tree_nodes > 0) or bad_ratio:
            raise ValueError("trees need tree_nodes > 0, tree_joint and tree_draft_ratio > 0 together")
        if self.split_layers < 1 or self.num_layers <= self.split_layers:
            raise ValueError(f"need 1 <= split_layers < num_layers, got m={self.split_layers}, n={self.num_layers}")
        if self.mode_cycle is not None:
            SpeedSchedule(self.mode_cycle, self.mode_switch_every)  # validates
        if self.round_overhead_s < 0 or (self.round_overhead_median_s is not None and self.round_overhead_median_s < 0):
            raise ValueError("round_overhead_s and round_overhead_median_s must be >= 0")

    @property
    def round_overhead_sigma(self) -> float:
        """Lognormal sigma with median m and mean u: u = m * exp(sigma^2 / 2); 0 = constant overhead."""
        m, u = self.round_overhead_median_s, self.round_overhead_s
        if m is None or not 0 < m < u:
            return 0.0
        return math.sqrt(2 * math.log(u / m))

    # -- derived -----------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """A of eq. 3 / eq. 6: one token's hidden state on the wire."""
        return hidden_bytes_per_token(self.hidden_size, self.wire_dtype_bytes)

    @property
    def max_draft(self) -> int:
        """K: the longest draft, from the accept distribution's support 1..K+1."""
        return max(0, len(self.accept_dist) - 1)

    @property
    def mean_accept_length(self) -> float:
        return sum((i + 1) * p for i, p in enumerate(self.accept_dist))

    @property
    def has_trees(self) -> bool:
        return self.tree_joint is not None and self.tree_draft_ratio is not None

    @property
    def tree_shape(self) -> str:
        """The tree's name as the draft budget knows it (shared.planning.draft_budget.DraftShape)."""
        return f"tree{self.tree_nodes}"

    def tree_means(self) -> tuple[float, float]:
        """(mean tokens, mean rows) of a tree round."""
        joint = self.tree_joint or []
        return sum(t * p for _, t, p in joint), sum(r * p for r, _, p in joint)

    @property
    def compute_scale(self) -> float:
        """Cloud mode runs all n layers where the split runs n - m (embeddings and head are small)."""
        if self.cloud_compute_scale is not None:
            return self.cloud_compute_scale
        return self.num_layers / (self.num_layers - self.split_layers)

    def speed_schedule(self) -> SpeedSchedule | None:
        return SpeedSchedule(self.mode_cycle, self.mode_switch_every) if self.mode_cycle else None

    def expand_devices(self, n: int, heterogeneous: bool = True) -> list[DeviceProfile]:
        """`n` device profiles: the given ones when there are enough, else templates + slow devices."""
        if n < 1:
            raise ValueError("need at least one device")
        if n <= len(self.devices):
            return list(self.devices[:n])
        out = []
        for i in range(n):
            base = self.devices[i * len(self.devices) // n]  # contiguous groups, one per template
            slow = heterogeneous and math.floor((i + 1) * self.slow_fraction) > math.floor(i * self.slow_fraction)
            factor = base.slowdown * (self.slow_factor if slow else 1.0)
            out.append(dataclasses.replace(base, device_id=f"{'slow' if slow else 'fast'}-{i}", slowdown=factor))
        return out

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["g_table"] = [list(p) for p in self.g_table]
        data["devices"] = [{k: _json_number(v) for k, v in dataclasses.asdict(d).items()} for d in self.devices]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        data = dict(data)
        base_name = data.pop("base", "paper")
        if base_name not in BASES:
            raise ValueError(f"unknown calibration base {base_name!r}; known: {', '.join(BASES)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown calibration keys: {', '.join(sorted(unknown))}")
        if "devices" in data:
            try:
                data["devices"] = [
                    # mypy sees one value type for every field; a profile's id is a string, the rest numbers
                    DeviceProfile(**{k: str(v) if k == "device_id" else _number(v) for k, v in d.items()})  # type: ignore[arg-type]
                    for d in data["devices"]
                ]
            except (TypeError, AttributeError) as exc:
                raise ValueError(f"bad device profile in calibration: {exc}") from exc
        if "g_table" in data:
            data["g_table"] = [tuple(p) for p in data["g_table"]]
        base = BASES[base_name]()
        return dataclasses.replace(base, **data)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _tree_joint(triples: list[list[float]]) -> list[list[float]]:
    """[rows, tokens, p] triples, normalised; a round yields 1..rows tokens (it cannot accept more than it sent)."""
    out = []
    for triple in triples:
        rows, tokens, p = (float(x) for x in triple)
        if not (rows == int(rows) and tokens == int(tokens) and 1 <= tokens <= rows and math.isfinite(p) and p >= 0):
            raise ValueError(f"bad tree round {triple!r}: need integers 1 <= tokens <= rows and p >= 0")
        out.append([int(rows), int(tokens), p])
    total = sum(p for _, _, p in out)
    if total <= 0:
        raise ValueError("tree_joint needs a positive probability")
    return [[r, t, p / total] for r, t, p in out]


def _json_number(v: Any) -> Any:
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def _number(v: Any) -> float:
    return math.inf if v in ("inf", "Infinity") else float(v)


def paper_calibration() -> Calibration:
    return Calibration()


def demo_calibration() -> Calibration:
    """The committed demo model on this box (docs/benchmarks/ bench-core numbers; links `mid`, scaled)."""
    mid = scaled_for_hidden(PROFILES["mid"], 256)
    total = 48.9 + 46.3 + 1.3 + 1.3 + 1.0 + 1.3
    return Calibration(
        g_table=[(1, 0.00315), (9, 0.00415), (128, 0.012), (512, 0.045), (2048, 0.20)],
        devices=[DeviceProfile("demo", 0.00225, 0.0001, mid.uplink_bytes_s, mid.downlink_bytes_s, mid.latency_s)],
        accept_dist=[p / total for p in (48.9, 46.3, 1.3, 1.3, 1.0, 1.3)],
        hidden_size=256,
        num_layers=8,
        split_layers=2,
        pd_batched=False,
        round_overhead_s=0.010,
    )


BASES = {"paper": paper_calibration, "demo": demo_calibration}
