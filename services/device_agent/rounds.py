"""Per mode, the session the device builds and the loop that turns it into verified tokens.

shared/modes.py's table names both by string (a session kind, a rounds loop); this is the one place
that maps them to classes and loops. Every loop has the same shape: given the agent, the request, its
prompt ids, its session (None when the device builds none), a session id and the device's slowdown, it
does what must come before the engine (a planner's answer) and returns the engine's iterator of the tokens
each verification round makes final, not yet started. Started, the engine owns the session: it frees the
device KV and closes the verifier's session however it ends, so the caller starts it at once and closes it
(contextlib.aclosing) rather than leave that to the garbage collector; a session whose engine was never
started is the caller's to free.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.cloud_errors import cloud_gone
from services.device_agent.edge_server import EdgeDraftServer, EdgeRequest
from services.device_agent.generate_request import GenerateRequest
from services.device_agent.kept import KeepableSession, KeptSessions, SessionCloud, prefill_only
from services.device_agent.plans import Plan
from services.device_agent.settings import Settings
from services.device_agent.token_mode import token_decode
from shared.modes import ModeSpec, Rounds, SessionKind
from shared.planning.device_speed import slowed
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.device_session import DeviceSession, DraftConfig
from shared.specdec.local_decode import LocalSession, local_session
from shared.specdec.sampling import SamplingParams
from shared.specdec.stream_engine import hat_async_session, stream_config, token_stream_session
from shared.specdec.stream_session import StreamSession

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


RoundsLoop = Callable[
    [AgentParts, GenerateRequest, list[int], Any, int, float], Awaitable[AsyncGenerator[list[int], None]]
]


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


async def hat_rounds(
    agent: AgentParts,
    request: GenerateRequest,
    ids: list[int],
    session: DeviceSession,
    session_id: int,
    slowdown: float,
) -> AsyncGenerator[list[int], None]:
    """HAT mode: the tokens each verification round makes final."""
    settings = agent.settings
    speculative = session.draft_config.max_draft > 0 and agent.model.adapter is not None
    pd_candidates = request.option("parallel_candidates", settings) if speculative else 0
    chunking = request.option("prompt_chunking", settings)
    plan = await agent.plan() if (chunking and not request.chunk_size) or pd_candidates else None
    new_tokens = len(ids) - session.commit_len  # a fork's caches already hold the kept prefix
    chunk_size = request.chunk_size if chunking else None
    if chunking and not chunk_size:
        assert plan is not None  # fetched above: chunking without the request's own chunk size
        chunk_size = plan.chunk_for(new_tokens)
    chunks = (
        agent.edge_plan.chunk_sizes(new_tokens)
        if chunking and agent.edge_plan and not request.chunk_size
        else fixed_chunks(new_tokens, chunk_size)
    )
    keepable = session if isinstance(session, KeepableSession) else None
    cloud = SessionCloud(agent.sessions_cloud, keepable) if keepable is not None else agent.sessions_cloud
    # PD steps: the request's or the agent's fixed count, else eq. 6 per round for the rows it sends.
    pd_steps: int | Callable[[int], int] = 0
    if pd_candidates:
        pd_steps = request.parallel_steps or settings.parallel_steps or 0
        if not pd_steps:
            assert plan is not None  # fetched above whenever there are parallel candidates
            pd_steps = plan.steps_for
    offload = partial(slowed, slowdown=slowdown)
    if keepable is not None and keepable.prefill_only:
        rounds = prefill_only(keepable, cloud, session_id, chunks, offload, request.option("overlap_prefill", settings))
    else:
        rounds = run_session(
            session,
            cloud,
            session_id,
            chunks,
            offload=offload,
            overlap_prefill=request.option("overlap_prefill", settings),
            parallel_candidates=pd_candidates,
            parallel_steps=pd_steps,
            finish_alone_on=cloud_gone if settings.on_cloud_loss == "finish_on_device" else None,
        )
    if keepable is not None and request.keep:
        keepable.on_keep = partial(_keep, agent, session_id)
    return rounds


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


def _stream_config(agent: AgentParts, request: GenerateRequest):
    settings = agent.settings
    return stream_config(
        request.option("mode", settings),
        request.option("stream_group", settings),
        request.option("stream_window", settings),
        settings.max_draft,
        request.option("stream_eta_gate", settings),
        request.option("parallel_candidates", settings),
        request.parallel_steps or settings.parallel_steps or PARALLEL_STEPS_STREAMED,
    )


async def hat_async_rounds(
    agent: AgentParts,
    request: GenerateRequest,
    ids: list[int],
    session: StreamSession,
    session_id: int,
    slowdown: float,
) -> AsyncGenerator[list[int], None]:
    """hat-async: hidden-state drafts as a stream, chunked prompt (stream_engine.py)."""
    settings = agent.settings
    chunking = request.option("prompt_chunking", settings)
    plan = await agent.plan() if chunking and not request.chunk_size else None
    chunk_size = request.chunk_size if chunking else None
    if chunking and not chunk_size:
        assert plan is not None  # fetched above: chunking without the request's own chunk size
        chunk_size = plan.chunk_for(len(session.prompt_ids))
    return hat_async_session(
        session,
        agent.async_cloud,
        session_id,
        fixed_chunks(len(session.prompt_ids), chunk_size),
        _stream_config(agent, request),
        partial(slowed, slowdown=slowdown),
        request.option("overlap_prefill", settings),
    )


async def token_stream_rounds(
    agent: AgentParts,
    request: GenerateRequest,
    ids: list[int],
    session: StreamSession,
    session_id: int,
    slowdown: float,
) -> AsyncGenerator[list[int], None]:
    """token-sd / picospec: token-id drafts as a stream, the whole model verifying (stream_engine.py)."""
    settings = agent.settings
    return token_stream_session(
        session,
        agent.cloud,
        session_id,
        _stream_config(agent, request),
        partial(slowed, slowdown=slowdown),
        request.option("downlink", settings),
        request.option("top_k", settings),
    )


async def edge_rounds(
    agent: AgentParts,
    request: GenerateRequest,
    ids: list[int],
    session: StreamSession,
    session_id: int,
    slowdown: float,
) -> AsyncGenerator[list[int], None]:
    """edge-sd: the agent's edge draft server drafts in batched rounds (its own speed, not this device's)."""
    assert agent.edge is not None  # modes.py refuses edge-sd (needs_edge_server) to an agent without one
    return agent.edge.generate(EdgeRequest(session, session_id, request.snr_db))


async def local_rounds(
    agent: AgentParts, request: GenerateRequest, ids: list[int], session: LocalSession, session_id: int, slowdown: float
) -> AsyncGenerator[list[int], None]:
    """device: the draft model alone, no cloud."""
    return local_session(session, partial(slowed, slowdown=slowdown))


async def cloud_rounds(
    agent: AgentParts, request: GenerateRequest, ids: list[int], session: None, session_id: int, slowdown: float
) -> AsyncGenerator[list[int], None]:
    """cloud: one token per round trip; the device does no model compute (so no slowdown)."""
    params = SamplingParams(request.temperature, request.top_p, request.seed)
    eos = None if request.ignore_eos else agent.model.eos_token_id
    return token_decode(agent.cloud, session_id, ids, params, request.max_new_tokens, eos)


SESSION_TYPES: dict[SessionKind, type | None] = {
    "split": DeviceSession,
    "stream": StreamSession,
    "local": LocalSession,
    "none": None,
}
ROUNDS: dict[Rounds, RoundsLoop] = {
    "hat": hat_rounds,
    "hat-async": hat_async_rounds,
    "token-stream": token_stream_rounds,
    "edge": edge_rounds,
    "local": local_rounds,
    "cloud": cloud_rounds,
}
