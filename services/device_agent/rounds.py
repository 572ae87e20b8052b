"""Per mode, the session the device builds and the loop that turns it into verified tokens.

shared/modes.py's table names both by string (a session kind, a rounds loop); this is the one place that maps
them to classes and loops. Every mode's builder takes a `RoundsStart` (the agent, the request, its prompt ids,
its session, a session id, the device's slowdown), does what must come before the loop (a planner's answer)
and returns the mode's `SessionLoop` (shared/specdec/session_loop.py: `step()` until finished), not yet
started. Driven (`drive(loop)`), the loop owns the session: it frees the device KV and closes the verifier's
session however it ends, so the caller drives it at once and closes the driver (contextlib.aclosing) rather
than leave that to the garbage collector; a session whose loop was never driven is the caller's to free.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.cloud_errors import cloud_gone
from services.device_agent.edge_server import EdgeDraftServer, EdgeLoop, EdgeRequest
from services.device_agent.generate_request import GenerateRequest
from services.device_agent.kept import KeepableSession, KeptSessions, PrefillOnlyLoop, SessionCloud
from services.device_agent.plans import Plan
from services.device_agent.settings import Settings
from services.device_agent.token_mode import CloudLoop
from shared.modes import ModeSpec, Rounds, SessionKind
from shared.planning.device_speed import slowed
from shared.specdec.decode_loop import HatLoop, fixed_chunks
from shared.specdec.device_session import DeviceSession, DraftConfig
from shared.specdec.hat_async import HatAsyncLoop
from shared.specdec.local_decode import LocalLoop, LocalSession
from shared.specdec.sampling import SamplingParams
from shared.specdec.session_loop import SessionLoop
from shared.specdec.stream_engine import stream_config
from shared.specdec.stream_session import StreamSession
from shared.specdec.token_stream import TokenStreamLoop

PARALLEL_STEPS_STREAMED = 2  # a streamed mode's parallel-draft steps when neither request nor agent sets them


class AgentParts(Protocol):
    """What the rounds loops use of the device agent (services/device_agent/agent.py)."""

    settings: Settings
    model: Any  # shared/runtime.py's device model
    cloud: WebSocketCloud  # token ids, and hidden states unwrapped
    sessions_cloud: Any  # HAT's cloud: hardened, replayed on another verifier when one is lost
    async_cloud: Any  # hat-async's cloud: hardened, no replay
    edge_plan: Any  # Jupiter's sub-sequence table for an edge pipeline's first stage, or None
    edge: EdgeDraftServer | None
    kept: KeptSessions

    async def plan(self) -> Plan: ...


@dataclass(frozen=True)
class RoundsStart:
    """What every mode's loop is built from: the agent, the request, its prompt ids, its session (None where
    the device builds none), the verifier's session id and the device's slowdown for this request."""

    agent: AgentParts
    request: GenerateRequest
    ids: list[int]
    session: Any
    session_id: int
    slowdown: float

    @property
    def offload(self) -> Callable[..., Awaitable]:
        """Device compute at this device's speed (shared/planning/device_speed.py)."""
        return partial(slowed, slowdown=self.slowdown)

    def option(self, name: str):
        return self.request.option(name, self.agent.settings)

    async def chunk_size(self, new_tokens: int, plan: Plan | None = None) -> int | None:
        """The prompt's chunk size: the request's own, else the planner's (eq. 3), None when chunking is off."""
        if not self.option("prompt_chunking"):
            return None
        if self.request.chunk_size:
            return self.request.chunk_size
        plan = plan or await self.agent.plan()
        return plan.chunk_for(new_tokens)


LoopBuilder = Callable[[RoundsStart], Awaitable[SessionLoop]]


def build_session(
    spec: ModeSpec,
    model,
    ids: list[int],
    params: SamplingParams,
    draft: DraftConfig,
    max_new_tokens: int,
    keepable: bool,
):
    """The device session of a request in mode `spec` (None in a mode where the device builds none)."""
    session_type = KeepableSession if keepable else SESSION_TYPES[spec.session]
    if session_type is None:
        return None
    return session_type(model, ids, params, draft, max_new_tokens)


