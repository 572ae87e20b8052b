"""Token streamer: OpenAI-compatible HTTP/SSE and a WebSocket chat in front of device agents.

The user only ever talks to this service; it queues the request for a device
slot (admission.py: bounded, first come first served, with a deadline), picks a
device agent (router.py; a chat goes as its turns, which the device renders with
the model's own chat template, a completion as raw text), relays the device's
NDJSON token stream as OpenAI chunks, applies stop strings, measures TTFT/TBT as the user sees them (from
request arrival here, so queueing counts; run.py) and reports each finished request to
the state monitor (HAT §3.2) when one is configured. starter.py turns a request into a
started run; chat_ws.py is the WebSocket front over the same starter.
A client that goes away, streaming or not, cancels its request: it leaves the
queue, or its device stream is closed, which stops the generation on the device
and frees its sessions there and in the cloud.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.token_streamer import openai_format as of
from services.token_streamer.admission import Admission
from services.token_streamer.chat_ws import serve_chat_ws
from services.token_streamer.console import Console
from services.token_streamer.console import install as install_console
from services.token_streamer.disco import DiscoController
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.lifecycle import QUEUE_WAIT_HEADER, OwnedStreamingResponse, client_gone
from services.token_streamer.limits import install as install_gate
from services.token_streamer.outline import OutlineFlow
from services.token_streamer.router import DeviceError, Router
from services.token_streamer.run import Run
from services.token_streamer.settings import Settings, load_settings
from services.token_streamer.starter import BadRequest, RequestStarter
from shared.auth import client as auth_client
from shared.auth import verify as auth
from shared.auth.tls import client_context
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import StreamerMetrics, metrics_response

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    s = settings
    router = Router(s.device_url_list, down_s=s.device_down_s)
    # Its service credential buys, from the issuer, a token per device agent it calls (that device's audience
    # only: replayed at another device or the monitor it is refused) and one for the monitor (telemetry).
    broker = auth_client.broker_for(s, verify=client_context(s.tls_ca))
    device_auth = (
        auth_client.BrokerAuth(broker, audiences={s.state_monitor_url: auth.ISSUER}, devices=True) if broker else None
    )
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=s.connect_timeout_s,
            pool=s.connect_timeout_s,
            write=s.connect_timeout_s,
            read=max(s.first_byte_timeout_s, s.line_timeout_s) + 1.0,
        ),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64),
        trust_env=False,
        verify=client_context(s.tls_ca),  # https:// device agents: the mesh's CA
        auth=device_auth,
    )  # device agents answer /generate and /info to a service token for them only
    admission = Admission(router, max_waiting=s.queue_max_waiting, timeout_s=s.queue_timeout_s)
    dispatcher = Dispatcher(
        admission,
        client,
        first_byte_timeout_s=s.first_byte_timeout_s,
        line_timeout_s=s.line_timeout_s,
        probe_timeout_s=s.probe_timeout_s,
    )
    telemetry = TelemetryClient(
        s.state_monitor_url or None,
        timeout_s=s.telemetry_timeout_s,
        verify=client_context(s.tls_ca),
        auth=auth_client.BrokerAuth(broker, auth.ISSUER) if broker else None,
    )
    metrics = StreamerMetrics(running=lambda: admission.running, waiting=lambda: admission.waiting)
    telemetry.count_into(metrics.registry)  # its drops show on /metrics
    disco = DiscoController(s, client)
    outlines = OutlineFlow(
        dispatcher, client, wait_timeout_s=s.first_byte_timeout_s + s.line_timeout_s, probe_timeout_s=s.probe_timeout_s
    )
    console = Console(s, router, client) if s.console else None
    starter = RequestStarter(s, dispatcher, outlines, disco, telemetry, metrics, console.history if console else None)
    started_at = int(time.time())

    async def health_loop() -> None:
        while True:
            try:
                await dispatcher.probe_all()
            except Exception:  # a supervision loop must survive bugs in one probe round
                log.exception("device health probe failed")
            await asyncio.sleep(s.health_interval_s)

    async def discovery_loop() -> None:
        while True:
            try:
                if await dispatcher.discover(s.state_monitor_url):
                    await dispatcher.probe_all()  # learn new devices' ids and capacity before routing to them
            except Exception:  # a supervision loop must survive bugs in one discovery round
                log.exception("device discovery failed")
            await asyncio.sleep(s.discovery_interval_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if s.discovers_devices:
            log.info("discovering device agents from the state monitor at %s", s.state_monitor_url)
        elif not router.devices:
            log.warning(
                "no device agents configured (TOPHAT_STREAMER_DEVICE_URLS, or a state monitor to discover "
                "them from); every request will get 503"
            )
        tasks = [asyncio.create_task(health_loop(), name="device-health")] if s.health_interval_s > 0 else []
        if s.discovers_devices:
            tasks.append(asyncio.create_task(discovery_loop(), name="device-discovery"))
        if s.state_monitor_url:  # DiSCo's history: any request may ask for a dispatch policy
            tasks.append(asyncio.create_task(disco.refresh_loop(), name="disco-history"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await telemetry.aclose()
            await client.aclose()
            if broker is not None:
                await broker.aclose()

    app = FastAPI(title="tophat token streamer", lifespan=lifespan)
    install_gate(app, s)  # API keys, rate per credential, body size: answered before any parsing
    app.state.router = router
    app.state.dispatcher = dispatcher
    app.state.admission = admission

    def error_response(
        status: int, message: str, code: str | None, param: str | None = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        return JSONResponse(
            of.error_body(message, of.error_type(status), code, param), status_code=status, headers=headers
        )

    def device_error_response(exc: DeviceError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after_s", None)  # a full queue says when to come back
        return error_response(
            exc.status, exc.message, exc.code, headers={"Retry-After": str(retry_after)} if retry_after else None
        )

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = of.validation_error(exc.errors())
        return error_response(400, message, "invalid_request", param)

    @app.exception_handler(BadRequest)
    async def on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, exc.message, "invalid_request", exc.param)

    @app.exception_handler(DeviceError)
    async def on_device_error(_: Request, exc: DeviceError) -> JSONResponse:
        return device_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None)

    async def sse_body(run: Run, fmt: of.ChunkFactory, include_usage: bool) -> AsyncIterator[str]:
        try:
            if fmt.chat:
                yield of.sse(fmt.role())
            async for text in run.deltas():
                yield of.sse(fmt.delta(text))
            yield of.sse(fmt.final(run.finish_reason, run.tophat()))
            if include_usage:
                yield of.sse(fmt.usage_chunk(run.usage()))
        except DeviceError as exc:
            log.warning(
                "request %s failed mid-stream on %s: %s %s", run.request_id, run.device.url, exc.code, exc.message
            )
            yield of.sse(fmt.error_chunk(exc.status, exc.code, exc.message))
        yield of.DONE

    async def serve_request(req: of.SamplingRequest, max_tokens: int | None, chat: bool) -> Response:
        run, fmt = await starter.start(req, max_tokens, chat)
        headers = {QUEUE_WAIT_HEADER: f"{run.stream.queue_wait_s * 1e3:.3f}"}
        if req.stream:
            return OwnedStreamingResponse(
                sse_body(run, fmt, req.include_usage),
                run.close,
                send_timeout_s=s.send_timeout_s,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )
        try:
            text = "".join([t async for t in run.deltas()])
        except DeviceError as exc:
            log.warning("request %s failed on %s: %s", run.request_id, run.device.url, exc.message)
            return error_response(exc.status, exc.message, exc.code)
        finally:
            await run.close()
        return JSONResponse(fmt.response(text, run.finish_reason, run.usage(), run.tophat()), headers=headers)

    async def respond(request: Request, req: of.SamplingRequest, max_tokens: int | None, chat: bool) -> Response:
        """Serve the request unless its client goes away first: then cancel it wherever it is
        (queued, starting, or waiting for a non-streaming answer). A streamed answer's own
        response watches for the disconnect once it is returned."""
        work = asyncio.create_task(serve_request(req, max_tokens, chat), name="serve-request")
        gone = asyncio.create_task(client_gone(request.receive), name="watch-disconnect")
        try:
            done, _ = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if work not in done and gone.exception() is not None:  # the watch broke, not the client: serve
                log.debug("disconnect watch failed: %r", gone.exception())
                done, _ = await asyncio.wait([work])
        finally:  # also when this handler is cancelled: neither task outlives it
            gone.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(gone, work, return_exceptions=True)
        if work in done:
            return work.result()
        log.info("client went away; request cancelled")
        return Response(status_code=499)  # nobody reads it: the connection is gone

    @app.post("/v1/completions")
    async def completions(request: Request, req: of.CompletionRequest) -> Any:
        return await respond(request, req, req.requested_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: of.ChatRequest) -> Any:
        return await respond(request, req, req.requested_tokens, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return of.models_list(s.model_name, started_at)

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Any:
        if model_id != s.model_name:
            return error_response(404, f"model {model_id!r} does not exist", "model_not_found", "model")
        return of.model_card(s.model_name, started_at)

    @app.websocket("/v1/chat/ws")
    async def chat_ws(ws: WebSocket) -> None:
        await serve_chat_ws(ws, starter, s)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Open to anyone, so it says only whether and how many devices are ready; which ones, where and
        why not is /stats' (behind the API key)."""
        ready_devices = await dispatcher.ready_devices(s.ready_max_age_s)
        return JSONResponse(
            {"ready": ready_devices > 0, "ready_devices": ready_devices}, status_code=200 if ready_devices else 503
        )

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return metrics_response(metrics.registry)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The admission queue (length, outcomes, recent waits) and each device's URL, health, slots and last
        error; no probing. Not a probe path: with API keys configured it needs one (limits.py)."""
        return {"queue": admission.stats(), "devices": router.snapshot()}

    if console is not None:  # the web console: GET / and its data (console.py)
        install_console(app, console)

    return app
