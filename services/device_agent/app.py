"""The device agent's local HTTP API: submit a prompt, stream tokens as they are accepted.

    POST /generate  {"prompt"|"prompt_ids"|"messages", ...}  (messages: the chat template is applied here,
                    where the tokenizer lives; shared/chat.py) -> application/x-ndjson, one event per line:
        {"type":"start", "request_id", "prompt_tokens"}
        {"type":"tokens", "token_ids", "text", "t"}           (one per verification round)
        {"type":"heartbeat", "t"}     (after heartbeat_s without a line: waiting, e.g. in the verifier's queue)
        {"type":"done", "finish_reason", "stats"[, "kept": {"handle", "length"}]} | {"type":"error", "code", "message"}
    DELETE /kept/{handle}  free a kept session (404 if unknown)
    GET /info, /healthz, /readyz

Kept sessions (mode hat; kept.py): `"keep": true` keeps a request's KV, device and verifier side, once it
finishes normally, under the handle its done event carries (`max_new_tokens` 0 with keep: prefill only);
`"fork": handle` makes the request's prompt a continuation of that kept sequence (prompt + generated),
starting from copies of its KV: only the continuation is computed. An unknown handle is a 404 whose error
has type `unknown_kept_session`.

Modes, per agent (`mode` setting) or per request (`"mode"` in the body; shared/modes.py's table says
what each builds and needs, and its refusals; rounds.py runs them):
`hat` (HAT: U-shaped split, hidden states only, with the SD/PC/PD switches), `hat-async`,
`cloud` (HAT's cloud baseline: the device tokenizes and sends token ids, the
verifier, started with TOPHAT_VERIFIER_FULL_MODEL, runs the whole model and
samples one token per round trip; no privacy, and SD/PC/PD do not apply), the token
modes `token-sd` / `picospec` / `edge-sd`, and `device` (DiSCo's on-device endpoint: the
draft model alone, no cloud). All stream the same events. `prefix_ids` continue an answer
another endpoint began (DiSCo's migration): read after the prompt, never re-sent.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse

from services.device_agent.admission import AdmittedStream
from services.device_agent.agent import DeviceAgent
from services.device_agent.generate_request import GenerateRequest
from services.device_agent.kept import KeepableSession, KeptSession, UnknownKeptSession
from services.device_agent.rounds import build_session
from services.device_agent.service import DeviceService, service_of
from services.device_agent.settings import Settings
from shared.auth import verify as auth
from shared.jupiter.outline import advertised_chat_format
from shared.modes import MODE_TABLE, Asked, ModeSpec, Offered
from shared.runtime import encode_prompt
from shared.specdec.device_session import SessionError
from shared.specdec.sampling import SamplingParams
from shared.telemetry.metrics import metrics_response

Service = Annotated[DeviceService, Depends(service_of)]

probes = APIRouter()  # open to anyone: a supervisor's or an orchestrator's checks
api = APIRouter()  # a service's, with a token for this device (create_app installs the check)


def error_response(status: int, code: str, message: str, **detail) -> JSONResponse:
    # "type" repeats the code: the kept-session errors were specified with it (OpenAI's error shape)
    return JSONResponse(
        status_code=status, content={"error": {"code": code, "type": code, "message": message, **detail}}
    )


class Refused(Exception):
    """A /generate request answered with an error before it is admitted: error_response's arguments."""

    def __init__(self, status: int, code: str, message: str, **detail) -> None:
        super().__init__(message)
        self.response = error_response(status, code, message, **detail)


@probes.get("/healthz")
async def healthz():
    return {"status": "ok"}


@probes.get("/readyz")
async def readyz(service: Service):
    if service.agent is None:
        return error_response(503, "starting", "model still loading")
    cloud = service.agent.cloud
    if not cloud.ready:  # the readiness loop's cached answer: no network call per probe
        return error_response(503, "verifier_unavailable", cloud.not_ready_reason)
    if not service.agent.probes.first_probe_done:
        return error_response(503, "measuring_link", "the first bandwidth probe to the verifier is running")
    return {"status": "ready", "device_id": service.settings.device_id}


