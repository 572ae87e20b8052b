"""One simulated run (a mode at a rate) and a grid of them, with the load generator's metrics.

Requests are the load generator's: arrival offsets from `loadgen.arrivals.arrival_times`
and prompt lengths drawn exactly as `loadgen.workloads.synthetic_workload` draws them
(same RNG stream, same fitted gamma, same clip), so a simulated run at a seed replays the
trace a real `tophat loadgen` run at that seed sends. (The real prompts are then cut
from text and re-encoded, which can move a length by a token or so.) Every request
generates `max_new_tokens` tokens (HAT: 128; no EOS).

Placement is the token streamer's (services/token_streamer/router.py): the device with
the fewest outstanding requests, scanning from just after the previous pick; or
``round-robin`` (request i on device i mod N, as when every device makes its own
requests, HAT §4.1). Devices take any number of concurrent requests.

Metrics are computed by `loadgen.metrics.build_results` on the same `RequestRecord`s the
load generator fills, so TTFT/TBT (k-token rounds count as k gaps of G/k) mean exactly
the same on both sides.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from loadgen.arrivals import arrival_times
from loadgen.metrics import RequestRecord, build_results
from loadgen.simulate.calibration import Calibration
from loadgen.simulate.cloud import Cloud, ReplicatedCloud
from loadgen.simulate.events import EventLoop
from loadgen.simulate.modes import SimMode, parse_mode
from loadgen.simulate.session import Context, Device, RequestProcess, SimRequest
from loadgen.workloads import BUILTIN, MIN_PROMPT_TOKENS, WORKLOAD_STREAM, fit_lengths

log = logging.getLogger(__name__)

ROUTINGS = ("least-loaded", "round-robin")


@dataclass
class SimConfig:
    devices: int = 30
    stages: int = 4
    workload: str = "specbench"
    num_requests: int = 200
    seed: int = 0
    burstiness: float = 1.0
    routing: str = "least-loaded"
    heterogeneous: bool = True
    max_new_tokens: int | None = None  # None: the calibration's (128)
    replicas: int = 1  # verifiers side by side (GPUs each serving the middle layers), sessions pinned to one

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.workload not in BUILTIN:
            raise ValueError(f"workload must be one of {', '.join(BUILTIN)}, got {self.workload!r}")
        if self.devices < 1 or self.stages < 1 or self.num_requests < 1 or self.replicas < 1:
            raise ValueError("devices, stages, num_requests and replicas must be >= 1")


@dataclass
class SimRun:
    """Everything one run produced (the results dict is what gets printed and saved)."""

    results: dict[str, Any]
    records: list[RequestRecord]
    cloud: Cloud | ReplicatedCloud
    devices: list[Device]
    events: int = 0
    wall_s: float = 0.0
    processes: list[RequestProcess] = field(default_factory=list)


def build_requests(
    workload: str,
    num_requests: int,
    rate: float,
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 128,
    context_limit: int = 2048,
    num_devices: int = 1,
) -> list[SimRequest]:
    """The load generator's trace for these options: arrivals and prompt lengths."""
    times = arrival_times(rate, burstiness, num_requests=num_requests, seed=seed)
    rng = np.random.default_rng([seed, WORKLOAD_STREAM])
    lengths = fit_lengths(BUILTIN[workload], len(times), rng, MIN_PROMPT_TOKENS, context_limit - max_new_tokens)
    return [
        SimRequest(i, float(t), int(n), max_new_tokens, i % max(1, num_devices))
        for i, (t, n) in enumerate(zip(times, lengths))
    ]


class Router:
    """Least outstanding requests, ties taken in turn (token streamer), or plain round-robin."""

    def __init__(self, devices: list[Device], policy: str) -> None:
        self.devices, self.policy, self.cursor = devices, policy, 0

    def pick(self, req: SimRequest) -> Device:
        n = len(self.devices)
        if self.policy == "round-robin":
            return self.devices[req.index % n]
        best = None
        for k in range(n):
            device = self.devices[(self.cursor + k) % n]
            if best is None or device.outstanding < best.outstanding:
                best = device
        assert best is not None
        self.cursor = (best.index + 1) % n
        return best


