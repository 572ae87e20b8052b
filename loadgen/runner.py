"""Open-loop load: send each request at its arrival time and record what streams back.

Open loop (arrivals do not wait for earlier answers) is what exposes queueing:
a closed loop would slow its own arrivals down exactly when the server is
overloaded. Every request is an owned task in one TaskGroup that sleeps until its
arrival, optionally waits for a concurrency slot (that wait counts in TTFT), then
POSTs a streamed `/v1/completions` with `stream_options.include_usage` and
timestamps every content chunk as it is parsed (tophatctl/sse.py, the one SSE
client, shared with the chat client). A request that fails in any way
(HTTP status, error chunk, no `[DONE]`, network error, per-request timeout) is
recorded with its error and counted, never dropped.

The token count of each chunk is not on the wire (chunks carry text); after the
run `reconcile_tokens` splits the server's `usage.completion_tokens` over the
chunks by their re-tokenized length (exact counts are used instead when the
`tophat` stats' per-delivery `rounds` list matches the chunks one to one) -- see
metrics.py for how TBT uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from loadgen.metrics import RequestRecord, reconcile_tokens, request_row
from loadgen.workloads import WorkloadRequest
from tophatctl.sse import StreamError, StreamStats, auth_headers, stream_chunks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    url: str  # the streamer's base URL (with or without /v1)
    model: str | None = None
    temperature: float = 0.0  # greedy, as vllm bench serve does by default
    request_timeout_s: float = 300.0  # send -> end of stream, per request
    connect_timeout_s: float = 10.0
    max_concurrency: int | None = None  # None: pure open loop
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    send_device_hint: bool = False  # add "device_hint" to the body (the streamer ignores it today)
    progress: bool = True
    api_key: str | None = field(default=None, repr=False)  # sent as Authorization: Bearer; never printed


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_wall: float  # time.time() at t = 0 of the run
    ended_wall: float


def completions_url(url: str) -> str:
    base = url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


def base_url(url: str) -> str:
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def request_body(req: WorkloadRequest, cfg: RunConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.model:
        body["model"] = cfg.model
    if cfg.send_device_hint:
        body["device_hint"] = req.device_hint
    return {**body, **cfg.extra_body}


def make_client(cfg: RunConfig) -> httpx.AsyncClient:
    """One pooled client; no connection cap unless asked, so the pool never queues silently."""
    timeout = httpx.Timeout(
        connect=cfg.connect_timeout_s,
        read=cfg.request_timeout_s,
        write=cfg.connect_timeout_s,
        pool=cfg.request_timeout_s,
    )
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency or 256)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, headers=auth_headers(cfg.api_key))


async def run_load(
    requests: Sequence[WorkloadRequest],
    arrivals: Sequence[float],
    cfg: RunConfig,
    *,
    count_tokens: Callable[[str], int] | None = None,
) -> RunResult:
    """Send `requests[i]` at `arrivals[i]` seconds after the start; return one record per request."""
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    url = completions_url(cfg.url)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records = [
        RequestRecord(
            index=r.index,
            arrival_s=float(a),
            max_tokens=r.max_tokens,
            prompt_tokens=r.prompt_tokens,
            device_hint=r.device_hint,
        )
        for r, a in zip(requests, arrivals)
    ]
    bar = tqdm(total=len(records), unit="req", desc="loadgen", disable=not cfg.progress, dynamic_ncols=True)
    failed = 0

    async def one(req: WorkloadRequest, rec: RequestRecord, t0: float) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, t0 + rec.arrival_s - time.perf_counter()))
        async with sem if sem is not None else contextlib.nullcontext():
            rec.send_s = time.perf_counter() - t0
            await send_request(client, url, request_body(req, cfg), rec, t0, cfg.request_timeout_s)
        if not rec.ok:
            failed += 1
            log.debug("request %d failed: %s", rec.index, rec.error)
            bar.set_postfix(failed=failed, refresh=False)
        bar.update(1)

    async with make_client(cfg) as client:
        started_wall, t0 = time.time(), time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                for req, rec in zip(requests, records):
                    tg.create_task(one(req, rec, t0), name=f"loadgen-{rec.index}")
        finally:
            bar.close()
        ended_wall = time.time()
    for rec in records:
        reconcile_tokens(rec, count_tokens)
    if failed:
        log.warning("%d of %d requests failed", failed, len(records))
    return RunResult(records, started_wall, ended_wall)


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord, t0: float, timeout_s: float
) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, url, body, rec, t0, timeout_s)
    except TimeoutError:  # the whole request's deadline, or one wait inside it (StreamTimeout)
        rec.error = f"timeout after {timeout_s:g} s"
    except StreamError as exc:
        rec.error = str(exc)
    finally:
        rec.end_s = time.perf_counter() - t0


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord, t0: float, timeout_s: float
) -> None:
    stats = StreamStats()
    try:
        async with contextlib.aclosing(stream_chunks(client, url, body, timeout_s=timeout_s)) as chunks:
            async for chunk in chunks:
                stats.observe(chunk)
                if chunk.text:
                    rec.chunk_times_s.append(chunk.t - t0)
                    rec.chunk_texts.append(chunk.text)
    finally:  # what the server said before a failure is kept too
        _apply_stats(rec, stats)


def _apply_stats(rec: RequestRecord, stats: StreamStats) -> None:
    rec.finish_reason = stats.finish_reason or rec.finish_reason
    rec.accept_length, rec.num_rounds, rec.device_id = stats.accept_length, stats.num_rounds, stats.device_id
    rec.server_ttft_s, rec.server_tbt_s = stats.server_ttft_s, stats.server_tbt_s
    rec.tophat = stats.raw_tophat
    rec.completion_tokens = stats.completion_tokens if stats.completion_tokens is not None else rec.completion_tokens
    rec.prompt_tokens = stats.prompt_tokens or rec.prompt_tokens  # else the workload's own count
    rec.server_rounds = stats.rounds
    wait = (stats.raw_tophat or {}).get("queue_wait_s")  # the streamer's wait for a device slot
    rec.server_queue_wait_s = float(wait) if isinstance(wait, int | float) and not isinstance(wait, bool) else None


async def probe_server(url: str, timeout_s: float = 5.0, api_key: str | None = None) -> dict[str, Any]:
    """Whether the server answers at all, its model id (/v1/models) and ready device count (/readyz).

    Only `reachable` matters for going on; the rest is best effort (another server may lack /readyz).
    """
    info: dict[str, Any] = {"reachable": False, "model": None, "num_devices": None, "error": None}
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=auth_headers(api_key)) as client:
        try:
            models = await client.get(f"{base_url(url)}/v1/models")
            info["reachable"] = True
            info["model"] = (models.json().get("data") or [{}])[0].get("id")
            ready = (await client.get(f"{base_url(url)}/readyz")).json().get("ready_devices")
            info["num_devices"] = ready if isinstance(ready, int) and not isinstance(ready, bool) else None
        except (httpx.HTTPError, ValueError, AttributeError, IndexError) as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
    return info


async def fetch_verifier_steps(
    redis_url: str, started_wall: float, ended_wall: float, timeout_s: float = 5.0
) -> tuple[list[dict[str, float]], str | None]:
    """Verifier steps (`compute_s`, `batched_tokens`, `ts`) logged during the run, or ([], why not).

    Entries are selected by stream id, i.e. by the Redis server's clock.
    """
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from shared.telemetry.sink import VERIFIER_STEPS

    client = aioredis.from_url(
        redis_url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    try:
        async with asyncio.timeout(timeout_s * 3):
            entries = await client.xrange(
                VERIFIER_STEPS, min=str(int(started_wall * 1000)), max=str(int(ended_wall * 1000) + 1)
            )
    except (RedisError, OSError, TimeoutError) as exc:
        return [], f"cannot read {VERIFIER_STEPS}: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(RedisError, OSError):
            await client.aclose()
    steps = []
    for _, fields in entries or []:
        if fields is None:  # an entry trimmed between XRANGE's scan and its reply comes back without fields
            continue
        try:
            steps.append(
                {
                    "compute_s": float(fields["compute_s"]),
                    "batched_tokens": float(fields.get("batched_tokens") or 0),
                    "ts": float(fields.get("ts") or 0),
                }
            )
        except (KeyError, ValueError):
            continue
    return steps, None if steps else f"no entries in {VERIFIER_STEPS} during the run"


async def fetch_cloud_state(monitor_url: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The state monitor's smoothed cloud state (mu, eta, steps); None if unreachable."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        try:
            view = (await client.get(f"{monitor_url.rstrip('/')}/state/cloud")).raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("state monitor %s: %s", monitor_url, exc)
            return None
    return {k: view.get(k) for k in ("mu", "eta", "steps")} if isinstance(view, dict) else None


def save_outputs(out_dir: Path, results: dict[str, Any], records: Sequence[RequestRecord]) -> None:
    """DIR/results.json and DIR/requests.csv (one row per request, failures included)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    rows = [request_row(r) for r in records]
    with (out_dir / "requests.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["index"])
        writer.writeheader()
        writer.writerows(rows)
