"""State-monitor HTTP API: ingest telemetry, serve mu, g(mu) and device state.

The in-memory model (shared.planning.state_model) is the source of truth for answers;
Redis gets the raw events and the derived state so other processes and
dashboards can read them, and so a restarted monitor can resume its averages.
Redis is best effort: when it is down, records still update the in-memory
model, /readyz stays ready (reporting redis connected=false) and nothing fails.
The records it accepts are in records.py, the state they update in monitor.py, the service object
holding that state with the sink, the registry and the issuer in service.py; this module is the HTTP
surface over them: its routers and create_app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import Field, TypeAdapter, ValidationError

from services.state_monitor.issuer import install_routes
from services.state_monitor.records import (
    EDGE_SD_KEYS,
    RECORDS,
    DeviceAnnouncement,
    EdgeSdTelemetry,
    Record,
    RequestDone,
)
from services.state_monitor.service import MonitorService, service_of
from services.state_monitor.settings import Settings, load_settings
from shared.auth import verify as auth
from shared.device_registry import UrlTaken
from shared.telemetry import sink as tk
from shared.telemetry.metrics import metrics_response

log = logging.getLogger(__name__)

Service = Annotated[MonitorService, Depends(service_of)]

api = APIRouter()  # writes need a credential (create_app installs the check), reads stay open
probes = APIRouter()

BODY_READ_TIMEOUT_S = 10.0  # a sender that takes longer for at most max_body_bytes is gone


def _may_write(request: Request, device_ids: list[str | None]) -> None:
    """403 unless the caller may write for every one of `device_ids` (None: a verifier's or request record),
    before any of the batch is kept: a device writes only for itself, a service for anyone, a bootstrap token
    for no one."""
    claims = auth.claims_of(request.scope)
    for device_id in device_ids:
        if not auth.may_act_for(claims, device_id):
            log.info("refused a write for device %s by device %s", device_id, claims.subject if claims else None)
            raise HTTPException(403, "a device credential may write only for its own device id")


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is over `limit` bytes: never kept whole, never parsed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"a telemetry body is at most {limit} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise HTTPException(413, f"a telemetry body is at most {limit} bytes")
    except TimeoutError:
        raise HTTPException(408, f"the body did not arrive within {BODY_READ_TIMEOUT_S:g} s") from None
    return bytes(body)


def _records(body: bytes, max_batch: int) -> list[Record]:
    """A POST /telemetry body's records: one JSON record or a non-empty list of at most `max_batch`."""
    try:
        payload = json.loads(body)
    except ValueError:
        raise HTTPException(400, "the body is not JSON") from None
    items = payload if isinstance(payload, list) else [payload]
    if not items:
        raise HTTPException(422, "an empty batch: send at least one record")
    if len(items) > max_batch:
        raise HTTPException(413, f"at most {max_batch} records per request")
    try:
        return RECORDS.validate_python(items)
    except ValidationError as exc:  # answered by on_invalid below, as FastAPI's own validation errors are
        raise RequestValidationError(exc.errors()) from None


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
        if (
            isinstance(row, list)
            and len(row) == width
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in row)
        ):
            out.append(row)
        else:
            log.warning("skipping unreadable edge-sd sample in redis: %r", value[:64])
    return out


def _history_limit(service: Service, limit: Annotated[int | None, Query(ge=1)] = None) -> int:
    """GET /disco/history's `limit`, at most the disco_history setting (default: that many). The bound is this
    app's setting, so it is checked here rather than declared on the module's router; a limit over it is the 422
    a declared bound gives."""
    cap = service.settings.disco_history
    if limit is None:
        return cap
    try:
        return TypeAdapter(Annotated[int, Field(le=cap)]).validate_python(limit)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**err, "loc": ("query", "limit")} for err in exc.errors(include_url=False)]
        ) from None


async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own 422 echoes each bad input, and a NaN or Infinity there made its JSON encoder raise (a 500
    instead of the 422); the echo is dropped, which also keeps a 100k-sample record from coming back."""
    errors = [{k: v for k, v in err.items() if k != "input"} for err in exc.errors()]
    return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


@api.post("/telemetry")
async def post_telemetry(request: Request, service: Service) -> dict[str, Any]:
    """One record or a batch of them (a JSON list; the verifier sends its steps so). The body is bounded
    before it is parsed (413), the batch's length too, and a bad record is a 422 naming it."""
    settings = service.settings
    records = _records(await _bounded_body(request, settings.max_body_bytes), settings.max_batch)
    _may_write(request, [getattr(rec, "device_id", None) for rec in records])
    persisted = 0
    for rec in records:
        persisted += await service.monitor.ingest(rec)
        service.metrics.record(rec.kind)
        if isinstance(rec, RequestDone):
            service.metrics.request(rec.endpoint, rec.cost)
    return {"accepted": len(records), "persisted": persisted}


@api.post("/devices/announce")
async def announce(body: DeviceAnnouncement, request: Request, service: Service) -> dict[str, Any]:
    _may_write(request, [body.device_id])
    registry = service.registry
    known = {a.device_id: a.url for a in registry.live()}
    if known.get(body.device_id) != body.url:
        log.info("device %s announced at %s", body.device_id, body.url)
    try:
        registry.announce(body.device_id, body.url, body.max_sessions)
    except UrlTaken as exc:
        log.info("refused device %s's announcement: %s", body.device_id, exc)
        raise HTTPException(409, str(exc)) from exc
    return {"ttl_s": registry.ttl_s}


