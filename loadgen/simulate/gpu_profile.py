"""The cloud on a GPU: g(mu) from a measured GPU profile (`make bench-gpu`'s JSON), as a calibration.

What `tophat bench gpu` (loadgen/bench_gpu.py) measures and what is used here:

* ``stages.verify.ms``: ms of one eager pass of the middle layers over 1..32 rows (after 128 positions),
  keyed by row count. These are g(mu)'s points: interpolated in between (GTable's rule), flat-to-rising
  above the last point (GTable extrapolates its edge slope; a launch-bound curve has none, so the
  least-squares slope of the points is used).
* ``stages.cuda_graphs.verify_1row``: the same 1-row pass, eager and replayed from a CUDA graph. Graphs
  were measured at one row only, so `passes="graph"` scales the whole eager curve by graph/eager at one
  row (an estimate: where the eager curve is launch-bound and flat, the graph curve is taken as flat too).
* ``meta``/``stages.placement``: the model's shape (hidden size, layers) and the GPU's name;
  ``stages.verify.middle_layers`` the split (m = layers - middle layers).
* ``stages.decode.tok_s`` (not used for g: kept as `decode_step_ms` for the report): a packed unsplit
  step of 1/8/32 *sessions*, one row each, costs far more than 32 rows of one session (60 vs 11 ms on the
  H100), so a batch's cost depends on its sessions as well as its rows; the simulator's g(mu) counts rows.

The verifier may have several GPUs serving as replicas (`replicas`, 8 in the product's deployment): each
session is pinned to one replica (its KV cache lives there), and every replica batches its own sessions.

Everything here is pure: `parse_gpu_profile` takes the decoded JSON, `gpu_calibration` the parsed profile.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.simulate.calibration import Calibration
from shared.net.links import PROFILES, scaled_for_hidden

REPO = Path(__file__).resolve().parents[2]
NAMED_PROFILES = {"h100": REPO / "docs" / "benchmarks" / "gpu-h100.json"}
DEFAULT_ADAPTER_REPORT = REPO / "models" / "smollm2" / "adapter_report.json"
PASSES = ("eager", "graph")
DEFAULT_REPLICAS = 8  # the product's deployment: an 8-GPU server


class GpuProfileError(ValueError):
    """A GPU profile (or an adapter report) that lacks what the simulator needs, or holds nonsense."""


@dataclass(frozen=True)
class GpuProfile:
    source: str
    gpu: str
    model: str
    hidden_size: int
    layers: int
    middle_layers: int
    verify_ms: tuple[tuple[int, float], ...]  # (rows, eager ms of one middle pass), rows ascending
    graph_1row_ms: float | None = None  # the 1-row pass replayed from a CUDA graph
    eager_1row_ms: float | None = None  # ... and eager, in the same measurement
    decode_step_ms: tuple[tuple[int, float], ...] = ()  # (sessions, ms of one packed unsplit step)

    @property
    def split_layers(self) -> int:
        return self.layers - self.middle_layers

    @property
    def graph_factor(self) -> float:
        """graph / eager ms of the 1-row pass (what `passes="graph"` scales the eager curve by)."""
        if self.graph_1row_ms is None or self.eager_1row_ms is None:
            raise GpuProfileError(f"{self.source}: no cuda_graphs.verify_1row measurement (eager_ms, graph_ms)")
        return self.graph_1row_ms / self.eager_1row_ms


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise GpuProfileError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def _count(key: Any, where: str) -> int:
    try:
        count = int(str(key))
    except ValueError:
        raise GpuProfileError(f"{where}: key {key!r} is not a row count") from None
    if count < 1:
        raise GpuProfileError(f"{where}: row count {count} must be >= 1")
    return count


def _section(data: Mapping[str, Any], *path: str) -> Mapping[str, Any] | None:
    node: Any = data
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, Mapping) else None


def _points(table: Any, where: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(table, Mapping) or not table:
        raise GpuProfileError(f"{where} must be a non-empty object of count -> number")
    return tuple(sorted((_count(k, where), _positive(v, f"{where}[{k!r}]")) for k, v in table.items()))


def parse_gpu_profile(data: Any, source: str = "<gpu profile>") -> GpuProfile:
    """A `tophat bench gpu` JSON (decoded) -> GpuProfile; GpuProfileError says what is missing."""
    if not isinstance(data, Mapping):
        raise GpuProfileError(f"{source}: a GPU profile is a JSON object (tophat bench gpu --out)")
    verify = _section(data, "stages", "verify")
    if verify is None:
        raise GpuProfileError(f"{source}: no stages.verify (run tophat bench gpu with the verify stage)")
    if "ms" not in verify:
        raise GpuProfileError(f"{source}: stages.verify has no ms (its status: {verify.get('status')!r})")
    verify_ms = _points(verify["ms"], f"{source}: stages.verify.ms")
    meta = _section(data, "meta") or _section(data, "stages", "placement")
    if meta is None:
        raise GpuProfileError(f"{source}: no meta (the placement stage's model shape)")
    for key in ("hidden_size", "layers"):
        _positive(meta.get(key), f"{source}: meta.{key}")
    layers, hidden = int(meta["layers"]), int(meta["hidden_size"])
    middle = int(_positive(verify.get("middle_layers", layers - 2), f"{source}: stages.verify.middle_layers"))
    if not 0 < middle < layers:
        raise GpuProfileError(f"{source}: {middle} middle layers of {layers}: need 0 < middle < layers")
    graph = _section(data, "stages", "cuda_graphs", "verify_1row")
    graph_ms = eager_ms = None
    if graph is not None and "graph_ms" in graph:
        graph_ms = _positive(graph["graph_ms"], f"{source}: cuda_graphs.verify_1row.graph_ms")
        eager_ms = _positive(graph.get("eager_ms"), f"{source}: cuda_graphs.verify_1row.eager_ms")
    decode = _section(data, "stages", "decode", "tok_s")
    steps: tuple[tuple[int, float], ...] = ()
    if decode:
        steps = tuple((n, 1e3 * n / tok_s) for n, tok_s in _points(decode, f"{source}: stages.decode.tok_s"))
    return GpuProfile(
        source,
        str(meta.get("gpu", "unknown GPU")),
        str(meta.get("model", "unknown model")),
        hidden,
        layers,
        middle,
        verify_ms,
        graph_ms,
        eager_ms,
        steps,
    )


def load_gpu_profile(name_or_path: str | Path) -> GpuProfile:
    """A named profile (`h100`: the committed docs/benchmarks/gpu-h100.json) or a path to one."""
    path = NAMED_PROFILES.get(str(name_or_path).lower(), Path(name_or_path))
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise GpuProfileError(f"cannot read GPU profile {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise GpuProfileError(f"{path} is not JSON: {exc}") from exc
    path = Path(path).resolve()
    return parse_gpu_profile(data, str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path))


def gpu_g_table(profile: GpuProfile, passes: str = "eager") -> list[tuple[float, float]]:
    """g(mu) points, (rows, seconds of one middle pass): the eager curve, or it scaled to the graph's 1 row."""
    if passes not in PASSES:
        raise GpuProfileError(f"passes must be one of {', '.join(PASSES)}, got {passes!r}")
    factor = profile.graph_factor if passes == "graph" else 1.0
    return [(float(rows), ms * factor / 1e3) for rows, ms in profile.verify_ms]


