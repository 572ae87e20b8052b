"""State-monitor HTTP API: ingest telemetry, serve mu, g(mu) and device state.

The in-memory model (shared.state_model) is the source of truth for answers;
Redis gets the raw events and the derived state so other processes and
dashboards can read them, and so a restarted monitor can resume its averages.
Redis is best effort: when it is down, records still update the in-memory
model, /readyz stays ready (reporting redis connected=false) and nothing fails.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.state_monitor.settings import Settings, load_settings
from shared import auth
from shared import telemetry as tk
from shared.device_registry import DeviceRegistry
from shared.metrics import MonitorMetrics, metrics_response
from shared.redis_server import resolve_redis_url, with_password
from shared.state_model import CloudState, ComputeDelayPredictor, DeviceState

log = logging.getLogger(__name__)

Ident = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PREDICT_SAMPLES = [2**k for k in range(13)]  # 1 .. 4096 batched tokens


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ts: float | None = Field(default=None, description="sender's wall-clock time (unix s)")


class VerifierStep(_Record):
    kind: Literal["verifier_step"]
    batched_tokens: int = Field(ge=0, description="mu_hat: tokens in the batch")
    compute_s: Seconds = Field(description="eta_hat: batch compute time")
    num_sessions: int = Field(default=0, ge=0)
    step_kinds: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    overhead_s: Seconds | None = Field(default=None, description="step wall time beyond compute_s")
    pipeline_stages: int | None = Field(default=None, ge=1, le=1024, description="P: the verifier's stages")


class DeviceDraft(_Record):
    kind: Literal["device_draft"]
    device_id: Ident
    step_s: PositiveSeconds = Field(description="gamma: seconds per draft step")
    steps: int = Field(default=1, ge=1, description="draft steps this measurement averaged over")
    round_overhead_s: Seconds | None = Field(default=None, description="mean device time per round outside "
                                             "drafting and the cloud wait (output head, accept, thread hops)")
    round_overhead_median_s: Seconds | None = Field(default=None, description="median of the same per-round times")
    rounds: int = Field(default=0, ge=0, description="rounds round_overhead_s averaged over")
    prefill_token_s: PositiveSeconds | None = Field(default=None, description="prompt cost per token "
                                                    "(input layers + upload call), per chunk averaged")
    prefill_tokens: int = Field(default=0, ge=0, description="prompt tokens prefill_token_s averaged over")
    pd_hit_rate: float | None = Field(default=None, ge=0, le=1, description="parallel drafting: share of "
                                      "corrected last draft tokens that were a pre-drafted candidate")
    pd_chances: int = Field(default=0, ge=0, description="rounds pd_hit_rate is over")
    full_accept_rate: float | None = Field(default=None, ge=0, le=1, description="share of verification rounds "
                                           "that accepted every drafted token")


class DeviceTransfer(_Record):
    kind: Literal["device_transfer"]
    device_id: Ident
    direction: Literal["up", "down"]
    bytes: int = Field(ge=0)
    seconds: PositiveSeconds


class DeviceRtt(_Record):
    kind: Literal["device_rtt"]
    device_id: Ident
    rtt_s: PositiveSeconds = Field(description="round trip of a one-row probe (latency both ways + framing)")


class RequestDone(_Record):
    kind: Literal["request"]
    request_id: Ident
    device_id: Ident | None = None
    ttft_s: Seconds | None = None
    token_times_s: list[Seconds] = Field(default_factory=list, max_length=100_000,
                                         description="gaps between consecutive delivered tokens (TBT)")
    accept_lengths: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=100_000,
                                                              description="accepted draft tokens per verification")
    prompt_tokens: int | None = Field(default=None, ge=0)
    generated_tokens: int | None = Field(default=None, ge=0)
    endpoint: Literal["device", "cloud", "hat"] | None = Field(default=None, description="DiSCo: the endpoint "
                                                               "that delivered the first token")
    server_ttft_s: Seconds | None = Field(default=None, description="the server endpoint's own TTFT, also when "
                                          "it lost the race; None when it was cancelled before its first token")
    cost: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(default=None, description="$ for the "
                                                                             "request (DiSCo's unified cost)")
    dispatch: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")] | None = None


class DeviceAnnouncement(BaseModel):
    """A device agent saying where it serves (shared/device_registry.py); repeated every few seconds."""
    model_config = ConfigDict(extra="forbid")
    device_id: Ident
    url: Annotated[str, Field(min_length=8, max_length=512, pattern=r"^https?://[^\s/]+$")]
    max_sessions: int | None = Field(default=None, ge=1)


Record = Annotated[VerifierStep | DeviceDraft | DeviceTransfer | DeviceRtt | RequestDone, Field(discriminator="kind")]

# Edge SD (paper 001): measured passes for T(b, F) = c1*F*b + c2 (eq. 17) and verdicts for alpha, per list.
EDGE_SD_KEYS = {name: f"{tk.PREFIX}:edge_sd:{name}" for name in ("draft", "verify", "verdicts")}
EdgePass = tuple[Annotated[int, Field(ge=1, strict=True)], Annotated[float, Field(ge=0, allow_inf_nan=False)], Seconds]
Verdict = tuple[Annotated[int, Field(ge=0, strict=True)], Annotated[int, Field(ge=0, strict=True)]]


class EdgeSdTelemetry(BaseModel):
    """An edge draft server's (SBS) measurements: passes as [batch_size, flops_per_task, seconds] of its draft
    model and of the verifier's target model, verdicts as [drafts, accepted]."""
    model_config = ConfigDict(extra="forbid")
    node: Ident
    draft: list[EdgePass] = Field(default_factory=list, max_length=10_000)
    verify: list[EdgePass] = Field(default_factory=list, max_length=10_000)
    verdicts: list[Verdict] = Field(default_factory=list, max_length=10_000)

    @field_validator("verdicts")
    @classmethod
    def _accepted_within_drafts(cls, verdicts: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if any(accepted > drafts for drafts, accepted in verdicts):
            raise ValueError("a verdict's accepted count exceeds its drafts")
        return verdicts


class Monitor:
    """Applies records to the state model and mirrors them to Redis via the sink."""

    def __init__(self, settings: Settings, sink: tk.TelemetrySink | None) -> None:
        self.settings = settings
        self.sink = sink
        self.cloud = self._new_cloud()
        self.devices: dict[str, DeviceState] = {}
        self.started_at = time.time()

    def _new_cloud(self) -> CloudState:
        s = self.settings
        return CloudState(alpha=s.alpha, g=ComputeDelayPredictor(s.alpha, s.buckets_per_octave))

    def device(self, device_id: str) -> DeviceState:
        state = self.devices.get(device_id)
        if state is None:
            state = self.devices[device_id] = DeviceState(device_id, alpha=self.settings.alpha)
        return state

    async def restore(self) -> None:
        """Resume averages from Redis (best effort: bad or missing data is skipped)."""
        if self.sink is None:
            return
        try:
            cloud = await self.sink.read_hash(tk.VERIFIER_STATE)
            if cloud and cloud.get("model"):
                self.cloud = CloudState.from_dict(json.loads(cloud["model"]))
            for device_id in sorted(await self.sink.read_members(tk.DEVICES) or ())[:10_000]:
                data = await self.sink.read_hash(tk.device_state_key(device_id))
                if data and data.get("model"):
                    self.devices[device_id] = DeviceState.from_dict(json.loads(data["model"]))
        except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            log.warning("ignoring unreadable state in redis: %s", exc)
        log.info("restored state: %d cloud buckets, %d devices", self.cloud.g.observed_buckets, len(self.devices))

    async def ingest(self, rec: VerifierStep | DeviceDraft | DeviceTransfer | DeviceRtt | RequestDone) -> bool:
        now = time.time()
        raw = {**rec.model_dump(), "ts": rec.ts if rec.ts is not None else now}
        if isinstance(rec, VerifierStep):
            self.cloud.observe_step(rec.batched_tokens, rec.compute_s, now, overhead_s=rec.overhead_s,
                                    num_sessions=rec.num_sessions, step_kinds=rec.step_kinds,
                                    **({"pipeline_stages": rec.pipeline_stages} if rec.pipeline_stages else {}))
            return await self._write(events=[(tk.VERIFIER_STEPS, raw)], states=[(tk.VERIFIER_STATE, self._cloud_hash(), None)])
        if isinstance(rec, RequestDone):
            summary = {**raw, "mean_tbt_s": _mean(rec.token_times_s), "mean_accept_len": _mean(rec.accept_lengths)}
            cap = self.settings.disco_history
            samples = [(tk.DISCO_PROMPT_TOKENS, rec.prompt_tokens), (tk.DISCO_SERVER_TTFT, rec.server_ttft_s)]
            return await self._write(events=[(tk.REQUESTS, summary)],
                                     states=[(tk.request_key(rec.request_id), summary, self.settings.request_ttl_s)],
                                     lists=[(key, value, cap) for key, value in samples if value is not None])
        dev = self.device(rec.device_id)
        if isinstance(rec, DeviceDraft):
            dev.observe_draft(rec.step_s, now, round_overhead_s=rec.round_overhead_s,
                              round_overhead_median_s=rec.round_overhead_median_s, prefill_token_s=rec.prefill_token_s,
                              pd_hit_rate=rec.pd_hit_rate, full_accept_rate=rec.full_accept_rate)
        elif isinstance(rec, DeviceRtt):
            dev.observe_rtt(rec.rtt_s, now)
        else:
            raw["bytes_per_s"] = dev.observe_transfer(rec.direction, rec.bytes, rec.seconds, now)
        return await self._write(events=[(tk.device_events_key(rec.device_id), raw)],
                                 states=[(tk.device_state_key(rec.device_id), self._device_hash(dev), None)],
                                 members=[(tk.DEVICES, rec.device_id)])

    async def _write(self, **ops: Any) -> bool:
        return await self.sink.write(**ops) if self.sink is not None else False

    def _cloud_hash(self) -> dict[str, Any]:
        c = self.cloud
        line = c.g.fit_line()
        return {"mu": c.mu.value, "eta": c.eta.value, "steps": c.mu.count,
                "last_mu_hat": c.last.get("mu_hat"), "last_eta_hat": c.last.get("eta_hat"),
                "num_sessions": c.last.get("num_sessions"), "step_kinds": c.last.get("step_kinds", {}),
                "step_overhead_s": c.step_overhead.value,
                "g_c1": line[0] if line else None, "g_c2": line[1] if line else None,
                "g": c.g.table(), "updated_at": c.updated_at, "model": c.to_dict()}

    @staticmethod
    def _device_estimates(d: DeviceState) -> dict[str, float | None]:
        """The current value of every per-device average (HAT's gamma and beta, the simulator's rest)."""
        return {"gamma": d.gamma.value, "beta_up": d.beta_up.value, "beta_down": d.beta_down.value,
                "round_overhead_s": d.round_overhead.value, "round_overhead_median_s": d.round_overhead_median.value,
                "prefill_token_s": d.prefill_token.value, "rtt_s": d.rtt.value, "pd_hit_rate": d.pd_hit.value,
                "full_accept_rate": d.full_accept.value}

    def _device_hash(self, d: DeviceState) -> dict[str, Any]:
        return {**self._device_estimates(d),
                "draft_samples": d.gamma.count, "up_samples": d.beta_up.count, "down_samples": d.beta_down.count,
                "last_update": d.last_update, "model": d.to_dict()}

    def cloud_view(self) -> dict[str, Any]:
        c = self.cloud
        line = c.g.fit_line()
        return {"mu": c.mu.value, "eta": c.eta.value, "steps": c.mu.count, "alpha": c.alpha, "last": c.last,
                "step_overhead_s": c.step_overhead.value,
                "g": {"buckets": c.g.table(), "line": {"c1": line[0], "c2": line[1]} if line else None},
                "predict": {str(m): c.g.predict(m) for m in PREDICT_SAMPLES}, "updated_at": c.updated_at}

    def device_view(self, d: DeviceState) -> dict[str, Any]:
        now = time.time()
        return {"device_id": d.device_id, **self._device_estimates(d),
                "samples": {"draft": d.gamma.count, "up": d.beta_up.count, "down": d.beta_down.count},
                "last_update": d.last_update, "age_s": d.age(now),
                "stale": d.is_stale(now, self.settings.device_stale_s)}


def _may_write(request: Request, device_ids: list[str | None]) -> None:
    """403 unless the caller may write for every one of `device_ids` (None: a verifier's or request record),
    before any of the batch is kept: a device writes only for itself, a service for anyone."""
    claims = auth.claims_of(request.scope)
    for device_id in device_ids:
        if not auth.may_act_for(claims, device_id):
            log.info("refused a write for device %s by device %s", device_id, claims.subject if claims else None)
            raise HTTPException(403, "a device credential may write only for its own device id")


def _mean(xs: list[float] | list[int]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _parsed(values: list[str], kind: type[int] | type[float]) -> list[Any]:
    """List values as numbers; one the monitor did not write (garbage in Redis) is skipped, not served."""
    out = []
    for value in values:
        try:
            number = kind(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            out.append(number)
        else:
            log.warning("skipping unreadable %s sample in redis: %r", kind.__name__, value[:32])
    return out


def _parsed_rows(values: list[str], width: int) -> list[list[float | int]]:
    """JSON rows of `width` finite numbers; one the monitor did not write (garbage in Redis) is skipped."""
    out = []
    for value in values:
        try:
            row = json.loads(value)
        except ValueError:
            row = None
        if isinstance(row, list) and len(row) == width and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in row):
            out.append(row)
        else:
            log.warning("skipping unreadable edge-sd sample in redis: %r", value[:64])
    return out


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; Redis URL = settings.redis_url, else env REDIS_URL, else in-memory only."""
    settings = settings or load_settings()
    url = resolve_redis_url(settings.redis_url or None)
    if url and settings.redis_password:
        url = with_password(url, settings.redis_password)
    sink = (tk.TelemetrySink(url, stream_maxlen=settings.stream_maxlen, timeout_s=settings.redis_timeout_s,
                             request_ttl_s=settings.request_ttl_s, initial_backoff_s=settings.redis_backoff_initial_s,
                             max_backoff_s=settings.redis_backoff_max_s) if url else None)
    monitor = Monitor(settings, sink)
    registry = DeviceRegistry(settings.announce_ttl_s)
    metrics = MonitorMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if sink is None:
            log.warning("no redis configured: state monitor keeps telemetry in memory only")
        elif await sink.start():
            await monitor.restore()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            if sink is not None:
                await sink.close()

    app = FastAPI(title="tophat state monitor", lifespan=lifespan)
    # Writes need a credential (shared/auth.py), a device's only for its own device id; reads stay open.
    auth.warn_if_open("the state monitor", settings.auth_secret, settings.host, "TOPHAT_STATE_MONITOR_AUTH_SECRET")
    auth.install(app, settings.auth_secret, auth.ROLES, guarded=lambda method, path: method == "POST")
    app.state.ready = False
    app.state.monitor = monitor

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own 422 echoes each bad input, and a NaN or Infinity there made its JSON encoder raise (a
        500 instead of the 422); the echo is dropped, which also keeps a 100k-sample record from coming back."""
        errors = [{k: v for k, v in err.items() if k != "input"} for err in exc.errors()]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    @app.post("/telemetry")
    async def post_telemetry(body: Record | list[Record], request: Request) -> dict[str, Any]:
        records = body if isinstance(body, list) else [body]
        _may_write(request, [getattr(rec, "device_id", None) for rec in records])
        if len(records) > settings.max_batch:
            raise HTTPException(413, f"at most {settings.max_batch} records per request")
        persisted = 0
        for rec in records:
            persisted += await monitor.ingest(rec)
            metrics.record(rec.kind)
            if isinstance(rec, RequestDone):
                metrics.request(rec.endpoint, rec.cost)
        return {"accepted": len(records), "persisted": persisted}

    @app.post("/devices/announce")
    async def announce(body: DeviceAnnouncement, request: Request) -> dict[str, Any]:
        _may_write(request, [body.device_id])
        known = {a.device_id: a.url for a in registry.live()}
        if known.get(body.device_id) != body.url:
            log.info("device %s announced at %s", body.device_id, body.url)
        registry.announce(body.device_id, body.url, body.max_sessions)
        return {"ttl_s": registry.ttl_s}

    @app.get("/devices")
    async def devices() -> dict[str, Any]:
        """The device agents that announced within the TTL (the streamer routes to these)."""
        return {"ttl_s": registry.ttl_s,
                "devices": [{"device_id": a.device_id, "url": a.url, "max_sessions": a.max_sessions,
                             "age_s": registry.age_s(a)} for a in registry.live()]}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return metrics_response(metrics.registry)

    @app.get("/state/cloud")
    async def state_cloud() -> dict[str, Any]:
        return monitor.cloud_view()

    @app.get("/state/devices")
    async def state_devices() -> dict[str, Any]:
        return {"devices": [monitor.device_view(d) for _, d in sorted(monitor.devices.items())]}

    @app.get("/state/device/{device_id}")
    async def state_device(device_id: str) -> dict[str, Any]:
        dev = monitor.devices.get(device_id)
        if dev is None:
            raise HTTPException(404, f"unknown device {device_id!r}")
        return monitor.device_view(dev)

    @app.get("/predict")
    async def predict(mu: Annotated[float, Query(ge=0, allow_inf_nan=False)]) -> dict[str, Any]:
        return {"mu": mu, "g": monitor.cloud.g.predict(mu), "observed_buckets": monitor.cloud.g.observed_buckets}

    @app.get("/disco/history")
    async def disco_history(limit: int | None = Query(None, ge=1, le=settings.disco_history)) -> dict[str, Any]:
        """DiSCo's samples, newest first, read from Redis (so a restarted monitor serves its predecessor's)."""
        keys = [tk.DISCO_PROMPT_TOKENS, tk.DISCO_SERVER_TTFT]
        lists = await sink.read_lists(keys, limit or settings.disco_history) if sink is not None else None
        if lists is None:
            reason = "not configured" if sink is None else f"unreachable at {tk.redact_url(url)}"
            raise HTTPException(503, f"disco history lives in redis, which is {reason}")
        return {"prompt_tokens": _parsed(lists[0], int), "server_ttft_s": _parsed(lists[1], float), "source": "redis"}

    @app.post("/edge-sd/telemetry")
    async def post_edge_sd(body: EdgeSdTelemetry, request: Request) -> dict[str, Any]:
        """Appends to the capped tophat:edge_sd:* lists (in order: the last sample is the newest kept)."""
        _may_write(request, [body.node])
        cap = settings.edge_sd_history
        rows = {name: getattr(body, name)[-cap:] for name in EDGE_SD_KEYS}  # older ones would be trimmed anyway
        lists = [(EDGE_SD_KEYS[name], list(row), cap) for name, values in rows.items() for row in values]
        metrics.record("edge_sd")
        persisted = await monitor._write(lists=lists)
        return {"accepted": sum(len(getattr(body, name)) for name in EDGE_SD_KEYS), "persisted": persisted}

    @app.get("/state/edge-sd")
    async def state_edge_sd() -> dict[str, Any]:
        """Edge SD's samples, newest first, from Redis (what the chunk planner fits eq. 17 and alpha on)."""
        keys = list(EDGE_SD_KEYS.values())
        lists = await sink.read_lists(keys, settings.edge_sd_history) if sink is not None else None
        if lists is None:
            reason = "not configured" if sink is None else f"unreachable at {tk.redact_url(url)}"
            raise HTTPException(503, f"edge-sd telemetry lives in redis, which is {reason}")
        return {name: _parsed_rows(values, width) for (name, width), values in zip(
            (("draft", 3), ("verify", 3), ("verdicts", 2)), lists)}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Any:
        redis = {"configured": sink is not None, "connected": bool(sink and sink.connected),
                 "url": tk.redact_url(url) if url else None, "dropped": sink.dropped if sink else 0}
        if not request.app.state.ready:
            raise HTTPException(503, {"ready": False, "redis": redis})
        return {"ready": True, "redis": redis}

    return app
