"""The token streamer's routes: the OpenAI-compatible API with the chat WebSocket (`api`), and what operators
and orchestrators poll (`probes`: /healthz, /readyz, /metrics, /stats). Each handler takes the streamer's
state (state.py) from its app; errors are answered as OpenAI error bodies (`install_error_handlers`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.token_streamer import openai_format as of
from services.token_streamer.chat_ws import serve_chat_ws
from services.token_streamer.lifecycle import QUEUE_WAIT_HEADER, OwnedStreamingResponse, client_gone
from services.token_streamer.router import DeviceError
from services.token_streamer.run import Run
from services.token_streamer.starter import BadRequest
from services.token_streamer.state import StreamerState, streamer_of
from shared.telemetry.metrics import metrics_response

log = logging.getLogger(__name__)

Streamer = Annotated[StreamerState, Depends(streamer_of)]

api = APIRouter()
probes = APIRouter()


def error_response(
    status: int, message: str, code: str | None, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(of.error_body(message, of.error_type(status), code, param), status_code=status, headers=headers)


async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = of.validation_error(exc.errors())
    return error_response(400, message, "invalid_request", param)


async def on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
    return error_response(400, exc.message, "invalid_request", exc.param)


async def on_device_error(_: Request, exc: DeviceError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", None)  # a full queue says when to come back
    return error_response(
        exc.status, exc.message, exc.code, headers={"Retry-After": str(retry_after)} if retry_after else None
    )


async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), None)


def install_error_handlers(app: FastAPI) -> None:
    """Every refusal as an OpenAI error body: invalid JSON, a bad request, a device's error, any HTTP error."""
    app.exception_handler(RequestValidationError)(on_invalid)
    app.exception_handler(BadRequest)(on_bad_request)
    app.exception_handler(DeviceError)(on_device_error)
    app.exception_handler(StarletteHTTPException)(on_http_error)


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
        log.warning("request %s failed mid-stream on %s: %s %s", run.request_id, run.device.url, exc.code, exc.message)
        yield of.sse(fmt.error_chunk(exc.status, exc.code, exc.message))
    yield of.DONE


async def serve_request(
    streamer: StreamerState, req: of.SamplingRequest, max_tokens: int | None, chat: bool
) -> Response:
    run, fmt = await streamer.starter.start(req, max_tokens, chat)
    headers = {QUEUE_WAIT_HEADER: f"{run.stream.queue_wait_s * 1e3:.3f}"}
    if req.stream:
        return OwnedStreamingResponse(
            sse_body(run, fmt, req.include_usage),
            run.close,
            send_timeout_s=streamer.settings.send_timeout_s,
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


async def respond(
    request: Request, streamer: StreamerState, req: of.SamplingRequest, max_tokens: int | None, chat: bool
) -> Response:
    """Serve the request unless its client goes away first: then cancel it wherever it is
    (queued, starting, or waiting for a non-streaming answer). A streamed answer's own
    response watches for the disconnect once it is returned."""
    work = asyncio.create_task(serve_request(streamer, req, max_tokens, chat), name="serve-request")
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


@api.post("/v1/completions")
async def completions(request: Request, req: of.CompletionRequest, streamer: Streamer) -> Any:
    return await respond(request, streamer, req, req.requested_tokens, chat=False)


@api.post("/v1/chat/completions")
async def chat_completions(request: Request, req: of.ChatRequest, streamer: Streamer) -> Any:
    return await respond(request, streamer, req, req.requested_tokens, chat=True)


@api.get("/v1/models")
async def models(streamer: Streamer) -> dict[str, Any]:
    return of.models_list(streamer.settings.model_name, streamer.started_at)


@api.get("/v1/models/{model_id}")
async def model(model_id: str, streamer: Streamer) -> Any:
    name = streamer.settings.model_name
    if model_id != name:
        return error_response(404, f"model {model_id!r} does not exist", "model_not_found", "model")
    return of.model_card(name, streamer.started_at)


@api.websocket("/v1/chat/ws")
async def chat_ws(ws: WebSocket, streamer: Streamer) -> None:
    await serve_chat_ws(ws, streamer.starter, streamer.settings)


@probes.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@probes.get("/readyz")
async def readyz(streamer: Streamer) -> JSONResponse:
    """Open to anyone, so it says only whether and how many devices are ready; which ones, where and
    why not is /stats' (behind the API key)."""
    ready_devices = await streamer.dispatcher.ready_devices(streamer.settings.ready_max_age_s)
    return JSONResponse(
        {"ready": ready_devices > 0, "ready_devices": ready_devices}, status_code=200 if ready_devices else 503
    )


@probes.get("/metrics")
async def metrics_endpoint(streamer: Streamer) -> Response:
    return metrics_response(streamer.metrics.registry)


@probes.get("/stats")
async def stats(streamer: Streamer) -> dict[str, Any]:
    """The admission queue (length, outcomes, recent waits) and each device's URL, health, slots and last
    error; no probing. Not a probe path: with API keys configured it needs one (limits.py)."""
    return {"queue": streamer.admission.stats(), "devices": streamer.router.snapshot()}