def accept_from_adapter_report(data: Any, source: str = "<adapter report>") -> list[float]:
    """P(a round yields 1..K+1 tokens) from an adapter report's held-out chain rounds (`held_out.distribution`)."""
    dist = _section(data, "held_out", "distribution") if isinstance(data, Mapping) else None
    if not dist:
        raise GpuProfileError(f"{source}: no held_out.distribution (tophat evaluate-adapter writes it)")
    counts = dict(_points(dist, f"{source}: held_out.distribution"))
    top = max(counts)
    total = sum(counts.values())
    return [counts.get(n, 0.0) / total for n in range(1, top + 1)]


def read_json(path: str | Path, what: str = "adapter report") -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GpuProfileError(f"cannot read {what} {path}: {exc}") from exc


def load_adapter_accept(path: str | Path = DEFAULT_ADAPTER_REPORT) -> list[float]:
    return accept_from_adapter_report(read_json(path), str(path))


def load_full_accept_rate(path: str | Path = DEFAULT_ADAPTER_REPORT) -> float | None:
    """The held-out chain rounds' share that accepted every drafted token (drafting stopped at eta before a
    rejection: those rounds sent L rows, not L + 1); None where the report predates it."""
    rate = (_section(read_json(path), "held_out") or {}).get("full_accept_rate")
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise GpuProfileError(f"{path}: held_out.full_accept_rate must be in [0, 1], got {rate!r}")
    return float(rate)