def run_simulation(
    cal: Calibration,
    mode: SimMode | str,
    rate: float,
    config: SimConfig | None = None,
    requests: list[SimRequest] | None = None,
) -> SimRun:
    """Simulate one mode at one request rate (req/s; inf = all at t = 0)."""
    config = config or SimConfig()
    mode = parse_mode(mode, config.workload) if isinstance(mode, str) else mode
    if mode.tree_rounds and not cal.has_trees:
        raise ValueError(
            f"mode {mode.name!r} needs measured trees in the calibration (--tree-nodes with --gpu-profile)"
        )
    max_new = config.max_new_tokens or cal.max_new_tokens
    if requests is None:
        requests = build_requests(
            config.workload,
            config.num_requests,
            rate,
            burstiness=config.burstiness,
            seed=config.seed,
            max_new_tokens=max_new,
            context_limit=cal.context_limit,
            num_devices=config.devices,
        )
    loop = EventLoop()
    clouds = [
        Cloud(
            loop,
            cal.g,
            config.stages,
            cal.max_batch_tokens,
            cal.compute_scale if mode.token_upload else 1.0,
            cal.alpha,
            cal.chunk_pipelining,
            cal.step_overhead_s,
            cal.max_prefill_step_s,
        )
        for _ in range(config.replicas)
    ]
    cloud: Cloud | ReplicatedCloud = clouds[0] if config.replicas == 1 else ReplicatedCloud(clouds)
    devices = [Device.build(loop, i, p) for i, p in enumerate(cal.expand_devices(config.devices, config.heterogeneous))]
    ctx = Context(loop, cloud, cal, mode, config.stages, config.seed)
    router = Router(devices, config.routing)
    schedule = cal.speed_schedule()
    processes: list[RequestProcess] = []

    def arrive(req: SimRequest) -> None:
        device = router.pick(req)
        slowdown = schedule.slowdown_for(device.served) if schedule else 1.0
        device.served += 1
        device.outstanding += 1
        proc = RequestProcess(ctx, req, device, slowdown)
        processes.append(proc)
        proc.start()

    for req in requests:
        loop.at(req.arrival_s, arrive, req)
    started = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - started
    records = sorted((p.record for p in processes), key=lambda r: r.index)
    unfinished = [r.index for r in records if r.end_s is None]
    if unfinished or len(records) != len(requests):
        raise RuntimeError(f"simulation ended with unfinished requests {unfinished[:5]}")
    results = {
        "mode": mode.name,
        "mode_flags": asdict(mode),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "num_devices": config.devices,
        "stages": config.stages,
        "workload": config.workload,
        "num_prompts": len(requests),
        "seed": config.seed,
        "burstiness": config.burstiness,
        "routing": config.routing,
        "max_new_tokens": max_new,
        "replicas": config.replicas,
        **build_results(records),
        "cloud": cloud.summary(),
    }
    if mode.draft_budget:
        shapes: dict[str, int] = {}
        for proc in processes:
            for name, count in proc.shape_rounds.items():
                shapes[name] = shapes.get(name, 0) + count
        results["budget_rounds"] = dict(sorted(shapes.items()))
    log.info(
        "simulated %s @ %s req/s: %d requests, %d events in %.2f s", mode.name, rate, len(records), loop.events, wall
    )
    return SimRun(results, records, cloud, devices, loop.events, wall, processes)


def simulate(cal: Calibration, mode: SimMode | str, rate: float, config: SimConfig | None = None) -> dict[str, Any]:
    """The results dict of one run (loadgen's keys: mean_ttft_ms, p90_tbt_ms, ... plus mode, cloud)."""
    return run_simulation(cal, mode, rate, config).results


def simulate_grid(
    cal: Calibration, modes: Sequence[SimMode | str], rates: list[float], config: SimConfig | None = None
) -> dict[str, Any]:
    """Every mode at every rate, on the same trace per rate (same seed): {"config", "calibration", "runs"}."""
    config = config or SimConfig()
    runs = [simulate(cal, mode, rate, config) for rate in rates for mode in modes]
    return {
        "config": asdict(config),
        "rates": ["inf" if math.isinf(r) else r for r in rates],
        "calibration": cal.to_dict(),
        "runs": runs,
    }
