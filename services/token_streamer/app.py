"""Token streamer: OpenAI-compatible HTTP/SSE and a WebSocket chat in front of device agents.

The user only ever talks to this service; it queues the request for a device
slot (admission.py: bounded, first come first served, with a deadline), picks a
device agent (router.py; a chat goes as its turns, which the device renders with
the model's own chat template, a completion as raw text), relays the device's
NDJSON token stream as OpenAI chunks, applies stop strings, measures TTFT/TBT as the user sees them (from
request arrival here, so queueing counts) and reports each finished request to
the state monitor (HAT §3.2) when one is configured.
A client that goes away, streaming or not, cancels its request: it leaves the
queue, or its device stream is closed, which stops the generation on the device
and frees its sessions there and in the cloud.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.token_streamer import openai_format as of
from services.token_streamer.admission import Admission
from services.token_streamer.device_stream import DeviceStream
from services.token_streamer.disco import DiscoController
from services.token_streamer.disco_stream import DiscoStream
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.lifecycle import QUEUE_WAIT_HEADER, OwnedStreamingResponse, client_gone, unless_gone
from services.token_streamer.limits import install as install_gate
from services.token_streamer.outline import OutlineFlow, OutlineStream
from services.token_streamer.router import DeviceError, Router
from services.token_streamer.settings import Settings, load_settings
from shared import auth, latency_stats
from shared.latency_stats import Timeline
from shared.metrics import StreamerMetrics, metrics_response
from shared.telemetry import TelemetryClient
from shared.tls import client_context

log = logging.getLogger(__name__)


class BadRequest(Exception):
    """Input the streamer itself rejects (400), before any device is involved."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class Run:
    """One request's generation on one device: stop strings, user-side timing, stats, telemetry."""

    def __init__(self, stream: DeviceStream | DiscoStream | OutlineStream, stops: list[str], started: float,
                 request_id: str, telemetry: TelemetryClient, metrics: StreamerMetrics | None = None) -> None:
        self.stream = stream
        self.scanner = of.StopScanner(stops)
        self.started = started
        self.request_id = request_id
        self.telemetry = telemetry
        self.metrics = metrics
        self.finish_reason = "length"
        self.timeline = Timeline(started)  # one delivery per NDJSON 'tokens' line, perf_counter times
        self.device_stats: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}  # more of what happened, for the final stats (e.g. "outline")
        self._closed = False

    async def deltas(self) -> AsyncIterator[str]:
        """Non-empty text deltas for the user; DeviceError if the device fails mid-way."""
        async for event in self.stream.events():
            kind = event.get("type")
            if kind == "tokens":
                ids = event.get("token_ids")
                self._observe(len(ids) if isinstance(ids, list) else 0)
                text = self.scanner.feed(str(event.get("text") or ""))
                if text:
                    yield text
                if self.scanner.stopped:
                    self.finish_reason = "stop"
                    return
            elif kind == "done":
                self.finish_reason = "stop" if event.get("finish_reason") == "stop" else "length"
                stats = event.get("stats")
                self.device_stats = stats if isinstance(stats, dict) else None
                tail = self.scanner.flush()
                if tail:
                    yield tail
                return
            elif kind == "error":
                raise DeviceError(502, str(event.get("code") or "device_error"),
                                  str(event.get("message") or "the device failed mid-generation"))
        tail = self.scanner.flush()  # events() ends only after done/error or by raising
        if tail:
            yield tail

    def _observe(self, n: int) -> None:
        """Timing on arrival, from request arrival here (TTFT/TBT as shared/latency_stats.py defines them)."""
        self.timeline.deliver(time.perf_counter(), n)

    @property
    def ttft_s(self) -> float | None:
        return latency_stats.ttft_s(self.timeline)

    @property
    def token_times_s(self) -> list[float]:
        """TBT samples, one per token after the first (the telemetry record's `token_times_s`)."""
        return latency_stats.tbt_samples_s(self.timeline)

    @property
    def rounds(self) -> list[int]:
        """Tokens per delivery: the prefill's, then each round's."""
        return self.timeline.tokens

    @property
    def completion_tokens(self) -> int:
        return self.timeline.num_tokens

    @property
    def accept_lengths(self) -> list[int]:
        """Tokens per verification round; the first line is the prefill's token when it has one."""
        rounds = self.rounds
        num_rounds = (self.device_stats or {}).get("num_rounds")
        if rounds and (num_rounds == len(rounds) - 1 or (num_rounds is None and rounds[0] == 1)):
            return rounds[1:]
        return list(rounds)

    def tophat(self) -> dict[str, Any]:
        stats = self.device_stats or {}
        accepts = self.accept_lengths
        mean_accept = stats.get("mean_accept_length", latency_stats.mean_accept_length(accepts))
        disco = self.stream.summary() if isinstance(self.stream, DiscoStream) else {}
        return {**disco, "device_id": self.stream.device.device_id, "queue_wait_s": self.stream.queue_wait_s,
                "ttft_s": self.ttft_s, "tbt_s": latency_stats.mean_tbt_s(self.timeline),
                "mean_accept_length": mean_accept, "num_rounds": stats.get("num_rounds", len(accepts)),
                "prompt_tokens": self.stream.prompt_tokens, "completion_tokens": self.completion_tokens,
                "rounds": list(self.rounds),  # tokens per delivery: the prefill's, then each round's
                "device_stats": self.device_stats, **self.extra}

    def usage(self) -> dict[str, int]:
        return of.usage(self.stream.prompt_tokens, self.completion_tokens)

    async def close(self) -> None:
        """Release the device (stops its generation if still running) and report telemetry once."""
        if self._closed:
            return
        self._closed = True
        await self.stream.aclose()
        if self.metrics is not None:  # TTFT, ITL and e2e as the user saw them, from arrival here
            self.metrics.request_done(self.ttft_s, self.token_times_s, time.perf_counter() - self.started)
        disco = self.stream.summary() if isinstance(self.stream, DiscoStream) else None
        self.telemetry.emit_request(self.request_id, device_id=self.stream.device.device_id, ttft_s=self.ttft_s,
                                    token_times_s=self.token_times_s, accept_lengths=self.accept_lengths,
                                    prompt_tokens=self.stream.prompt_tokens,
                                    **({} if disco is None else {
                                        "endpoint": disco["endpoint"], "server_ttft_s": disco["server_ttft_s"],
                                        "cost": disco["cost"]["total"], "dispatch": disco["dispatch"]}))


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    s = settings
    router = Router(s.device_url_list, down_s=s.device_down_s)
    credential = auth.client_auth(s.auth_secret, "token-streamer", "service")  # minted from the mesh secret
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=s.connect_timeout_s, pool=s.connect_timeout_s, write=s.connect_timeout_s,
                              read=max(s.first_byte_timeout_s, s.line_timeout_s) + 1.0),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64), trust_env=False,
        verify=client_context(s.tls_ca),  # https:// device agents: the mesh's CA
        auth=credential)  # device agents answer /generate and /info to a service token only
    admission = Admission(router, max_waiting=s.queue_max_waiting, timeout_s=s.queue_timeout_s)
    dispatcher = Dispatcher(admission, client, first_byte_timeout_s=s.first_byte_timeout_s,
                            line_timeout_s=s.line_timeout_s, probe_timeout_s=s.probe_timeout_s)
    telemetry = TelemetryClient(s.state_monitor_url or None, timeout_s=s.telemetry_timeout_s,
                                verify=client_context(s.tls_ca), auth=credential)
    metrics = StreamerMetrics(running=lambda: admission.running, waiting=lambda: admission.waiting)
    disco = DiscoController(s, client)
    outlines = OutlineFlow(dispatcher, client, wait_timeout_s=s.first_byte_timeout_s + s.line_timeout_s,
                           probe_timeout_s=s.probe_timeout_s)
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
            log.warning("no device agents configured (TOPHAT_STREAMER_DEVICE_URLS, or a state monitor to discover "
                        "them from); every request will get 503")
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

    app = FastAPI(title="tophat token streamer", lifespan=lifespan)
    install_gate(app, s)  # API keys, rate per credential, body size: answered before any parsing
    app.state.router = router
    app.state.dispatcher = dispatcher
    app.state.admission = admission

    def error_response(status: int, message: str, code: str | None, param: str | None = None,
                       headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(of.error_body(message, of.error_type(status), code, param), status_code=status,
                            headers=headers)

    def device_error_response(exc: DeviceError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after_s", None)  # a full queue says when to come back
        return error_response(exc.status, exc.message, exc.code,
                              headers={"Retry-After": str(retry_after)} if retry_after else None)

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

    def prompt_of(req: of.SamplingRequest) -> dict[str, Any]:
        """What the device is asked for: a completion's raw text, or a chat's turns (templated on the device)."""
        if isinstance(req, of.ChatRequest):
            return {"messages": req.turns}
        return {"prompt": req.prompt_text}

    async def start(req: of.SamplingRequest, max_tokens: int | None, chat: bool) -> tuple[Run, of.ChunkFactory]:
        """Validate, dispatch to a device and wait for its start line (errors raise before any byte is sent)."""
        started = time.perf_counter()
        prompt = prompt_of(req)
        chars = len(prompt["prompt"]) if "prompt" in prompt else sum(len(m["content"]) for m in prompt["messages"])
        if chars > s.max_prompt_chars:
            raise BadRequest(f"prompt is longer than {s.max_prompt_chars} characters",
                             "prompt" if "prompt" in prompt else "messages")
        max_new = max_tokens if max_tokens is not None else s.max_new_tokens_default
        if max_new > s.max_new_tokens_limit:
            raise BadRequest(f"max_tokens must be <= {s.max_new_tokens_limit}", "max_tokens")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        body = {**prompt, "max_new_tokens": max_new, "temperature": req.temperature,
                "top_p": req.top_p, "seed": req.seed, "request_id": request_id}
        options = req.tophat.model_dump(exclude_none=True) if req.tophat is not None else {}
        delay_ms = options.pop("added_delay_ms", 0.0)
        if delay_ms:
            await asyncio.sleep(delay_ms / 1e3)
        dispatch = options.pop("dispatch", s.dispatch)
        budget = options.pop("budget", s.disco_budget)
        reading_rate = options.pop("reading_rate_tps", s.reading_rate_tps)
        migration = options.pop("migration", s.disco_migration)
        outline = options.pop("outline", s.outline)
        body.update(options)
        outline_stats: dict[str, Any] | None = None
        stream: DeviceStream | DiscoStream | OutlineStream
        if outline and (dispatch != "off" or options.get("mode", "hat") != "hat"):
            outline_stats = {"used": False, "reason": "dispatch" if dispatch != "off" else "mode", "points": 0}
        if dispatch == "off" and outline and outline_stats is None:
            stream, outline_stats = await outlines.open(body)
        elif dispatch == "off":
            stream = await dispatcher.open(body)
        else:
            if "mode" in options:
                raise BadRequest("a request under a dispatch policy cannot also choose its mode", "tophat")
            stream = DiscoStream(disco, dispatcher, body, dispatch=dispatch, budget=budget,
                                 reading_rate_tps=reading_rate, migration=migration, prompt_chars=chars)
            try:
                await stream.start()
            except BaseException:
                await stream.aclose()
                raise
        log.debug("request %s -> %s", request_id, stream.device.url)
        run = Run(stream, req.stop_list, started, request_id, telemetry, metrics)
        if outline_stats is not None:
            run.extra["outline"] = outline_stats
        return run, of.ChunkFactory(chat, request_id, s.model_name)

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
            log.warning("request %s failed mid-stream on %s: %s %s", run.request_id, run.stream.device.url,
                        exc.code, exc.message)
            yield of.sse(fmt.error_chunk(exc.status, exc.code, exc.message))
        yield of.DONE

    async def serve_request(req: of.SamplingRequest, max_tokens: int | None, chat: bool) -> Response:
        run, fmt = await start(req, max_tokens, chat)
        headers = {QUEUE_WAIT_HEADER: f"{run.stream.queue_wait_s * 1e3:.3f}"}
        if req.stream:
            return OwnedStreamingResponse(sse_body(run, fmt, req.include_usage), run.close,
                                          send_timeout_s=s.send_timeout_s, media_type="text/event-stream",
                                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        try:
            text = "".join([t async for t in run.deltas()])
        except DeviceError as exc:
            log.warning("request %s failed on %s: %s", run.request_id, run.stream.device.url, exc.message)
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
        return await respond(request, req, req.max_tokens, chat=False)

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
        """One chat request per JSON message (full history each time); the socket stays open between them."""
        async with asyncio.timeout(s.send_timeout_s):
            await ws.accept()

        async def send(message: dict[str, Any]) -> None:
            async with asyncio.timeout(s.send_timeout_s):
                await ws.send_json(message)

        async def send_error(status: int, detail: str, code: str, param: str | None = None) -> None:
            await send({"type": "error", **of.error_body(detail, of.error_type(status), code, param)})

        async def close(code: int, reason: str) -> None:
            try:
                async with asyncio.timeout(s.send_timeout_s):
                    await ws.close(code=code, reason=reason)
            except (TimeoutError, RuntimeError, OSError) as exc:  # already closed or peer gone
                log.debug("closing chat websocket: %s", exc)

        async def answer(raw: str) -> None:
            try:
                req = of.ChatRequest.model_validate_json(raw)
                run, _ = await start(req, req.requested_tokens, chat=True)
            except ValidationError as exc:
                detail, param = of.validation_error(exc.errors())
                await send_error(400, detail, "invalid_request", param)
                return
            except BadRequest as exc:
                await send_error(400, exc.message, "invalid_request", exc.param)
                return
            except DeviceError as exc:
                await send_error(exc.status, exc.message, exc.code)
                return
            try:
                async for text in run.deltas():
                    await send({"type": "token", "text": text})
                await send({"type": "done", "finish_reason": run.finish_reason, "usage": run.usage(),
                            "stats": run.tophat()})
            except DeviceError as exc:
                await send_error(exc.status, exc.message, exc.code)
            finally:
                await run.close()

        pending: deque[dict[str, Any]] = deque()  # what the client sent while a request was being answered
        try:
            while True:
                try:
                    async with asyncio.timeout(s.ws_idle_timeout_s):
                        message = pending.popleft() if pending else await ws.receive()
                except TimeoutError:
                    await close(1000, "idle")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text") or (message.get("bytes") or b"").decode("utf-8", "replace")
                # A client that leaves while its request is queued or streaming cancels it (and frees its slot).
                if not await unless_gone(answer(raw), ws.receive, pending):
                    log.debug("chat websocket client went away mid-request; request cancelled")
                    return
        except WebSocketDisconnect:
            log.debug("chat websocket closed by the client")
        except TimeoutError:
            log.info("chat websocket client too slow to receive; closing")
            await close(1011, "send timeout")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = await dispatcher.probe_all() > 0
        queue = {"waiting": admission.waiting, "max_waiting": admission.max_waiting}
        return JSONResponse({"ready": ready, "queue": queue, "devices": router.snapshot()},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return metrics_response(metrics.registry)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The admission queue (length, outcomes, recent waits) and each device's slots; no probing."""
        return {"queue": admission.stats(), "devices": router.snapshot()}

    return app