def gpu_calibration(
    profile: GpuProfile,
    accept_dist: list[float],
    passes: str = "eager",
    base: Calibration | None = None,
    full_accept_rate: float | None = None,
) -> Calibration:
    """The base calibration (HAT's testbed: Orin-class devices, 2/3 of them Xavier-slow, the near/mid/far
    links) with the GPU's g(mu), the profile's model shape, links scaled to its hidden size (as the mesh
    scales them: the paper's seconds per token on the wire) and the given accept lengths (and the chain's
    measured full-accept rate, where given)."""
    base = base or Calibration()
    devices = []
    for device in base.devices:
        name = device.device_id.split("-", 1)[-1]
        if name in PROFILES:  # a named link: its bandwidths for this model's rows
            link = scaled_for_hidden(PROFILES[name], profile.hidden_size)
            device = dataclasses.replace(device, beta_up=link.uplink_bytes_s, beta_down=link.downlink_bytes_s)
        devices.append(device)
    table = gpu_g_table(profile, passes)
    notes = [
        f"g(mu): {profile.gpu}, {profile.model}, {passes} verify passes of {profile.middle_layers} middle "
        f"layers, {len(table)} row counts {table[0][0]:.0f}..{table[-1][0]:.0f}: "
        + ", ".join(f"{m:.0f}: {s * 1e3:.2f} ms" for m, s in table)
        + f" ({profile.source})",
        f"model: hidden {profile.hidden_size}, n={profile.layers}, m={profile.split_layers}; links "
        f"{', '.join(d.device_id for d in devices)} scaled to hidden {profile.hidden_size}",
        f"devices: gamma {devices[0].gamma_s * 1e3:.1f} ms per draft step, "
        f"{devices[0].prefill_token_s * 1e6:.0f} us per prompt token (the base's Orin), "
        f"{base.slow_fraction:.0%} of them {base.slow_factor:g}x slower (Xavier)",
        f"accept lengths: mean {sum((i + 1) * p for i, p in enumerate(accept_dist)):.2f}, K = {len(accept_dist) - 1}"
        + ("" if full_accept_rate is None else f", {full_accept_rate:.1%} of chain rounds accept every draft"),
    ]
    return dataclasses.replace(
        base,
        g_table=table,
        devices=devices,
        accept_dist=list(accept_dist),
        full_accept_rate=full_accept_rate if full_accept_rate is not None else base.full_accept_rate,
        hidden_size=profile.hidden_size,
        num_layers=profile.layers,
        split_layers=profile.split_layers,
        cloud_compute_scale=None,
        notes=base.notes + notes,
    )


def describe_decode(profile: GpuProfile) -> str:
    """One line on the packed multi-session decode steps (not part of g: see the module docstring)."""
    if not profile.decode_step_ms:
        return "packed decode steps: not measured"
    return "packed unsplit decode step, ms per sessions: " + ", ".join(
        f"{n}: {ms:.1f}" for n, ms in profile.decode_step_ms
    )
