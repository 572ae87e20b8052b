"""Prometheus metrics: every service's names in one table, a registry per service instance, the /metrics body.

Names follow vLLM's where vLLM has the same fact (speculative decoding, request
queue, latencies), under a `tophat:` prefix; the rest are the mesh's own. Each
service builds its set here and counts where it owns the fact:

    device agent    spec_decode_* (its DeviceSession's verification rounds), uplink/downlink bytes per device
    token streamer  num_requests_running / _waiting (admission), time_to_first_token / inter_token_latency /
                    e2e_request_latency (per request, from arrival at the streamer)
    verifier        batched tokens and step time per step, live sessions, KV bytes, bad frames by code
    chunk planner   decisions by plan and source (eq3 / eq6 / default:<reason>)
    state monitor   telemetry records ingested by kind; request records by endpoint and their cost in $ (DiSCo)
    telemetry       (each sender: verifier, device agent) records sent to the monitor and dropped, by reason

Each instance has its own CollectorRegistry (not the process-global default), so
several services in one process (tests, the in-process launcher) never collide.
Counting never raises into the caller: a metric is bookkeeping, never a reason
for a request to fail; a gauge read at scrape time that fails reads NaN.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger(__name__)

PREFIX = "tophat:"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # "text/plain; version=0.0.4; charset=utf-8"
METRICS_PATH = "/metrics"

# Seconds: from a few ms (loopback, a tiny model) to minutes (a long generation on a slow link).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TOKEN_BUCKETS = tuple(float(2**k) for k in range(13))  # 1 .. 4096 batched tokens


def never_raises(method: Callable) -> Callable:
    """Counting is bookkeeping: a failure is logged and swallowed, never raised into a request path."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception:  # noqa: BLE001 - see the docstring
            log.warning("metrics: %s failed", method.__qualname__, exc_info=True)

    return guarded


def read_at_scrape(gauge: Gauge, read: Callable[[], float]) -> None:
    """`gauge` reads `read()` at every scrape; NaN when it fails (a scrape never fails for one gauge)."""

    def value() -> float:
        try:
            return float(read())
        except Exception:  # noqa: BLE001 - a scrape answers; the broken gauge says NaN
            log.warning("metrics: reading a gauge failed", exc_info=True)
            return math.nan

    gauge.set_function(value)


def exposition(registry: CollectorRegistry | None) -> bytes:
    """The text exposition (format 0.0.4) of `registry`; empty when there is none yet (a service still starting)."""
    return generate_latest(registry) if registry is not None else b""


def metrics_response(registry: CollectorRegistry | None):
    """A FastAPI/Starlette response for GET /metrics."""
    from starlette.responses import Response

    return Response(exposition(registry), media_type=CONTENT_TYPE)


def _name(name: str) -> str:
    return PREFIX + name


class SpecDecodeMetrics:
    """vLLM's speculative-decoding counters, counted per verification round of a device session."""

    def __init__(self, registry: CollectorRegistry, max_draft: int = 0):
        self.drafts = Counter(
            _name("spec_decode_num_drafts"),
            "Verification rounds that carried at least one draft token",
            registry=registry,
        )
        self.draft_tokens = Counter(
            _name("spec_decode_num_draft_tokens"), "Draft tokens sent for verification", registry=registry
        )
        self.accepted_tokens = Counter(
            _name("spec_decode_num_accepted_tokens"), "Draft tokens the target model accepted", registry=registry
        )
        self.accepted_per_pos = Counter(
            _name("spec_decode_num_accepted_tokens_per_pos"),
            "Accepted draft tokens by position in the draft (0 = first draft token)",
            ["position"],
            registry=registry,
        )
        for position in range(max_draft):  # every position a draft can have shows, at 0 until it happens
            self.accepted_per_pos.labels(position=str(position))

    @never_raises
    def rounds(self, verdicts: Iterable[tuple[int, int]]) -> None:
        """Count verification rounds given as (draft tokens, accepted draft tokens)."""
        for drafted, accepted in verdicts:
            if drafted <= 0:
                continue  # a round without a draft (U-shape, or one token left) is no draft
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(position=str(position)).inc()


class DeviceMetrics:
    """A device agent's: its sessions' speculative decoding and the bytes on its link to the verifier."""

    def __init__(self, device_id: str, max_draft: int):
        self.registry = CollectorRegistry()
        self.spec_decode = SpecDecodeMetrics(self.registry, max_draft)
        uplink = Counter(
            _name("device_uplink_bytes"),
            "Bytes of WebSocket messages the device sent to the verifier",
            ["device"],
            registry=self.registry,
        )
        downlink = Counter(
            _name("device_downlink_bytes"),
            "Bytes of WebSocket messages the device received from the verifier",
            ["device"],
            registry=self.registry,
        )
        self._link = {"up": uplink.labels(device=device_id), "down": downlink.labels(device=device_id)}

    @never_raises
    def frame(self, direction: str, nbytes: int) -> None:
        """One frame of `nbytes` went "up" (device -> verifier) or came "down"."""
        self._link[direction].inc(nbytes)


