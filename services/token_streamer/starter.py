"""From a validated OpenAI request to a started `Run`: limits, the device body, the dispatch policy.

Everything that can refuse a request does so here, before any byte of the answer
is sent, so the HTTP and WebSocket fronts both answer a plain error instead of a
broken stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.token_streamer import openai_format as of
from services.token_streamer.device_stream import DeviceStream
from services.token_streamer.disco import DiscoController
from services.token_streamer.disco_stream import DiscoStream
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.outline import OutlineFlow, OutlineStream
from services.token_streamer.run import Run
from services.token_streamer.settings import Settings
from shared.console.history import ConsoleHistory
from shared.modes import KEPT_SESSIONS_MODE
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import StreamerMetrics

log = logging.getLogger(__name__)


class BadRequest(Exception):
    """Input the streamer itself rejects (400), before any device is involved."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def prompt_of(req: of.SamplingRequest) -> dict[str, Any]:
    """What the device is asked for: a completion's raw text or token ids, or a chat's turns (templated
    on the device)."""
    if isinstance(req, of.ChatRequest):
        return {"messages": req.turns}
    assert isinstance(req, of.CompletionRequest)  # the two endpoints' requests are the only kinds
    ids = req.prompt_ids
    return {"prompt": req.prompt_text} if ids is None else {"prompt_ids": ids}


def prompt_size(prompt: dict[str, Any]) -> int:
    """The prompt's length against max_prompt_chars: characters, or token ids (each at least one character)."""
    if "messages" in prompt:
        return sum(len(m["content"]) for m in prompt["messages"])
    return len(prompt["prompt"] if "prompt" in prompt else prompt["prompt_ids"])


@dataclass(frozen=True)
class RequestStarter:
    """The parts a request may be started on: one device, two (DiSCo) or an outline's points."""

    settings: Settings
    dispatcher: Dispatcher
    outlines: OutlineFlow
    disco: DiscoController
    telemetry: TelemetryClient
    metrics: StreamerMetrics | None
    history: ConsoleHistory | None = None  # the web console's plots (console.py)

    async def start(self, req: of.SamplingRequest, max_tokens: int | None, chat: bool) -> tuple[Run, of.ChunkFactory]:
        """Validate, dispatch to a device and wait for its start line (errors raise before any byte is sent)."""
        s = self.settings
        started = time.perf_counter()
        prompt = prompt_of(req)
        chars = prompt_size(prompt)
        if chars > s.max_prompt_chars:
            raise BadRequest(
                f"prompt is longer than {s.max_prompt_chars} characters",
                "messages" if "messages" in prompt else "prompt",
            )
        max_new = max_tokens if max_tokens is not None else s.max_new_tokens_default
        if max_new > s.max_new_tokens_limit:
            raise BadRequest(f"{req.tokens_param} must be <= {s.max_new_tokens_limit}", req.tokens_param)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        body = {
            **prompt,
            "max_new_tokens": max_new,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "request_id": request_id,
            **({"ignore_eos": True} if req.ignore_eos else {}),  # only when asked (the agent's default: false)
        }
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
        # outlines fork kept sessions: only the table's keepable mode (a request without a mode gets the agent's, hat)
        if outline and (dispatch != "off" or options.get("mode", KEPT_SESSIONS_MODE) != KEPT_SESSIONS_MODE):
            outline_stats = {"used": False, "reason": "dispatch" if dispatch != "off" else "mode", "points": 0}
        if dispatch == "off" and outline and outline_stats is None:
            stream, outline_stats = await self.outlines.open(body)
        elif dispatch == "off":
            stream = await self.dispatcher.open(body)
        else:
            if "mode" in options:
                raise BadRequest("a request under a dispatch policy cannot also choose its mode", "tophat")
            stream = DiscoStream(
                self.disco,
                self.dispatcher,
                body,
                dispatch=dispatch,
                budget=budget,
                reading_rate_tps=reading_rate,
                migration=migration,
                prompt_chars=chars,
            )
            try:
                await stream.start()
            except BaseException:
                await stream.aclose()
                raise
        assert stream.device is not None  # a DiscoStream's is set by start()
        log.debug("request %s -> %s", request_id, stream.device.url)
        run = Run(stream, req.stop_list, started, request_id, self.telemetry, self.metrics, self.history)
        if outline_stats is not None:
            run.extra["outline"] = outline_stats
        return run, of.ChunkFactory(chat, request_id, s.model_name)
