"""The device agent's local HTTP API: submit a prompt, stream tokens as they are accepted.

    POST /generate  {"prompt"|"prompt_ids"|"messages", ...}  (messages: the chat template is applied here,
                    where the tokenizer lives; shared/chat.py) -> application/x-ndjson, one event per line:
        {"type":"start", "request_id", "prompt_tokens"}
        {"type":"tokens", "token_ids", "text", "t"}           (one per verification round)
        {"type":"done", "finish_reason", "stats"[, "kept": {"handle", "length"}]} | {"type":"error", "code", "message"}
    DELETE /kept/{handle}  free a kept session (404 if unknown)
    GET /info, /healthz, /readyz

Kept sessions (mode hat; kept.py): `"keep": true` keeps a request's KV, device and verifier side, once it
finishes normally, under the handle its done event carries (`max_new_tokens` 0 with keep: prefill only);
`"fork": handle` makes the request's prompt a continuation of that kept sequence (prompt + generated),
starting from copies of its KV: only the continuation is computed. An unknown handle is a 404 whose error
has type `unknown_kept_session`.

Modes, per agent (`mode` setting) or per request (`"mode"` in the body; shared/modes.py):
`hat` (HAT: U-shaped split, hidden states only, with the SD/PC/PD switches), `hat-async`,
`cloud` (HAT's cloud baseline: the device tokenizes and sends token ids, the
verifier, started with TOPHAT_VERIFIER_FULL_MODEL, runs the whole model and
samples one token per round trip; no privacy, and SD/PC/PD do not apply), the token
modes `token-sd` / `picospec`, and `device` (DiSCo's on-device endpoint: the draft
model alone, no cloud). All stream the same events. `prefix_ids` continue an answer
another endpoint began (DiSCo's migration): read after the prompt, never re-sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import partial

import httpx
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from services.device_agent.announce import announce_loop
from services.device_agent.cloud_client import (CloudError, CloudUnavailable, WebSocketCloud, token_decode,
                                                verifier_lost)
from services.device_agent.edge_server import EdgeRequest, edge_draft_server
from services.device_agent.kept import (KeepableSession, KeptSessions, SessionCloud, UnknownKeptSession,
                                        prefill_only)
from services.device_agent.plans import Plan, PlanCache, wire_bytes_per_token
from services.device_agent.settings import Settings
from shared import auth, latency_stats, wire
from shared.device_registry import advertised_url
from shared.jupiter.outline import advertised_chat_format
from shared.device_speed import slowed, speed_schedule
from shared.latency_stats import Timeline
from shared.links import parse_link_spec, scaled_for_hidden
from shared.metrics import DeviceMetrics, metrics_response
from shared.jupiter.plan import load_plan
from shared.hardening import with_noise, with_rotation
from shared.model.checkpoint import load_checkpoint, split_fingerprint
from shared.model.rotation import rotated_fingerprint
from shared.model.placement import detect_placement
from shared.runtime import build_device_model, encode_prompt
from shared.specdec.device_session import DeviceSession, DraftConfig, SessionError, warm_up_device
from shared.specdec.engine import fixed_chunks, run_session
from shared.specdec.local_decode import LocalSession, local_session
from shared.specdec.replay import ReplayingCloud
from shared.modes import STREAM_MODES, TOKEN_MODES, Downlink, Mode
from shared.specdec.sampling import SamplingParams
from shared.specdec.stream_engine import hat_async_session, stream_config, token_stream_session
from shared.specdec.stream_session import StreamSession
from shared.telemetry import TelemetryClient
from shared.tls import client_context

log = logging.getLogger("services.device_agent")

MIN_BANDWIDTH_SAMPLE_BYTES = 16 * 1024
DEFAULT_PARALLEL_STEPS = 2  # used when the planner (eq. 6) is unreachable or has no telemetry
# Readiness follows the verifier connection: a drop is seen at once (the reader ends), a reconnect
# and split check is tried this often, each bounded; a verifier that refused the split is a
# configuration error, re-checked rarely so the refusal is not logged every second.
READINESS_INTERVAL_S = 1.0
READINESS_TIMEOUT_S = 5.0
REFUSED_RECHECK_S = 10.0


class ChatTurn(BaseModel):
    role: str = Field(min_length=1, max_length=32)
    content: str


class GenerateRequest(BaseModel):
    # exactly one of: raw text, token ids, or a conversation (rendered with the model's chat template)
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatTurn] | None = None
    # Tokens another endpoint already generated for this request (DiSCo's token-level migration):
    # read after the prompt, never sent back; the answer goes on from them.
    prefix_ids: list[int] | None = Field(None, max_length=4096)
    prefix_text: str | None = Field(None, max_length=1 << 20)  # what the user was shown of them (see below)
    max_new_tokens: int = Field(64, ge=0, le=4096)  # 0: prefill only, with keep
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    request_id: str | None = None
    mode: Mode | None = None  # None: the agent's `mode` setting (shared/modes.py)
    privacy: bool | None = None  # true: refuse the token modes
    downlink: Downlink | None = None
    top_k: int | None = Field(None, ge=1, le=1000)
    stream_group: int | None = Field(None, ge=1, le=64)
    stream_window: int | None = Field(None, ge=1, le=64)
    stream_eta_gate: bool | None = None
    # Per-request overrides of the agent's feature switches (for baselines and ablations).
    speculative: bool | None = None  # SD
    prompt_chunking: bool | None = None  # PC
    chunk_size: int | None = Field(None, ge=1)  # fixed chunk size instead of the planner's
    overlap_prefill: bool | None = None
    parallel_candidates: int | None = Field(None, ge=0, le=16)  # PD
    parallel_steps: int | None = Field(None, ge=0, le=32)
    # Kept sessions (mode hat): keep this request's KV when it finishes; start from a kept session's KV
    # (the prompt continues its sequence).
    keep: bool = False
    fork: str | None = Field(None, min_length=1, max_length=128)
    # Edge SD (mode edge-sd): this user's uplink SNR p g / σ² in dB (the draft server's default without it)
    snr_db: float | None = Field(None, ge=-30.0, le=150.0)

    def option(self, name: str, settings: Settings):
        value = getattr(self, name)
        return getattr(settings, name) if value is None else value


def _error(status: int, code: str, message: str, **detail) -> JSONResponse:
    # "type" repeats the code: the kept-session errors were specified with it (OpenAI's error shape)
    return JSONResponse(status_code=status, content={"error": {"code": code, "type": code, "message": message,
                                                               **detail}})


def _kept_refusal(request: GenerateRequest, mode: str) -> JSONResponse | None:
    """Why keep / fork / max_new_tokens 0 cannot be served as asked (None: they can)."""
    if request.max_new_tokens == 0 and not request.keep:
        return _error(400, "bad_request", "max_new_tokens 0 (prefill only) needs keep: true")
    if (request.keep or request.fork is not None) and mode != "hat":
        return _error(400, "kept_sessions_unsupported", f"keep and fork work in mode hat only, not {mode}", mode=mode)
    return None


class IncrementalDetokenizer:
    """Text deltas from a growing token list, holding back incomplete UTF-8."""

    def __init__(self, tokenizer, prefix_ids: list[int] | None = None, prefix_text: str | None = None):
        self.tokenizer = tokenizer
        # Text already shown (another endpoint's tokens): deltas continue it, so they join without a seam.
        # The other endpoint may have held back the start of a character its last tokens began: given
        # what it did show, the first delta here carries the rest.
        self.token_ids: list[int] = list(prefix_ids or [])
        self.emitted = "" if tokenizer is None or not self.token_ids else self._decode()
        if prefix_text is not None and self.emitted.startswith(prefix_text):
            self.emitted = prefix_text

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.token_ids += token_ids
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


class DeviceAgent:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.placement = detect_placement(settings.device, settings.dtype, what=f"device agent {settings.device_id}")
        self.checkpoint = load_checkpoint(settings.model_dir, dtype=self.placement.dtype)
        self.model = build_device_model(self.checkpoint, settings.split_layers, settings.adapter or None,
                                        speculative=settings.speculative).to(self.placement.device)
        tls = client_context(settings.tls_ca)  # trusts the mesh's CA for https:// planner and monitor
        # This device's credential on its calls (verifier handshake, monitor, planner): its own token, or one
        # minted from the mesh secret for its device id (shared/auth.py); None when the mesh runs open.
        credential = auth.client_auth(settings.auth_secret, settings.device_id, "device", settings.auth_token)
        self.telemetry = TelemetryClient(settings.state_monitor_url or None, verify=tls, auth=credential)
        self.metrics = DeviceMetrics(settings.device_id, settings.max_draft)
        link = parse_link_spec(settings.link)
        if settings.link_scaled:
            link = scaled_for_hidden(link, self.checkpoint.hidden_size)
        self.cloud = WebSocketCloud(settings.verifier_url, self.checkpoint.hidden_size,
                                    wire.WireDtype(settings.wire_dtype), settings.request_timeout_s,
                                    on_transfer=self._on_transfer, link=link if link.shaped else None,
                                    on_frame=self.metrics.frame,
                                    split_layers=settings.split_layers,
                                    fingerprint=rotated_fingerprint(split_fingerprint(settings.model_dir,
                                                                                      settings.split_layers),
                                                                    settings.hidden_rotation),
                                    tls_ca=settings.tls_ca, auth=credential)
        # HAT sessions keep the shallow rows they sent and replay them on a verifier (another replica, or the
        # same one restarted) when theirs goes away mid-generation (shared/specdec/replay.py).
        # Uplink hardening (shared/hardening.py) for the hidden-state modes: rotation inside the replay (replays are
        # rotated too), noise outside it (the replay log keeps the noisy rows, so a replay rebuilds the same cache).
        hidden_cloud = with_rotation(self.cloud, settings.hidden_rotation, self.checkpoint.hidden_size)
        self.sessions_cloud = with_noise(ReplayingCloud(hidden_cloud, verifier_lost,
                                                        deadline_s=settings.failover_deadline_s,
                                                        on_replay=self._on_replay), settings.uplink_noise)
        self.async_cloud = with_noise(hidden_cloud, settings.uplink_noise)  # hat-async: no replay
        self.speed = speed_schedule(settings.speed)
        self.requests_served = 0
        self.replays = 0  # sessions moved to another verifier (or the same one, restarted)
        self.active = 0
        self.http = httpx.AsyncClient(timeout=settings.planner_timeout_s, verify=tls, auth=credential)
        # The planner's answers, cached per device and refreshed off the request path (plans.py).
        self.bytes_per_token = wire_bytes_per_token(self.checkpoint.hidden_size, wire.WireDtype(settings.wire_dtype))
        self.plans = PlanCache(
            self.http, settings.chunk_planner_url, settings.device_id, bytes_per_token=self.bytes_per_token,
            max_prompt_tokens=self.model.context_length, max_rows=settings.max_draft + 1,
            default_chunk_size=settings.default_chunk_size, default_steps=DEFAULT_PARALLEL_STEPS,
            refresh_s=settings.plan_refresh_s, timeout_s=settings.planner_timeout_s,
        ) if settings.chunk_planner_url else None
        self.recent_rtts: deque[float] = deque(maxlen=5)
        # An edge pipeline's first stage cuts prompts by the plan's sub-sequence table (Jupiter §IV-B2).
        self.edge_plan = load_plan(settings.edge_plan, self.checkpoint.num_layers,
                                   self.checkpoint.hidden_size) if settings.edge_plan else None
        self.kept = KeptSessions(settings.kept_ttl_s, settings.max_kept, self.sessions_cloud.close)
        self.edge = edge_draft_server(settings, self.checkpoint, self.cloud, self.http) \
            if settings.edge_draft_server else None
        warm_up_device(self.model)

    def _on_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        # Small frames measure latency, not bandwidth; only bulk transfers feed beta_up/beta_down.
        if nbytes >= MIN_BANDWIDTH_SAMPLE_BYTES:
            self.telemetry.emit_device_transfer(self.settings.device_id, direction, nbytes, seconds)

    async def probe_loop(self) -> None:
        """Probe the link once the verifier answers, then every interval, only while no request runs
        (a probe shares the link, so it must not sit in front of a user's prefill)."""
        interval = self.settings.bandwidth_probe_interval_s
        if interval <= 0:
            return
        while True:
            # Not before the verifier answers (the agent may start before it), and not in front of a request:
            # then look again shortly instead of a whole interval later.
            if not self.cloud.ready or self.active:
                await asyncio.sleep(READINESS_INTERVAL_S)
                continue
            await self.probe_bandwidth()
            await asyncio.sleep(interval)

    async def readiness_loop(self) -> None:
        """Keep `cloud.ready` current: reconnect and re-check the split identity while it is not."""
        was_ready = False
        while True:
            ready = await self.cloud.check_ready(READINESS_TIMEOUT_S)
            if ready != was_ready:
                log.log(logging.INFO if ready else logging.WARNING, "device %s %s", self.settings.device_id,
                        "is ready: the verifier accepted its split" if ready else
                        f"is not ready: {self.cloud.not_ready_reason}")
                was_ready = ready
            await asyncio.sleep(REFUSED_RECHECK_S if self.cloud.split_refused else READINESS_INTERVAL_S)

    async def rtt_probe_loop(self) -> None:
        """Tiny round trips, busy or not: what a message costs under the load of the moment."""
        interval = self.settings.rtt_probe_interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                self._report_rtt(await self.cloud.measure_rtt())
            except (CloudUnavailable, CloudError) as exc:
                log.info("round-trip probe failed: %s", exc)

    def _report_rtt(self, rtt_s: float) -> None:
        # The median of the last few: a probe that queued behind a prompt upload on the shared
        # link measures that upload (which the simulator models itself), not the message cost.
        self.recent_rtts.append(rtt_s)
        self.telemetry.emit_device_rtt(self.settings.device_id, statistics.median(self.recent_rtts))

    async def probe_bandwidth(self) -> None:
        """Measure beta_up / beta_down with bulk probes (HAT §3.2: devices report both)."""
        try:
            (up_bytes, up_s), (down_bytes, down_s), rtt_s = await self.cloud.measure_link()
        except (CloudUnavailable, CloudError) as exc:
            log.info("bandwidth probe failed: %s", exc)
            return
        self._on_transfer("up", up_bytes, up_s)
        self._on_transfer("down", down_bytes, down_s)
        self._report_rtt(rtt_s)
        log.info("link probe: up %.0f KB/s, down %.0f KB/s, small-message round trip %.1f ms",
                 up_bytes / up_s / 1e3, down_bytes / down_s / 1e3, rtt_s * 1e3)

    def _on_replay(self, session_id: int, rows: int, seconds: float) -> None:
        self.replays += 1
        log.warning("session %d continues on verifier %s: %d rows replayed, %.2f s after the loss",
                    session_id, self.cloud.url, rows, seconds)

    async def plan(self) -> Plan:
        """Chunk size and PD steps for a request starting now: the planner's cached plan, or the defaults."""
        if self.plans is None:
            return Plan.defaults(self.settings.default_chunk_size, DEFAULT_PARALLEL_STEPS)
        return await self.plans.current()

    async def _hat_rounds(self, request: GenerateRequest, ids: list[int], session: DeviceSession,
                          session_id: int, slowdown: float) -> AsyncIterator[list[int]]:
        """HAT mode: the tokens each verification round makes final."""
        settings = self.settings
        speculative = session.draft_config.max_draft > 0 and self.model.adapter is not None
        pd_candidates = request.option("parallel_candidates", settings) if speculative else 0
        chunking = request.option("prompt_chunking", settings)
        plan = await self.plan() if (chunking and not request.chunk_size) or pd_candidates else None
        new_tokens = len(ids) - session.commit_len  # a fork's caches already hold the kept prefix
        chunk_size = (request.chunk_size or plan.chunk_for(new_tokens)) if chunking else None
        chunks = (self.edge_plan.chunk_sizes(new_tokens) if chunking and self.edge_plan and not request.chunk_size
                  else fixed_chunks(new_tokens, chunk_size))
        keepable = isinstance(session, KeepableSession)
        cloud = SessionCloud(self.sessions_cloud, session) if keepable else self.sessions_cloud
        # PD steps: the request's or the agent's fixed count, else eq. 6 per round for the rows it sends.
        pd_steps = (request.parallel_steps or settings.parallel_steps or plan.steps_for) if pd_candidates else 0

        async def offload(fn, *args):
            return await slowed(fn, *args, slowdown=slowdown)

        if keepable and session.prefill_only:
            rounds = prefill_only(session, cloud, session_id, chunks, offload,
                                  request.option("overlap_prefill", settings))
        else:
            rounds = run_session(session, cloud, session_id, chunks, offload=offload,
                                 overlap_prefill=request.option("overlap_prefill", settings),
                                 parallel_candidates=pd_candidates, parallel_steps=pd_steps,
                                 finish_alone_on=verifier_lost if settings.on_cloud_loss == "finish_on_device"
                                 else None)
        if keepable and request.keep:
            session.on_keep = partial(self._keep, session_id)
        async for tokens in rounds:
            yield tokens

    def _keep(self, session_id: int, session: KeepableSession):
        """Hand a finished session's caches (and its verifier session) to the kept sessions."""
        tokens = session.prompt_ids + session.generated
        cache_len = min(session.commit_len, len(tokens))
        return self.kept.keep(tokens, cache_len, session.input_cache, session.adapter_cache, session_id,
                              self.sessions_cloud.rows(session_id, cache_len))

    async def _stream_rounds(self, request: GenerateRequest, session: StreamSession, session_id: int,
                             slowdown: float) -> AsyncIterator[list[int]]:
        """token-sd / picospec / hat-async: the tokens each verdict makes final (stream_engine.py)."""
        settings = self.settings
        mode = request.option("mode", settings)
        config = stream_config(mode, request.option("stream_group", settings),
                               request.option("stream_window", settings), settings.max_draft,
                               request.option("stream_eta_gate", settings),
                               request.option("parallel_candidates", settings),
                               request.parallel_steps or settings.parallel_steps or 2)

        async def offload(fn, *args):
            return await slowed(fn, *args, slowdown=slowdown)

        if mode == "hat-async":
            chunking = request.option("prompt_chunking", settings)
            plan = await self.plan() if chunking and not request.chunk_size else None
            chunk_size = (request.chunk_size or plan.chunk_for(len(session.prompt_ids))) if chunking else None
            rounds = hat_async_session(session, self.async_cloud, session_id, fixed_chunks(len(session.prompt_ids), chunk_size),
                                       config, offload, request.option("overlap_prefill", settings))
        else:
            rounds = token_stream_session(session, self.cloud, session_id, config, offload,
                                          request.option("downlink", settings), request.option("top_k", settings))
        async for tokens in rounds:
            yield tokens

    async def _cloud_rounds(self, request: GenerateRequest, ids: list[int], session_id: int,
                            generated: list[int]) -> AsyncIterator[list[int]]:
        """Cloud mode: one token per round trip; the device does no model compute (so no slowdown)."""
        params = SamplingParams(request.temperature, request.top_p, request.seed)
        async for tokens in token_decode(self.cloud, session_id, ids, params, request.max_new_tokens,
                                         self.model.eos_token_id):
            generated += tokens
            yield tokens

    async def stream(self, request: GenerateRequest, ids: list[int], session: DeviceSession | None,
                     request_id: str):
        """NDJSON events of one request; `session` is None in cloud mode."""
        started = time.perf_counter()
        timeline = Timeline()  # seconds since `started`, one delivery per round
        detok = IncrementalDetokenizer(self.checkpoint.tokenizer, request.prefix_ids, request.prefix_text)
        session_id = random.getrandbits(63)
        cloud_generated: list[int] = []
        # Counted in both modes, so the speed schedule (HAT's mode switches) sees the same requests.
        request_slowdown = self.speed.slowdown_for(self.requests_served)
        self.requests_served += 1
        yield json.dumps({"type": "start", "request_id": request_id, "prompt_tokens": len(ids)}) + "\n"
        counted = 0  # of session.verdicts, those in the metrics
        try:
            mode = request.option("mode", self.settings)
            if session is None:
                rounds = self._cloud_rounds(request, ids, session_id, cloud_generated)
            elif mode == "edge-sd":
                rounds = self.edge.generate(EdgeRequest(session, session_id, request.snr_db))
            elif isinstance(session, LocalSession):
                rounds = local_session(session, partial(slowed, slowdown=request_slowdown))
            elif mode in STREAM_MODES:
                rounds = self._stream_rounds(request, session, session_id, request_slowdown)
            else:
                rounds = self._hat_rounds(request, ids, session, session_id, request_slowdown)
            async for tokens in rounds:
                if session is not None:  # spec-decode counters, live: this delivery is one round's (or the prefill's)
                    counted = self._count_rounds(session, counted)
                now = time.perf_counter() - started
                timeline.deliver(now, len(tokens))
                yield json.dumps({"type": "tokens", "token_ids": tokens, "text": detok.push(tokens), "t": now}) + "\n"
        except (CloudUnavailable, CloudError, SessionError) as exc:
            log.warning("request %s failed: %s", request_id, exc)
            yield json.dumps({"type": "error", "code": type(exc).__name__, "message": str(exc)}) + "\n"
            return
        finally:
            self.active -= 1
            if session is not None:  # rounds verified but not delivered (the client went away) count too
                self._count_rounds(session, counted)
        if session is not None:
            generated, accept_lengths = session.generated, session.accept_lengths
        else:  # like the reference decoder: every round after the first yields exactly one token
            generated, accept_lengths = cloud_generated, [1] * max(0, len(cloud_generated) - 1)
        # shared/latency_stats.py's definitions; 0.0 where undefined (no token, one token, no round)
        ttft, tbt = latency_stats.ttft_s(timeline) or 0.0, latency_stats.mean_tbt_s(timeline) or 0.0
        stats = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(generated),
            "ttft_s": ttft,
            "tbt_s": tbt,
            "mean_accept_length": latency_stats.mean_accept_length(accept_lengths) or 0.0,
            "num_rounds": len(accept_lengths),
            "mode": mode,
            "privacy": mode not in TOKEN_MODES,  # False: token ids went to the cloud
            # finished by the draft model alone after losing the cloud: not the target model's text
            "degraded": bool(session is not None and session.degraded),
            # of prompt_tokens, those a fork started with in its caches (computed by the kept request)
            "cached_tokens": session.cached_tokens if isinstance(session, KeepableSession) else 0,
        }
        eos = self.model.eos_token_id
        finish = "stop" if generated and generated[-1] == eos else "length"
        done = {"type": "done", "finish_reason": finish, "stats": stats}
        if isinstance(session, KeepableSession) and session.kept is not None:
            done["kept"] = {"handle": session.kept.handle, "length": session.kept.length}
        yield json.dumps(done) + "\n"
        if session is not None:
            self._report_timings(session, request_slowdown)

    def _count_rounds(self, session: DeviceSession, counted: int) -> int:
        """Count the session's verification rounds from index `counted` on; returns how many are counted now."""
        verdicts = session.verdicts[counted:]
        self.metrics.spec_decode.rounds(verdicts)
        return counted + len(verdicts)

    def _report_timings(self, session: DeviceSession, slowdown: float) -> None:
        """What only the device knows: its draft step (gamma) and, for the simulator's latency models,
        its prompt cost per token, its per-round time outside drafting and the cloud wait (mean and
        median: wall clock, divided by the emulated slowdown to be in gamma's unslowed units), how
        often a pre-drafted branch was the correction and how often a whole draft was accepted.
        Per-request telemetry (TTFT, token times, accept lengths) is the token-streamer's."""
        total_s, steps = sum(s for s, _ in session.draft_seconds), sum(n for _, n in session.draft_seconds)
        if not steps:
            return
        overheads = session.round_overhead_s
        prefill_s, prefill_tokens = (sum(s for s, _ in session.prefill_seconds),
                                     sum(n for _, n in session.prefill_seconds))
        self.telemetry.emit_device_draft(
            self.settings.device_id, total_s / steps, steps,
            round_overhead_s=sum(overheads) / len(overheads) / slowdown if overheads else None,
            round_overhead_median_s=statistics.median(overheads) / slowdown if overheads else None,
            rounds=len(overheads),
            prefill_token_s=prefill_s / prefill_tokens / slowdown if prefill_tokens else None,
            prefill_tokens=prefill_tokens,
            pd_hit_rate=session.reused_branches / session.predraft_chances if session.predraft_chances else None,
            pd_chances=session.predraft_chances,
            # U-shape rounds (no draft) accept "everything" trivially; only speculative sessions say anything.
            full_accept_rate=(session.full_accepts / len(session.accept_lengths)
                              if session.accept_lengths and session.draft_config.max_draft > 0 else None))

    async def aclose(self) -> None:
        if self.edge is not None:
            await self.edge.aclose()
        await self.kept.aclose()  # closes their verifier sessions while the connection is still up
        await self.cloud.close_connection()
        if self.plans is not None:
            await self.plans.aclose()
        await self.http.aclose()
        await self.telemetry.aclose()