@probes.get("/metrics")
async def metrics(service: Service):
    return metrics_response(service.agent.metrics.registry if service.agent is not None else None)


@api.get("/info")
async def info(service: Service):
    agent, settings = service.loaded, service.settings
    shape, shape_source = agent.current_shape()
    return {
        "device_id": settings.device_id,
        "model": agent.checkpoint.path.name,
        "active_sessions": agent.active,
        "max_sessions": settings.max_sessions,
        "speculative": settings.speculative,
        "split_layers": settings.split_layers,
        "mode": settings.mode,
        "bytes_per_token": agent.bytes_per_token,
        "speed": settings.speed,
        "eos_token_id": agent.model.eos_token_id,
        "kept_sessions": len(agent.kept),
        "draft_shape": shape,  # what hat requests draft now (the web console's mesh table)
        "draft_shape_source": shape_source,
        # the template's text between turns: the streamer's outline requests (shared/jupiter/outline.py)
        "chat_format": advertised_chat_format(agent.checkpoint.tokenizer),
    }


@api.get("/edge-sd/rounds")
async def edge_rounds(service: Service):
    agent = service.loaded
    if agent.edge is None:
        return error_response(404, "not_an_edge_server", "this agent is not an edge draft server")
    return {"rounds": [asdict(r) for r in agent.edge.rounds]}


@api.delete("/kept/{handle}")
async def delete_kept(handle: str, service: Service):
    if not await service.loaded.kept.delete(handle):
        return error_response(404, "unknown_kept_session", f"no kept session {handle!r} (deleted, expired or evicted)")
    return {"deleted": handle}


@api.post("/generate")
async def generate(request: GenerateRequest, service: Service):
    agent, settings = service.loaded, service.settings
    if agent.active >= settings.max_sessions:
        return error_response(503, "busy", f"device {settings.device_id} is serving {agent.active} sessions")
    request = _served_as(agent, settings, request)
    try:
        ids, session, shape = _prepared_session(agent, settings, request)
    except Refused as refused:
        return refused.response
    except UnknownKeptSession:
        return error_response(
            404,
            "unknown_kept_session",
            f"no kept session {request.fork!r} (never kept, deleted, expired or evicted)",
        )
    except (SessionError, ValueError) as exc:
        return error_response(400, "bad_request", str(exc))
    admission = agent.admit(session)  # given back however the client goes away, even before the first event
    request_id = request.request_id or uuid.uuid4().hex
    return AdmittedStream(agent.stream(request, ids, session, request_id, admission, shape), admission)


def _served_as(agent: DeviceAgent, settings: Settings, request: GenerateRequest) -> GenerateRequest:
    """hat-async is HAT's chain rounds plus drafting ahead while a chain is verified: where the draft budget has
    this device on another shape now (no drafts on a loaded verifier, a tree where rows are cheap), or hat-async
    measured slower than HAT's chain rounds (`DeviceAgent.serves_async`), HAT's own rounds serve the request
    (the done event's stats say mode hat). A request that names its shape, or a seeded sampled one (its answer
    must not depend on the load), keeps hat-async."""
    if request.option("mode", settings) != "hat-async" or request.draft_shape is not None:
        return request
    if request.seed is not None and request.temperature > 0:
        return request
    # what hat-async refuses (no drafting, a keep or a fork) it still refuses: HAT's rounds would serve it
    if request.keep or request.fork is not None or not request.option("speculative", settings):
        return request
    return request if agent.serves_async() else request.model_copy(update={"mode": "hat"})


