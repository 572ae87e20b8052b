"""The services' side of telemetry: records POSTed to the state monitor, fire and forget
(shared/telemetry/sink.py is the monitor's side: the Redis keys and the sink that writes them)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from shared.telemetry.metrics import TelemetryMetrics
from shared.telemetry.outage import Outage

log = logging.getLogger("shared.telemetry.sink")


class TelemetryClient:
    """Fire-and-forget POSTs of telemetry records to the state monitor.

    `emit()` (call it from inside the event loop) never blocks and never raises
    for network trouble: it schedules a send on an owned task set, bounded by
    `max_in_flight`; beyond that the records are dropped. Failures are dropped
    with one warning per outage. Every drop is counted by reason in `metrics`
    (shared/telemetry/metrics.py TelemetryMetrics; `count_into` puts them on a service's /metrics).
    `emit_batched()` keeps records for one POST, sent `batch_interval_s` after the
    first of them or at once when `batch_max` are waiting: a sender with a record per
    step (the verifier) takes one slot per batch, not one per step. With
    `base_url=None` it is a no-op, so services can run without a monitor.
    """

    def __init__(
        self,
        base_url: str | None,
        *,
        timeout_s: float = 0.5,
        max_in_flight: int = 64,
        batch_interval_s: float = 0.25,
        batch_max: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
        auth: httpx.Auth | None = None,
    ) -> None:
        if max_in_flight < 1 or batch_max < 1 or not batch_interval_s > 0:
            raise ValueError("max_in_flight and batch_max must be >= 1, batch_interval_s > 0")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.max_in_flight = max_in_flight
        self.batch_interval_s = batch_interval_s
        self.batch_max = batch_max  # keep it within the monitor's max_batch (services/state_monitor/settings.py)
        # verify: the context trusting the mesh's CA for an https:// monitor (shared/auth/tls.py client_context)
        # auth: this sender's token for a monitor that requires one (shared/auth/client.py BrokerAuth)
        self._client = (
            httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport, verify=verify, auth=auth)
            if self.base_url
            else None
        )
        self.metrics = TelemetryMetrics(CollectorRegistry())
        self._tasks: set[asyncio.Task[bool]] = set()
        self._batch: list[dict[str, Any]] = []
        self._batch_timer: asyncio.TimerHandle | None = None
        self._backlog = Outage(f"state monitor at {base_url} (over {max_in_flight} POSTs in flight)")
        self._outage = Outage(f"state monitor at {base_url}")
        self._rejected = Outage(f"state monitor at {base_url} (rejecting records)")

    def count_into(self, registry: CollectorRegistry) -> None:
        """Count sent and dropped records in `registry` (the service's, served on /metrics) from now on."""
        self.metrics = TelemetryMetrics(registry)

    @property
    def dropped(self) -> int:
        """Records dropped so far, for every reason."""
        return self._backlog.dropped + self._outage.dropped + self._rejected.dropped

    def emit(self, record: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        if self._client is None:
            return
        if len(self._tasks) >= self.max_in_flight:
            count = 1 if isinstance(record, Mapping) else len(record)
            self._backlog.failed(OverflowError("records come faster than it answers"), dropped=count)
            self.metrics.record_dropped("backlog", count)
            return
        self._backlog.recovered()
        task = asyncio.get_running_loop().create_task(self.send(record), name="telemetry-post")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def emit_batched(self, record: Mapping[str, Any]) -> None:
        """Keep `record` for the next batch POST (sent when full or `batch_interval_s` after its first record)."""
        if self._client is None:
            return
        self._batch.append(dict(record))
        if len(self._batch) >= self.batch_max:
            self.flush_batch()
        elif self._batch_timer is None:
            self._batch_timer = asyncio.get_running_loop().call_later(self.batch_interval_s, self.flush_batch)

    def flush_batch(self) -> None:
        """Send the records `emit_batched` kept, now (one POST)."""
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        batch, self._batch = self._batch, []
        if batch:
            self.emit(batch)

    async def send(self, record: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> bool:
        """POST now and report success; drops (False) instead of raising."""
        if self._client is None:
            return False
        body = dict(record) if isinstance(record, Mapping) else [dict(r) for r in record]
        count = 1 if isinstance(body, dict) else len(body)
        try:
            resp = await self._client.post("/telemetry", json=body)
            resp.raise_for_status()
        except httpx.HTTPStatusError as exc:  # e.g. 422: a bug in the sender, logged once too
            error = RuntimeError(f"HTTP {exc.response.status_code}: {exc.response.text[:200]}")
            self._rejected.failed(error, dropped=count)
            self.metrics.record_dropped("rejected", count)
            return False
        except httpx.HTTPError as exc:
            self._outage.failed(exc, dropped=count)
            self.metrics.record_dropped("unreachable", count)
            return False
        self._outage.recovered()
        self._rejected.recovered()
        self.metrics.record_sent(count)
        return True

    def emit_verifier_step(
        self,
        batched_tokens: int,
        compute_s: float,
        num_sessions: int,
        step_kinds: Mapping[str, int] | None = None,
        overhead_s: float | None = None,
        pipeline_stages: int | None = None,
        runs_on: str | None = None,
    ) -> None:
        record = {
            "kind": "verifier_step",
            "batched_tokens": batched_tokens,
            "compute_s": compute_s,
            "num_sessions": num_sessions,
            "step_kinds": dict(step_kinds or {}),
            "ts": time.time(),
        }
        if overhead_s is not None:
            record["overhead_s"] = overhead_s
        if pipeline_stages is not None:  # P for the chunk planner's eq. 3 / eq. 6
            record["pipeline_stages"] = pipeline_stages
        if runs_on is not None:  # the torch device it computes on (the web console's verifier row)
            record["runs_on"] = runs_on
        self.emit_batched(record)  # one per step: batched, or a busy verifier's steps outrun max_in_flight

    def emit_verifier_calibration(self, rows: int, compute_s: float) -> None:
        """A pass timed at the verifier's start: a point of g(mu) before any step is served."""
        self.emit_batched({"kind": "verifier_calibration", "batched_tokens": rows, "compute_s": compute_s})

    def emit_device_draft(
        self,
        device_id: str,
        step_s: float,
        steps: int = 1,
        *,
        round_overhead_s: float | None = None,
        round_overhead_median_s: float | None = None,
        rounds: int = 0,
        prefill_token_s: float | None = None,
        prefill_tokens: int = 0,
        pd_hit_rate: float | None = None,
        pd_chances: int = 0,
        full_accept_rate: float | None = None,
    ) -> None:
        record = {"kind": "device_draft", "device_id": device_id, "step_s": step_s, "steps": steps, "ts": time.time()}
        if round_overhead_s is not None and rounds > 0:
            record.update(round_overhead_s=round_overhead_s, rounds=rounds)
            if round_overhead_median_s is not None:
                record["round_overhead_median_s"] = round_overhead_median_s
        if prefill_token_s is not None and prefill_tokens > 0:
            record.update(prefill_token_s=prefill_token_s, prefill_tokens=prefill_tokens)
        if pd_hit_rate is not None and pd_chances > 0:
            record.update(pd_hit_rate=pd_hit_rate, pd_chances=pd_chances)
        if full_accept_rate is not None:
            record["full_accept_rate"] = full_accept_rate
        self.emit(record)

    def emit_device_rtt(self, device_id: str, rtt_s: float) -> None:
        self.emit({"kind": "device_rtt", "device_id": device_id, "rtt_s": rtt_s, "ts": time.time()})

    def emit_device_transfer(self, device_id: str, direction: str, nbytes: int, seconds: float) -> None:
        self.emit(
            {
                "kind": "device_transfer",
                "device_id": device_id,
                "direction": direction,
                "bytes": nbytes,
                "seconds": seconds,
                "ts": time.time(),
            }
        )

    def emit_request(
        self,
        request_id: str,
        *,
        device_id: str | None = None,
        ttft_s: float | None = None,
        token_times_s: Sequence[float] = (),
        accept_lengths: Sequence[int] = (),
        prompt_tokens: int | None = None,
        endpoint: str | None = None,
        server_ttft_s: float | None = None,
        cost: float | None = None,
        dispatch: str | None = None,
    ) -> None:
        """endpoint: which of "device", "cloud", "hat" delivered the first token; server_ttft_s: the server
        endpoint's own TTFT (the time its first token arrived even when it lost the race; None when it was
        cancelled first); cost: $ for the request; dispatch: the policy's decision. Left out when None, so a
        monitor that predates them still accepts the record."""
        record = {
            "kind": "request",
            "request_id": request_id,
            "device_id": device_id,
            "ttft_s": ttft_s,
            "token_times_s": list(token_times_s),
            "accept_lengths": list(accept_lengths),
            "prompt_tokens": prompt_tokens,
            "ts": time.time(),
        }
        disco = {"endpoint": endpoint, "server_ttft_s": server_ttft_s, "cost": cost, "dispatch": dispatch}
        record.update({k: v for k, v in disco.items() if v is not None})
        self.emit(record)

    async def aclose(self, drain_timeout_s: float = 1.0) -> None:
        """Send the kept batch, give in-flight sends `drain_timeout_s`, cancel the rest, close the client."""
        self.flush_batch()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