@api.get("/devices")
async def devices(service: Service) -> dict[str, Any]:
    """The device agents that announced within the TTL (the streamer routes to these)."""
    registry = service.registry
    return {
        "ttl_s": registry.ttl_s,
        "devices": [
            {"device_id": a.device_id, "url": a.url, "max_sessions": a.max_sessions, "age_s": registry.age_s(a)}
            for a in registry.live()
        ],
    }


@api.get("/state/cloud")
async def state_cloud(service: Service) -> dict[str, Any]:
    return service.monitor.cloud_view()


@api.get("/state/devices")
async def state_devices(service: Service) -> dict[str, Any]:
    monitor = service.monitor
    return {"devices": [monitor.device_view(d) for _, d in sorted(monitor.devices.items())]}


@api.get("/state/device/{device_id}")
async def state_device(device_id: str, service: Service) -> dict[str, Any]:
    dev = service.monitor.devices.get(device_id)
    if dev is None:
        raise HTTPException(404, f"unknown device {device_id!r}")
    return service.monitor.device_view(dev)


@api.get("/predict")
async def predict(mu: Annotated[float, Query(ge=0, allow_inf_nan=False)], service: Service) -> dict[str, Any]:
    g = service.monitor.cloud.g
    return {"mu": mu, "g": g.predict(mu), "observed_buckets": g.observed_buckets}


@api.get("/disco/history")
async def disco_history(service: Service, limit: Annotated[int, Depends(_history_limit)]) -> dict[str, Any]:
    """DiSCo's samples, newest first, read from Redis (so a restarted monitor serves its predecessor's)."""
    keys = [tk.DISCO_PROMPT_TOKENS, tk.DISCO_SERVER_TTFT]
    lists = await service.redis_lists(keys, limit, "disco history")
    return {"prompt_tokens": _parsed(lists[0], int), "server_ttft_s": _parsed(lists[1], float), "source": "redis"}


@api.post("/edge-sd/telemetry")
async def post_edge_sd(body: EdgeSdTelemetry, request: Request, service: Service) -> dict[str, Any]:
    """Appends to the capped tophat:edge_sd:* lists (in order: the last sample is the newest kept)."""
    _may_write(request, [body.node])
    cap = service.settings.edge_sd_history
    rows = {name: getattr(body, name)[-cap:] for name in EDGE_SD_KEYS}  # older ones would be trimmed anyway
    lists = [(EDGE_SD_KEYS[name], list(row), cap) for name, values in rows.items() for row in values]
    service.metrics.record("edge_sd")
    persisted = await service.monitor._write(lists=lists)
    return {"accepted": sum(len(getattr(body, name)) for name in EDGE_SD_KEYS), "persisted": persisted}


@api.get("/state/edge-sd")
async def state_edge_sd(service: Service) -> dict[str, Any]:
    """Edge SD's samples, newest first, from Redis (what the chunk planner fits eq. 17 and alpha on)."""
    keys = list(EDGE_SD_KEYS.values())
    lists = await service.redis_lists(keys, service.settings.edge_sd_history, "edge-sd telemetry")
    return {
        name: _parsed_rows(values, width)
        for (name, width), values in zip((("draft", 3), ("verify", 3), ("verdicts", 2)), lists)
    }


@probes.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/readyz")
async def readyz(service: Service) -> Any:
    redis = service.redis_status()
    if not service.ready:
        raise HTTPException(503, {"ready": False, "redis": redis})
    return {"ready": True, "redis": redis}


@probes.get("/metrics")
async def metrics_endpoint(service: Service) -> Response:
    return metrics_response(service.metrics.registry)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; Redis URL = settings.redis_url, else env REDIS_URL, else in-memory only."""
    service = MonitorService(settings or load_settings())
    settings = service.settings
    app = FastAPI(title="tophat state monitor", lifespan=service.lifespan)
    app.state.service = service
    # Writes need a credential (shared/auth/verify.py), a device's only for its own device id; reads stay open. The
    # monitor is the issuer (issuer.py): it checks tokens with its own keys and revocations, at once.
    auth.warn_if_open("the state monitor", settings.authenticated, settings.host, "TOPHAT_STATE_MONITOR_AUTH_KEY_FILE")
    if service.issuer is not None:
        auth.install(
            app, service.issuer.verifier, auth.ISSUER, auth.ROLES, guarded=lambda method, path: method == "POST"
        )
        install_routes(app, service.issuer)
    app.exception_handler(RequestValidationError)(on_invalid)
    app.include_router(api)
    app.include_router(probes)
    _document_history_cap(app, settings.disco_history)
    return app


def _document_history_cap(app: FastAPI, cap: int) -> None:
    """/disco/history's `limit` is bounded by this app's setting (`_history_limit`), which the module's router cannot
    declare: the OpenAPI schema gets its `maximum` here, so a client generated from it knows the bound."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for param in schema.get("paths", {}).get("/disco/history", {}).get("get", {}).get("parameters", []):
            if param.get("name") == "limit":
                for option in param.get("schema", {}).get("anyOf", [param.get("schema", {})]):
                    if option.get("type") == "integer":
                        option["maximum"] = cap
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
