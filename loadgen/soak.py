"""`make soak`: a long Poisson load through the streamer of a real mesh, watching failures and memory.

The mesh is the one `tophat serve` runs (tophatctl/mesh.py), the load is the benchmark's own
(loadgen/arrivals.py Poisson arrivals of SpecBench-shaped prompts, sent open loop by
loadgen/runner.py). First a few warm-up requests, one at a time: they load every lazy path (the
first prefill, the planner's first plan, allocator pools) and, unless `--rate` is given, measure
how long one request takes, so the soak runs at a rate the box sustains (half of one request at a
time per device); then `--warmup-s` of the soak's own load. The resident memory of every process
the launcher started is read before the warm-up, after it, every few seconds of the `--duration`
seconds of load and at the end (loadgen/soak_memory.py). The report lists failed requests and
each service's RSS (start, after the warm-up, end, max, growth); the soak fails (exit status 1)
when a request failed or a service's RSS grew after the warm-up over both of `--rss-max-growth-pct`
and `--rss-min-growth-mib` (or it was restarted), naming the service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadgen import arrivals, runner, workloads
from loadgen.metrics import RequestRecord, e2e_s
from loadgen.soak_memory import RssLimit, ServiceMemory, rss_kib

log = logging.getLogger(__name__)

UTILIZATION = 0.5  # the auto rate keeps each device busy about half the time: queues stay short


@dataclass
class SoakReport:
    duration_s: float
    rate: float
    warmup_requests: int
    warmup_failed: int
    requests: int = 0
    completed: int = 0
    failed: int = 0
    errors: Counter = field(default_factory=Counter)  # error text -> count, warm-up included
    mean_e2e_s: float | None = None
    memory: list[ServiceMemory] = field(default_factory=list)
    rss_limit: RssLimit = field(default_factory=RssLimit)

    @property
    def memory_failures(self) -> list[str]:
        return [reason for m in self.memory if (reason := m.failure(self.rss_limit)) is not None]

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.warmup_failed == 0 and not self.memory_failures

    def format(self) -> str:
        lines = [
            f"soak: {self.duration_s:g} s of Poisson load at {self.rate:.3g} req/s "
            f"(after {self.warmup_requests} warm-up requests, {self.warmup_failed} of them failed)",
            f"requests: {self.requests}, completed: {self.completed}, failed: {self.failed} (goal 0)",
        ]
        if self.mean_e2e_s is not None:
            lines.append(f"mean end-to-end latency: {self.mean_e2e_s * 1e3:.0f} ms")
        lines += [f"  error x{count}: {error}" for error, count in self.errors.most_common(10)]
        lines.append(
            f"{'service':18s} {'pid':>8s} {'RSS start':>11s} {'warmed up':>11s} {'end':>11s} {'max':>11s} "
            f"{'growth':>18s}  (fails at {self.rss_limit.describe()})"
        )
        for m in self.memory:
            growth = "n/a" if m.growth_kib is None else f"{m.growth_kib / 1024:+.1f} MiB"
            pct = "" if m.growth_pct is None else f" {m.growth_pct:+.1f}%"
            lines.append(
                f"{m.name:18s} {m.pid:8d} {_mib(m.start_kib):>11s} {_mib(m.baseline_kib):>11s} "
                f"{_mib(m.end_kib):>11s} {_mib(m.peak_kib):>11s} {growth + pct:>18s}"
            )
        failures = (["requests failed"] if self.failed or self.warmup_failed else []) + self.memory_failures
        lines += [f"FAIL: {reason}" for reason in failures] or ["PASS: no request failed, no service's RSS grew"]
        return "\n".join(lines)


def _mib(kib: int | None) -> str:
    return "gone" if kib is None else f"{kib / 1024:.1f} MiB"


def mesh_processes(mesh: Any) -> dict[str, int]:
    """name -> pid of every process a launcher Mesh runs right now (its services and the embedded Redis)."""
    pids = {service.name: service.process.pid for service in mesh.services}
    redis_pid = getattr(mesh.redis, "pid", None) if mesh.redis is not None else None
    if redis_pid:
        pids["redis"] = redis_pid
    return pids


def _tally(records: list[RequestRecord], errors: Counter) -> int:
    failed = [r for r in records if not r.ok]
    errors.update(str(r.error)[:200] for r in failed)
    return len(failed)


def _sample(processes: Callable[[], dict[str, int]], memory: dict[str, ServiceMemory]) -> None:
    now = processes()
    for name, m in memory.items():
        m.sample(now.get(name))


async def _sample_every(
    processes: Callable[[], dict[str, int]], memory: dict[str, ServiceMemory], every_s: float
) -> None:
    while True:
        await asyncio.sleep(every_s)
        _sample(processes, memory)


async def soak(
    url: str,
    processes: Callable[[], dict[str, int]],
    *,
    model_dir: str,
    duration_s: float,
    rate: float | None = None,
    warmup_requests: int = 4,
    warmup_s: float = 0.0,
    max_new_tokens: int = 32,
    num_devices: int = 1,
    seed: int = 0,
    request_timeout_s: float = 120.0,
    sample_every_s: float | None = None,
    rss_limit: RssLimit | None = None,
    extra_body: dict[str, Any] | None = None,
) -> SoakReport:
    """Warm up, read RSS, send Poisson load for `duration_s` through the streamer at `url`, read RSS again.

    The warm-up: `warmup_requests` one at a time, then `warmup_s` of the same Poisson load (other prompts), so
    the start sample is taken after the services have met prompts of every length at that concurrency.

    `processes` names the pids to watch (read again at each sample, so a restarted service is seen);
    `rate` None: UTILIZATION * devices / the warm-up's mean end-to-end latency. `sample_every_s` None: often
    enough for about 20 RSS samples of the load, at most every 10 s."""
    from tophatctl.models import resolve_model

    path = resolve_model(model_dir)
    tokenizer = workloads.load_tokenizer(path)
    limit = workloads.context_limit_of(path)
    probe = await runner.probe_server(url)
    cfg = runner.RunConfig(
        url=url, model=probe["model"], request_timeout_s=request_timeout_s, extra_body=extra_body or {}, progress=False
    )

    held_out = workloads.HeldOutText(tokenizer)  # tokenized once: it takes seconds

    def requests_for(count: int, request_seed: int) -> list[workloads.WorkloadRequest]:
        return workloads.synthetic_workload(
            workloads.SPECBENCH,
            count,
            tokenizer=tokenizer,
            max_new_tokens=max_new_tokens,
            context_limit=limit,
            seed=request_seed,
            num_devices=num_devices,
            held_out=held_out,
        ).requests

    memory = {name: ServiceMemory(name, pid, rss_kib(pid)) for name, pid in processes().items()}
    errors: Counter = Counter()
    warm = await runner.run_load(
        requests_for(warmup_requests, seed + 1), [0.0] * warmup_requests, dataclasses.replace(cfg, max_concurrency=1)
    )
    if rate is None:  # send to end, not arrival to end: the warm-up requests all arrive at 0 and queue
        latencies = [r.end_s - r.send_s for r in warm.records if r.ok and r.end_s is not None and r.send_s is not None]
        if not latencies:
            raise RuntimeError(f"every warm-up request failed, no rate to soak at: {dict(errors)}")
        rate = UTILIZATION * num_devices / (sum(latencies) / len(latencies))
    warm_records = list(warm.records)
    warm_times = arrivals.arrival_times(rate, duration=warmup_s, seed=seed + 2).tolist() if warmup_s > 0 else []
    if warm_times:
        warm_records += (await runner.run_load(requests_for(len(warm_times), seed + 2), warm_times, cfg)).records
    warmup_failed = _tally(warm_records, errors)
    report = SoakReport(
        duration_s=duration_s,
        rate=rate,
        warmup_requests=len(warm_records),
        warmup_failed=warmup_failed,
        errors=errors,
        rss_limit=rss_limit or RssLimit(),
    )

    _sample(processes, memory)
    for m in memory.values():
        m.baseline_kib = m.samples[0] if m.samples else None
    times = arrivals.arrival_times(rate, duration=duration_s, seed=seed)
    every_s = sample_every_s if sample_every_s is not None else min(10.0, max(0.5, duration_s / 20))
    sampler = asyncio.create_task(_sample_every(processes, memory, every_s))
    try:
        run = await runner.run_load(requests_for(len(times), seed), times.tolist(), cfg)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    _sample(processes, memory)
    for m in memory.values():
        m.finish(rss_kib(m.end_pid) if m.end_pid is not None else None)
    report.memory = list(memory.values())
    report.requests = len(run.records)
    report.failed = _tally(run.records, errors)
    report.completed = report.requests - report.failed
    latencies = [x for x in map(e2e_s, run.records) if x is not None]
    report.mean_e2e_s = sum(latencies) / len(latencies) if latencies else None
    return report


def main(args: argparse.Namespace) -> int:
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig
    from tophatctl.mesh_ports import find_port_base

    if not (args.duration > 0 and math.isfinite(args.duration)) or args.warmup_requests < 1 or not args.warmup_s >= 0:
        raise ValueError("--duration must be a finite number > 0, --warmup-requests at least 1, --warmup-s >= 0")
    rss_limit = RssLimit(args.rss_max_growth_pct, args.rss_min_growth_mib)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = MeshConfig(model_dir=args.model, num_devices=args.devices, port_base=find_port_base(args.devices))
    with Mesh(config) as mesh:
        print(f"mesh up ({args.model}, {args.devices} device(s)); logs in {config.log_dir}", flush=True)
        report = asyncio.run(
            soak(
                config.streamer_url,
                lambda: mesh_processes(mesh),
                model_dir=args.model,
                duration_s=args.duration,
                rate=args.rate,
                warmup_requests=args.warmup_requests,
                warmup_s=args.warmup_s,
                max_new_tokens=args.max_new_tokens,
                num_devices=args.devices,
                seed=args.seed,
                rss_limit=rss_limit,
            )
        )
    print(report.format())
    return 0 if report.ok else 1
