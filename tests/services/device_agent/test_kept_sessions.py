"""Kept sessions and forks (issue 15's outline decoding): a real device agent app on real verifiers (P = 1 in
this event loop, P = 2 with its stage worker processes), greedy, the demo model.

A fork must give exactly the tokens of the plain request whose prompt is the kept sequence + the
continuation, compute only the continuation, leave the kept session intact for other forks (also concurrent
ones), and a kept session must go away when deleted, evicted or expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import pytest_asyncio

from services.device_agent.cloud_client import CloudError, WebSocketCloud
from services.device_agent.kept import KeptSessions
from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.settings import Settings
from shared.model.kv_cache import SessionKV
from shared.wire import schema as wire
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import device_agent_http, serving_verifier, split_identity, verifier_on_loopback

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_KEPT = 3


@contextlib.asynccontextmanager
async def pipelined_verifier(stages: int):
    server = VerifierServer.from_settings(
        Settings(port=0, split_layers=2, model_dir=str(DEMO_MODEL_DIR), pipeline_stages=stages, stage_timeout_s=60.0)
    )
    async with serving_verifier(server, start_timeout_s=120) as url:
        yield server, url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(demo_checkpoint):
    """(verifier server in this event loop, its ws URL, a device agent's http client on it), once per module."""
    async with verifier_on_loopback(demo_checkpoint) as (server, url):
        async with device_agent_http(DEMO_MODEL_DIR, url, adapter="", max_kept=MAX_KEPT) as http:
            yield server, url, http


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pipelined_agent():
    """(a verifier with 2 pipeline stage processes, a device agent's http client on it)."""
    async with pipelined_verifier(2) as (server, url):
        async with device_agent_http(DEMO_MODEL_DIR, url, adapter="", max_kept=MAX_KEPT) as http:
            yield server, http


async def generate(http, **body) -> tuple[list[int], dict]:
    """Token ids and the done event of one /generate (greedy)."""
    response = await http.post("/generate", json={"temperature": 0.0, **body})
    assert response.status_code == 200, response.text
    events = [json.loads(line) for line in response.text.splitlines()]
    assert events[-1]["type"] == "done", events[-1]
    return [t for e in events if e["type"] == "tokens" for t in e["token_ids"]], events[-1]


def ids(checkpoint, text: str) -> list[int]:
    return checkpoint.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def texts(demo_checkpoint):
    directive = ids(demo_checkpoint, "You answer with a short numbered outline, then expand each point. Question:")
    points = [
        ids(demo_checkpoint, " 1. Why the sky is blue."),
        ids(demo_checkpoint, " 2. How rain forms over the sea."),
    ]
    return directive, points


def prefill_tokens(server: VerifierServer) -> int:
    return sum(tokens for step in server.recent_steps for _sid, kind, tokens in step.items if kind == "prefill")


async def test_a_fork_of_a_kept_prompt_is_the_plain_request_and_prefills_only_its_continuation(agent, texts):
    server, _, http = agent
    directive, (point, _) = texts
    plain, _ = await generate(http, prompt_ids=directive + point, max_new_tokens=12)
    _, kept = await generate(http, prompt_ids=directive, max_new_tokens=0, keep=True)
    assert kept["kept"]["length"] == len(directive) and kept["stats"]["completion_tokens"] == 0
    server.recent_steps.clear()
    forked, done = await generate(http, prompt_ids=point, fork=kept["kept"]["handle"], max_new_tokens=12)
    assert forked == plain
    # Only the continuation went through the verifier's prefill; the directive's KV was copied.
    assert prefill_tokens(server) == len(point)
    assert done["stats"]["cached_tokens"] == len(directive)
    assert done["stats"]["prompt_tokens"] == len(directive + point)
    assert "kept" not in done  # not asked to keep


async def test_concurrent_forks_of_a_kept_answer_are_independent_and_exact(agent, texts):
    _, _, http = agent
    directive, points = texts
    # keep a prompt with its answer: a fork continues prompt + generated (the last token not yet in the KV)
    answer, kept = await generate(http, prompt_ids=directive, max_new_tokens=5, keep=True)
    assert kept["kept"]["length"] == len(directive) + len(answer)
    handle = kept["kept"]["handle"]
    plains = [(await generate(http, prompt_ids=directive + answer + p, max_new_tokens=10))[0] for p in points]
    forks = await asyncio.gather(*(generate(http, prompt_ids=p, fork=handle, max_new_tokens=10) for p in points))
    assert [tokens for tokens, _ in forks] == plains
    assert plains[0] != plains[1]  # the two continuations really differ
    again, _ = await generate(http, prompt_ids=points[0], fork=handle, max_new_tokens=10)
    assert again == plains[0]  # the kept session is intact after being forked


async def test_a_chain_of_forks_keeps_and_forks_again(agent, texts):
    _, _, http = agent
    directive, (point, other) = texts
    plain, _ = await generate(http, prompt_ids=directive + point + other, max_new_tokens=8)
    _, first = await generate(http, prompt_ids=directive, max_new_tokens=0, keep=True)
    _, second = await generate(http, prompt_ids=point, fork=first["kept"]["handle"], max_new_tokens=0, keep=True)
    assert second["kept"]["length"] == len(directive + point)
    forked, done = await generate(http, prompt_ids=other, fork=second["kept"]["handle"], max_new_tokens=8)
    assert forked == plain and done["stats"]["cached_tokens"] == len(directive + point)


async def test_unknown_deleted_and_evicted_handles_are_typed_404s_and_free_the_verifier(agent, texts):
    server, _, http = agent
    directive, (point, _) = texts
    response = await http.post("/generate", json={"prompt_ids": point, "fork": "no-such-handle"})
    assert response.status_code == 404 and response.json()["error"]["type"] == "unknown_kept_session"
    assert (await http.delete("/kept/no-such-handle")).status_code == 404

    async def kept_here_and_on_the_verifier() -> tuple[int, int]:
        """(kept sessions on the device, sessions on the verifier), once the verifier's count settled: a kept
        session holds one verifier session; dropped ones are closed by the agent's cleanup task."""
        for _ in range(200):
            kept = (await http.get("/info")).json()["kept_sessions"]
            if len(server.scheduler.sessions) == kept:
                break
            await asyncio.sleep(0.05)
        return kept, len(server.scheduler.sessions)

    _, kept = await generate(http, prompt_ids=directive, max_new_tokens=0, keep=True)
    count, held = await kept_here_and_on_the_verifier()
    assert count == held >= 1
    handle = kept["kept"]["handle"]
    assert (await http.delete(f"/kept/{handle}")).status_code == 200
    assert await kept_here_and_on_the_verifier() == (count - 1, count - 1)
    response = await http.post("/generate", json={"prompt_ids": point, "fork": handle})
    assert response.status_code == 404 and response.json()["error"]["type"] == "unknown_kept_session"
    # past max_kept the least recently used goes (device caches and the verifier's session)
    handles = [
        (await generate(http, prompt_ids=directive, max_new_tokens=0, keep=True))[1]["kept"]["handle"]
        for _ in range(MAX_KEPT + 1)
    ]
    assert await kept_here_and_on_the_verifier() == (MAX_KEPT, MAX_KEPT)
    assert (await http.post("/generate", json={"prompt_ids": point, "fork": handles[0]})).status_code == 404
    for handle in handles[1:]:
        assert (await http.delete(f"/kept/{handle}")).status_code == 200
    assert await kept_here_and_on_the_verifier() == (0, 0)


async def test_keep_and_fork_are_refused_outside_hat_and_prefill_only_needs_keep(agent, texts):
    _, _, http = agent
    directive, _ = texts
    response = await http.post("/generate", json={"prompt_ids": directive, "keep": True, "mode": "device"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "kept_sessions_unsupported"
    assert response.json()["error"]["mode"] == "device"
    response = await http.post("/generate", json={"prompt_ids": directive, "max_new_tokens": 0})
    assert response.status_code == 400


@pytest.mark.slow
async def test_a_fork_through_two_pipeline_stages_is_exact(pipelined_agent, texts):
    server, http = pipelined_agent
    directive, points = texts
    answer, kept = await generate(http, prompt_ids=directive, max_new_tokens=4, keep=True)
    plains = [(await generate(http, prompt_ids=directive + answer + p, max_new_tokens=10))[0] for p in points]
    forks = await asyncio.gather(
        *(generate(http, prompt_ids=p, fork=kept["kept"]["handle"], max_new_tokens=10) for p in points)
    )
    assert [tokens for tokens, _ in forks] == plains
    # Every stage copied the kept KV: one token costs the stages only the continuation's rows (no replay).
    server.pipeline.recent.clear()
    first, _ = await generate(http, prompt_ids=points[0], fork=kept["kept"]["handle"], max_new_tokens=1)
    assert first == plains[0][:1]
    assert sum(step.batched_tokens for step in server.pipeline.recent) == 1 + len(points[0])  # pending token + point


async def test_the_verifier_refuses_a_fork_of_an_unknown_parent_or_beyond_its_length(agent, demo_checkpoint):
    server, url, _ = agent
    cloud = WebSocketCloud(url, demo_checkpoint.hidden_size, **split_identity(demo_checkpoint))
    try:
        with pytest.raises(CloudError) as info:
            await cloud.fork(11, 12345, 0)
        assert info.value.code == wire.ErrorCode.UNKNOWN_SESSION
        await cloud.open(12)
        with pytest.raises(CloudError) as info:
            await cloud.fork(13, 12, 5)  # the parent holds no position yet
        assert info.value.code == wire.ErrorCode.BAD_SHAPE
        await cloud.fork(14, 12, 0)  # a fork of the empty prefix is a fresh session
        assert 14 in server.scheduler.sessions and 13 not in server.scheduler.sessions
    finally:
        await cloud.close_connection()


async def test_kept_sessions_expire_after_their_ttl_since_last_use_and_close_the_verifier_session():
    now = [0.0]
    closed: list[int] = []

    async def close(session_id: int) -> None:
        closed.append(session_id)

    kept = KeptSessions(ttl_s=10.0, max_kept=4, close_cloud=close, clock=lambda: now[0])

    def cache() -> SessionKV:
        return SessionKV(1, 1, 2)

    a = kept.keep([1, 2], 2, cache(), None, 101, [])
    b = kept.keep([1, 2], 2, cache(), cache(), 102, [])
    now[0] = 8.0
    kept.get(b.handle)  # used: its TTL starts again
    now[0] = 12.0
    assert kept.expire() == 1 and a.input_cache.is_freed and not b.input_cache.is_freed
    with pytest.raises(KeyError):
        kept.get(a.handle)
    await kept.flush()
    assert closed == [101]
    now[0] = 18.5
    assert kept.expire() == 1 and b.adapter_cache.is_freed and len(kept) == 0


@pytest.mark.slow
async def test_a_fork_of_a_kept_session_the_verifier_lost_is_replayed_and_exact(agent, texts):
    server, _, http = agent
    directive, (point, _) = texts
    plain, _ = await generate(http, prompt_ids=directive + point, max_new_tokens=8)
    before = set(server.scheduler.sessions)
    _, kept = await generate(http, prompt_ids=directive, max_new_tokens=0, keep=True)
    (lost,) = set(server.scheduler.sessions) - before
    server.sessions.close(lost)  # as the idle sweep or a restart would: the device still holds its handle
    server.recent_steps.clear()
    forked, _ = await generate(http, prompt_ids=point, fork=kept["kept"]["handle"], max_new_tokens=8)
    assert forked == plain
    assert prefill_tokens(server) == len(directive + point)  # the fork's session was rebuilt from the kept rows
    assert (await http.delete(f"/kept/{kept['kept']['handle']}")).status_code == 200