def _prepared_session(
    agent: DeviceAgent, settings: Settings, request: GenerateRequest
) -> tuple[list[int], Any, str | None]:
    """A /generate request's prompt ids, device session (None in a mode without one) and measured draft shape.
    Raises Refused, UnknownKeptSession (a fork of an unknown handle), SessionError or ValueError (a bad prompt)."""
    spec = MODE_TABLE[request.option("mode", settings)]
    speculative = request.option("speculative", settings)
    ids = _prompt_ids(agent, request)
    params = SamplingParams(request.temperature, request.top_p, request.seed)
    if request.max_new_tokens == 0 and not request.keep:
        raise Refused(400, "bad_request", "max_new_tokens 0 (prefill only) needs keep: true")
    # A fork's handle is looked up before the mode's needs are checked (an unknown one is a 404 whatever else is
    # wrong); in a mode without kept sessions the refusal below says so instead.
    parent = agent.kept.get(request.fork) if request.fork is not None and spec.keepable else None
    if parent is not None:  # the prompt continues the kept sequence
        ids = parent.token_ids + ids
        if len(ids) <= parent.cache_len:
            raise Refused(400, "bad_request", "a fork needs a continuation: the kept sequence is all cached")
    _check_mode(agent, settings, request, spec, speculative, ids)
    max_draft = settings.max_draft if speculative else 0
    draft_config, shape, trial = agent.draft_config(spec.rounds, max_draft, request.draft_shape, params)
    session = build_session(
        spec,
        agent.model,
        ids,
        params,
        draft_config,
        max(request.max_new_tokens, 1),  # 0 (prefill only) never reaches a decode step
        keepable=request.keep or parent is not None,
    )
    if session is not None:
        session.ignore_eos = request.ignore_eos
        session.trial = trial
    if isinstance(session, KeepableSession):
        _keep_or_fork(session, request, parent)
    return ids, session, shape


def _prompt_ids(agent: DeviceAgent, request: GenerateRequest) -> list[int]:
    """The prompt's token ids (a conversation rendered with the chat template here), then any prefix ids."""
    messages = None if request.messages is None else [m.model_dump() for m in request.messages]
    ids = encode_prompt(agent.checkpoint, request.prompt, request.prompt_ids, messages)
    if request.prefix_ids:
        ids = ids + encode_prompt(agent.checkpoint, None, request.prefix_ids)  # checked like prompt ids
    return ids


def _check_mode(
    agent: DeviceAgent, settings: Settings, request: GenerateRequest, spec: ModeSpec, speculative: bool, ids: list[int]
) -> None:
    """Refused when the mode cannot serve what the request asks with what this agent offers (shared/modes.py)."""
    asked = Asked(
        privacy=bool(request.privacy),
        keep_or_fork=request.keep or request.fork is not None,
        speculative=speculative,
    )
    offered = Offered(
        draft_adapter=agent.model.adapter is not None,
        max_draft=settings.max_draft,
        edge_server=agent.edge is not None,
    )
    if (refusal := spec.refusal(asked, offered)) is not None:
        raise Refused(refusal.status, refusal.code, refusal.message, **dict(refusal.detail))
    if not spec.uses_device_model and not ids:  # a device session refuses an empty prompt itself
        raise Refused(400, "bad_request", "the prompt is empty")


def _keep_or_fork(session: KeepableSession, request: GenerateRequest, parent: KeptSession | None) -> None:
    session.prefill_only = request.max_new_tokens == 0
    if parent is not None:
        session.start_from(parent)


def create_app(settings: Settings, agent: DeviceAgent | None = None) -> FastAPI:
    service = DeviceService(settings, agent)
    app = FastAPI(title=f"tophat device agent {settings.device_id}", lifespan=service.lifespan)
    app.state.service = service
    # /generate and /info answer a service only, with a token for this device (its audience); the probes stay
    # open.
    auth.warn_if_open(
        f"device agent {settings.device_id}", settings.authenticated, settings.host, "TOPHAT_DEVICE_AUTH_ISSUER_URL"
    )
    auth.install(app, service.trust, auth.device_audience(settings.device_id), {"service"})
    app.include_router(probes)
    app.include_router(api)
    return app