def create_app(settings: Settings, agent: DeviceAgent | None = None) -> FastAPI:
    state: dict[str, DeviceAgent] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        torch.set_num_threads(settings.torch_threads)
        state["agent"] = agent or await asyncio.to_thread(DeviceAgent, settings)
        log.info("device agent %s ready (model %s, m=%d, speculative=%s, mode %s)", settings.device_id,
                 settings.model_dir, settings.split_layers, settings.speculative, settings.mode)
        probes = [asyncio.create_task(state["agent"].readiness_loop(), name="verifier-readiness"),
                  asyncio.create_task(state["agent"].probe_loop(), name="bandwidth-probe"),
                  asyncio.create_task(state["agent"].rtt_probe_loop(), name="rtt-probe"),
                  asyncio.create_task(state["agent"].kept.cleanup_loop(), name="kept-sessions")]
        if state["agent"].edge is not None:
            probes.append(asyncio.create_task(state["agent"].edge.run(), name="edge-sd-rounds"))
        if settings.state_monitor_url and settings.announce_interval_s > 0:
            url = advertised_url(settings.advertise_url, settings.host, settings.port,
                                 route_to=settings.state_monitor_url)
            if settings.tls_cert and not settings.advertise_url:  # this agent serves only https
                url = "https://" + url.removeprefix("http://")
            probes.append(asyncio.create_task(announce_loop(
                state["agent"].http, settings.state_monitor_url, settings.device_id, url, settings.max_sessions,
                settings.announce_interval_s), name="announce"))
        if state["agent"].plans is not None:
            state["agent"].plans.refresh()  # the first plan, fetched before the first request needs it
        try:
            yield
        finally:
            for task in probes:
                task.cancel()
            await asyncio.gather(*probes, return_exceptions=True)
            await state["agent"].aclose()

    app = FastAPI(title=f"tophat device agent {settings.device_id}", lifespan=lifespan)
    # /generate and /info answer the streamer only (a service token); the probes stay open.
    auth.warn_if_open(f"device agent {settings.device_id}", settings.auth_secret, settings.host,
                      "TOPHAT_DEVICE_AUTH_SECRET")
    auth.install(app, settings.auth_secret, {"service"})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if "agent" not in state:
            return _error(503, "starting", "model still loading")
        cloud = state["agent"].cloud
        if not cloud.ready:  # the readiness loop's cached answer: no network call per probe
            return _error(503, "verifier_unavailable", cloud.not_ready_reason)
        return {"status": "ready", "device_id": settings.device_id}

    @app.get("/metrics")
    async def metrics():
        return metrics_response(state["agent"].metrics.registry if "agent" in state else None)

    @app.get("/info")
    async def info():
        agent = state["agent"]
        return {"device_id": settings.device_id, "model": agent.checkpoint.path.name,
                "active_sessions": agent.active, "max_sessions": settings.max_sessions,
                "speculative": settings.speculative, "split_layers": settings.split_layers, "mode": settings.mode,
                "bytes_per_token": agent.bytes_per_token, "speed": settings.speed,
                "eos_token_id": agent.model.eos_token_id, "kept_sessions": len(agent.kept),
                # the template's text between turns: the streamer's outline requests (shared/jupiter/outline.py)
                "chat_format": advertised_chat_format(agent.checkpoint.tokenizer)}

    @app.get("/edge-sd/rounds")
    async def edge_rounds():
        agent = state["agent"]
        if agent.edge is None:
            return _error(404, "not_an_edge_server", "this agent is not an edge draft server")
        return {"rounds": [asdict(r) for r in agent.edge.rounds]}

    @app.delete("/kept/{handle}")
    async def delete_kept(handle: str):
        if not await state["agent"].kept.delete(handle):
            return _error(404, "unknown_kept_session", f"no kept session {handle!r} (deleted, expired or evicted)")
        return {"deleted": handle}

    @app.post("/generate")
    async def generate(request: GenerateRequest):
        agent = state["agent"]
        if agent.active >= settings.max_sessions:
            return _error(503, "busy", f"device {settings.device_id} is serving {agent.active} sessions")
        try:
            messages = None if request.messages is None else [m.model_dump() for m in request.messages]
            ids = encode_prompt(agent.checkpoint, request.prompt, request.prompt_ids, messages)
            if request.prefix_ids:
                ids = ids + encode_prompt(agent.checkpoint, None, request.prefix_ids)  # checked like prompt ids
            params = SamplingParams(request.temperature, request.top_p, request.seed)
            mode = request.option("mode", settings)
            if (refusal := _kept_refusal(request, mode)) is not None:
                return refusal
            parent = agent.kept.get(request.fork) if request.fork is not None else None
            if parent is not None:  # the prompt continues the kept sequence
                ids = parent.token_ids + ids
                if len(ids) <= parent.cache_len:
                    return _error(400, "bad_request", "a fork needs a continuation: the kept sequence is all cached")
            if request.privacy and mode in TOKEN_MODES:
                return _error(400, "privacy", f"mode {mode} sends token ids to the cloud; this request asked for "
                              "privacy (use hat or hat-async)")
            if mode == "cloud":  # SD / PC / PD do not apply
                if not ids:
                    return _error(400, "bad_request", "the prompt is empty")
                agent.active += 1
                return StreamingResponse(agent.stream(request, ids, None, request.request_id or uuid.uuid4().hex),
                                         media_type="application/x-ndjson")
            speculative = request.option("speculative", settings)
            if speculative and agent.model.adapter is None:
                return _error(400, "bad_request", "this device runs without a draft adapter (speculative=false)")
            max_draft = settings.max_draft if speculative else 0
            if mode in STREAM_MODES and (agent.model.adapter is None or not max_draft):
                return _error(400, "bad_request", f"mode {mode} drafts: it needs speculative=true and a draft adapter")
            if mode == "edge-sd" and (agent.edge is None or agent.model.adapter is None):
                return _error(400, "bad_request", "mode edge-sd needs an edge draft server (TOPHAT_DEVICE_EDGE_DRAFT_"
                              "SERVER) with a draft adapter")
            if mode == "device" and agent.model.adapter is None:
                return _error(400, "bad_request", "mode device generates with the draft model: this device has none")
            session_type = (LocalSession if mode == "device" else
                            StreamSession if mode in STREAM_MODES or mode == "edge-sd" else DeviceSession)
            if request.keep or parent is not None:
                session_type = KeepableSession
            session = session_type(agent.model, ids, params, DraftConfig(settings.eta, max_draft),
                                   max(request.max_new_tokens, 1))  # 0 (prefill only) never reaches a decode step
            if isinstance(session, KeepableSession):
                session.prefill_only = request.max_new_tokens == 0
                if parent is not None:
                    session.start_from(parent)
        except UnknownKeptSession:
            return _error(404, "unknown_kept_session", f"no kept session {request.fork!r} (never kept, deleted, "
                          "expired or evicted)")
        except (SessionError, ValueError) as exc:
            return _error(400, "bad_request", str(exc))
        agent.active += 1
        request_id = request.request_id or uuid.uuid4().hex
        return StreamingResponse(agent.stream(request, ids, session, request_id), media_type="application/x-ndjson")

    return app