async def hat_loop(start: RoundsStart) -> SessionLoop:
    """HAT mode: the planner's chunks and parallel-draft steps, then `HatLoop` (or a keep's prefill alone)."""
    agent, request, session, settings = start.agent, start.request, start.session, start.agent.settings
    speculative = session.draft_config.max_draft > 0 and agent.model.adapter is not None
    pd_candidates = start.option("parallel_candidates") if speculative else 0
    fixed_pd_steps = request.parallel_steps or settings.parallel_steps or 0
    chunking_planned = start.option("prompt_chunking") and not request.chunk_size
    plan = await agent.plan() if chunking_planned or pd_candidates else None
    new_tokens = len(start.ids) - session.commit_len  # a fork's caches already hold the kept prefix
    chunks = (
        agent.edge_plan.chunk_sizes(new_tokens)
        if start.option("prompt_chunking") and agent.edge_plan and not request.chunk_size
        else fixed_chunks(new_tokens, await start.chunk_size(new_tokens, plan))
    )
    keepable = session if isinstance(session, KeepableSession) else None
    cloud = SessionCloud(agent.sessions_cloud, keepable) if keepable is not None else agent.sessions_cloud
    if keepable is not None and request.keep:
        keepable.on_keep = partial(_keep, agent, start.session_id)
    if keepable is not None and keepable.prefill_only:
        overlap = start.option("overlap_prefill")
        return PrefillOnlyLoop(keepable, cloud, start.session_id, chunks, start.offload, overlap)
    return HatLoop(
        session,
        cloud,
        start.session_id,
        chunks,
        offload=start.offload,
        overlap_prefill=start.option("overlap_prefill"),
        parallel_candidates=pd_candidates,
        # PD steps: the request's or the agent's fixed count, else eq. 6 per round for the rows it sends.
        parallel_steps=fixed_pd_steps or (plan.steps_for if plan is not None else 0),
        finish_alone_on=cloud_gone if settings.on_cloud_loss == "finish_on_device" else None,
    )


def _keep(agent: AgentParts, session_id: int, session: KeepableSession):
    """Hand a finished session's caches (and its verifier session) to the kept sessions."""
    tokens = session.prompt_ids + session.generated
    cache_len = min(session.commit_len, len(tokens))
    return agent.kept.keep(
        tokens,
        cache_len,
        session.input_cache,
        session.adapter_cache,
        session_id,
        agent.sessions_cloud.rows(session_id, cache_len),
    )


def _stream_config(start: RoundsStart):
    settings = start.agent.settings
    return stream_config(
        start.option("mode"),
        start.option("stream_group"),
        start.option("stream_window"),
        settings.max_draft,
        start.option("stream_eta_gate"),
        start.option("parallel_candidates"),
        start.request.parallel_steps or settings.parallel_steps or PARALLEL_STEPS_STREAMED,
    )


async def hat_async_loop(start: RoundsStart) -> SessionLoop:
    """hat-async: hidden-state drafts as a stream, chunked prompt (hat_async.py)."""
    prompt_tokens = len(start.session.prompt_ids)
    return HatAsyncLoop(
        start.session,
        start.agent.async_cloud,
        start.session_id,
        fixed_chunks(prompt_tokens, await start.chunk_size(prompt_tokens)),
        _stream_config(start),
        start.offload,
        start.option("overlap_prefill"),
    )


async def token_stream_loop(start: RoundsStart) -> SessionLoop:
    """token-sd / picospec: token-id drafts as a stream, the whole model verifying (token_stream.py)."""
    return TokenStreamLoop(
        start.session,
        start.agent.cloud,
        start.session_id,
        _stream_config(start),
        start.offload,
        start.option("downlink"),
        start.option("top_k"),
    )


async def edge_loop(start: RoundsStart) -> SessionLoop:
    """edge-sd: the agent's edge draft server drafts in batched rounds (its own speed, not this device's)."""
    assert start.agent.edge is not None  # modes.py refuses edge-sd (needs_edge_server) to an agent without one
    return EdgeLoop(start.agent.edge, EdgeRequest(start.session, start.session_id, start.request.snr_db))


async def local_loop(start: RoundsStart) -> SessionLoop:
    """device: the draft model alone, no cloud."""
    return LocalLoop(start.session, start.offload)


async def cloud_loop(start: RoundsStart) -> SessionLoop:
    """cloud: one token per round trip; the device does no model compute (so no slowdown)."""
    request = start.request
    params = SamplingParams(request.temperature, request.top_p, request.seed)
    eos = None if request.ignore_eos else start.agent.model.eos_token_id
    return CloudLoop(start.agent.cloud, start.session_id, start.ids, params, request.max_new_tokens, eos)


SESSION_TYPES: dict[SessionKind, type | None] = {
    "split": DeviceSession,
    "stream": StreamSession,
    "local": LocalSession,
    "none": None,
}
ROUNDS: dict[Rounds, LoopBuilder] = {
    "hat": hat_loop,
    "hat-async": hat_async_loop,
    "token-stream": token_stream_loop,
    "edge": edge_loop,
    "local": local_loop,
    "cloud": cloud_loop,
}