class StreamerMetrics:
    """The token streamer's: its admission queue and each request's latencies as the user sees them."""

    def __init__(self, running: Callable[[], float], waiting: Callable[[], float]):
        self.registry = CollectorRegistry()
        read_at_scrape(
            Gauge(_name("num_requests_running"), "Requests holding a device slot", registry=self.registry), running
        )
        read_at_scrape(
            Gauge(_name("num_requests_waiting"), "Requests queued for a device slot", registry=self.registry), waiting
        )
        self.ttft = Histogram(
            _name("time_to_first_token_seconds"),
            "Request arrival at the streamer to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            _name("inter_token_latency_seconds"),
            "Time between tokens: one sample per token after "
            "the first; a round of k tokens counts as k gaps of 1/k of its wait "
            "(shared/telemetry/latency_stats.py)",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            _name("e2e_request_latency_seconds"),
            "Request arrival at the streamer to its end",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )

    @never_raises
    def request_done(self, ttft_s: float | None, tbt_samples_s: Iterable[float], e2e_s: float) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for gap in tbt_samples_s:
            self.itl.observe(gap)
        self.e2e.observe(e2e_s)


class VerifierMetrics:
    """The verifier's: what each step ran, the sessions and KV it holds, the bad frames it answered."""

    def __init__(self, sessions: Callable[[], float], kv_bytes: Callable[[], float] | None):
        """`kv_bytes` None: the KV is not in this process (pipeline stages), so no gauge claims to know it."""
        self.registry = CollectorRegistry()
        self.batched_tokens = Histogram(
            _name("verifier_batched_tokens"),
            "Tokens in one verifier step (mu-hat)",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            _name("verifier_step_seconds"),
            "Compute time of one verifier step (eta-hat)",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        read_at_scrape(
            Gauge(_name("verifier_sessions"), "Live sessions on the verifier", registry=self.registry), sessions
        )
        if kv_bytes is not None:
            read_at_scrape(
                Gauge(
                    _name("verifier_kv_cache_bytes"),
                    "Bytes allocated to the KV caches of live sessions",
                    registry=self.registry,
                ),
                kv_bytes,
            )
        self.bad_frames = Counter(
            _name("verifier_bad_frames"),
            "Frames answered with an error, by error code",
            ["code"],
            registry=self.registry,
        )

    @never_raises
    def step(self, batched_tokens: int, compute_s: float) -> None:
        self.batched_tokens.observe(batched_tokens)
        self.step_seconds.observe(compute_s)

    @never_raises
    def bad_frame(self, code: str) -> None:
        self.bad_frames.labels(code=code).inc()


class TelemetryMetrics:
    """A telemetry sender's (shared/telemetry/client.py): records sent to the state monitor and those dropped, by
    why. A drop is the planner's model going stale under exactly the load it models: counted, never silent."""

    DROP_REASONS = ("backlog", "unreachable", "rejected")

    def __init__(self, registry: CollectorRegistry):
        self.sent = Counter(
            _name("telemetry_records_sent"), "Telemetry records the state monitor accepted", registry=registry
        )
        self.dropped = Counter(
            _name("telemetry_records_dropped"),
            "Telemetry records dropped: backlog (too many POSTs in flight), unreachable (the monitor did not "
            "answer), rejected (it answered with an error)",
            ["reason"],
            registry=registry,
        )
        for reason in self.DROP_REASONS:  # every reason shows, at 0 until it happens
            self.dropped.labels(reason=reason)

    @never_raises
    def record_sent(self, count: int) -> None:
        self.sent.inc(count)

    @never_raises
    def record_dropped(self, reason: str, count: int) -> None:
        self.dropped.labels(reason=reason).inc(count)


class PlannerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            _name("planner_decisions"),
            "Plans answered, by plan (chunk_size, parallel_draft_steps) and source (eq3, eq6, default:<reason>)",
            ["plan", "source"],
            registry=self.registry,
        )

    @never_raises
    def decision(self, plan: str, source: str) -> None:
        self.decisions.labels(plan=plan, source=source).inc()


class MonitorMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.records = Counter(
            _name("telemetry_records"), "Telemetry records ingested, by kind", ["kind"], registry=self.registry
        )
        self.requests = Counter(
            _name("requests"),
            "Finished requests reported, by the endpoint that delivered "
            "the first token (device, cloud, hat; unknown when the sender did not say)",
            ["endpoint"],
            registry=self.registry,
        )
        self.request_cost = Counter(
            _name("request_cost_dollars"),
            "Cost of finished requests in $ (DiSCo's unified cost), by the endpoint that delivered the first token",
            ["endpoint"],
            registry=self.registry,
        )

    @never_raises
    def record(self, kind: str) -> None:
        self.records.labels(kind=kind).inc()

    @never_raises
    def request(self, endpoint: str | None, cost: float | None) -> None:
        label = endpoint or "unknown"
        self.requests.labels(endpoint=label).inc()
        if cost is not None:
            self.request_cost.labels(endpoint=label).inc(cost)
