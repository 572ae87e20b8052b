"""token-sd, picospec and hat-async end to end: the demo model and its draft adapter on the device, the real
VerifierServer (with the whole model for token mode) on a loopback WebSocket, the device agent's real client,
and an emulated round trip on the link (the client's in-process delay line).

Greedy output must be token-identical to the unsplit model in every mode at every round trip; sampled
output is checked for distribution in tests/shared/specdec/test_draft_stream.py (the accept rule) — here, that a seeded
sampled stream runs to the end in every mode with sane verdicts.
"""

from __future__ import annotations

import asyncio

import pytest

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.token_mode import TokenModel
from shared.net.links import LinkProfile
from shared.runtime import build_device_model
from shared.specdec.decode_loop import fixed_chunks
from shared.specdec.device_session import DraftConfig
from shared.specdec.hat_async import hat_async_session
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from shared.specdec.stream_engine import StreamConfig, StreamTimings, stream_config
from shared.specdec.stream_session import StreamSession
from shared.specdec.token_stream import token_stream_session
from tests.mesh_tools import split_identity, verifier_on_loopback

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

M = 2
PROMPTS = [[1, 15, 27, 99, 4, 8, 16], [3, 300, 301, 5, 7, 9, 11, 2, 44, 45, 46]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def device_model(demo_checkpoint):
    return build_device_model(demo_checkpoint, M, None)


@pytest.fixture(scope="module")
def unsplit_answers(demo_checkpoint):
    """The unsplit model's greedy answers to PROMPTS, MAX_NEW tokens each: computed once for every mode and RTT."""
    return [generate_full(demo_checkpoint, p, MAX_NEW).token_ids for p in PROMPTS]


def link(rtt_ms: float) -> LinkProfile | None:
    return LinkProfile(float("inf"), float("inf"), rtt_ms / 2e3) if rtt_ms else None


async def decode(
    mode: str,
    cloud: WebSocketCloud,
    session: StreamSession,
    session_id: int,
    config: StreamConfig,
    downlink: str = "topk",
    timings: StreamTimings | None = None,
) -> list[int]:
    tokens: list[int] = []
    if mode == "hat-async":
        rounds = hat_async_session(
            session, cloud, session_id, fixed_chunks(len(session.prompt_ids), 4), config, timings=timings
        )
    else:
        rounds = token_stream_session(session, cloud, session_id, config, downlink=downlink, timings=timings)
    async for emitted in rounds:
        assert emitted, "a delivery holds at least one token"
        tokens += emitted
    return tokens


def configs(mode: str) -> list[StreamConfig]:
    if mode == "token-sd":
        return [StreamConfig(pipelined=False)]
    return [
        StreamConfig(pipelined=True, group=1, window=3),
        StreamConfig(pipelined=True, group=2, window=8, depth=1 if mode == "hat-async" else 0, branches=3),
        stream_config(mode, group=2, window=8, max_draft=6),
    ]  # what the device agent runs


@pytest.mark.parametrize("rtt_ms", [0, 20, 60])
@pytest.mark.parametrize("mode", ["token-sd", "picospec", "hat-async"])
def test_greedy_output_equals_the_unsplit_model(demo_checkpoint, device_model, unsplit_answers, mode, rtt_ms):
    max_new, expected = MAX_NEW, unsplit_answers

    async def main():
        async with verifier_on_loopback(
            demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M), full_model=True
        ) as (server, url):
            cloud = WebSocketCloud(
                url,
                demo_checkpoint.hidden_size,
                link=link(rtt_ms),
                request_timeout_s=30,
                **split_identity(demo_checkpoint, M),
            )
            stats = []
            for c, config in enumerate(configs(mode)):
                for i, prompt in enumerate(PROMPTS):
                    # eta 0 first: no confidence gate, the pipeline runs ahead as far as its window lets it
                    eta = 0.0 if c == 0 else 0.3
                    session = StreamSession(device_model, prompt, SamplingParams(), DraftConfig(eta, 6), max_new)
                    timings = StreamTimings()
                    got = await decode(mode, cloud, session, 100 * c + i + 1, config, timings=timings)
                    assert got == expected[i], (config, i)
                    assert session.generated == got
                    stats.append((timings, session))
            await cloud.close_connection()
            await asyncio.sleep(0.05)
            assert not server.scheduler.sessions  # every session closed, its KV freed
            return stats

    stats = asyncio.run(main())
    verdicts = [v for _, s in stats for v in s.verdicts]
    assert any(accepted > 0 for _, accepted in verdicts), "the draft adapter never got a token accepted"
    if mode != "token-sd" and rtt_ms:
        # the pipeline really ran ahead: some chunks were drafted on a token rejected meanwhile
        assert sum(t.stale_chunks for t, _ in stats) > 0
    if mode != "token-sd":
        # parallel drafting ran, and a pre-drafted branch became the stream at least once (same output)
        assert sum(s.predraft_chances for _, s in stats) > 0 and sum(s.reused_branches for _, s in stats) > 0


# hat-async verifies on the device, which has the whole target row: it has no downlink to choose
@pytest.mark.parametrize(
    "mode, downlink",
    [("token-sd", "topk"), ("token-sd", "full"), ("picospec", "topk"), ("picospec", "full"), ("hat-async", "full")],
)
def test_seeded_sampled_streams_finish_with_consistent_verdicts(demo_checkpoint, device_model, mode, downlink):
    async def main():
        async with verifier_on_loopback(
            demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M), full_model=True
        ) as (server, url):
            cloud = WebSocketCloud(
                url,
                demo_checkpoint.hidden_size,
                link=link(20),
                request_timeout_s=30,
                **split_identity(demo_checkpoint, M),
            )
            out = []
            for seed in range(3):
                session = StreamSession(
                    device_model, PROMPTS[0], SamplingParams(0.8, 1.0, seed), DraftConfig(0.3, 6), 20
                )
                out.append((await decode(mode, cloud, session, seed + 1, configs(mode)[-1], downlink), session))
            await cloud.close_connection()
            return out

    for tokens, session in asyncio.run(main()):
        assert len(tokens) == 20 or tokens[-1] == device_model.eos_token_id
        assert all(0 <= t < device_model.vocab_size for t in tokens)
        assert sum(session.accept_lengths) + 1 == len(tokens)
        assert all(0 <= accepted <= drafted for drafted, accepted in session.verdicts)


# -- the device agent's HTTP API ---------------------------------------------------------------------------


def test_device_agent_serves_the_stream_modes_and_refuses_token_modes_to_privacy_requests(demo_checkpoint):
    import json

    import httpx

    from services.device_agent import settings as device_settings
    from services.device_agent.app import create_app
    from tests.conftest import DEMO_MODEL_DIR

    prompt = PROMPTS[1]
    expected = generate_full(demo_checkpoint, prompt, 16).token_ids

    async def main():
        async with verifier_on_loopback(
            demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M), full_model=True
        ) as (server, url):
            settings = device_settings.Settings(
                model_dir=str(DEMO_MODEL_DIR), split_layers=M, verifier_url=url, prompt_chunking=False, link="lat=10ms"
            )
            app = create_app(settings)
            events, refusals = {}, {}
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app)
                async with httpx.AsyncClient(transport=transport, base_url="http://device", timeout=60) as http:
                    for mode in ("token-sd", "picospec", "hat-async"):
                        body = {
                            "prompt_ids": prompt,
                            "max_new_tokens": 16,
                            "mode": mode,
                            "stream_group": 1,
                            "downlink": "full" if mode == "token-sd" else "topk",
                        }
                        response = await http.post("/generate", json=body)
                        assert response.status_code == 200
                        events[mode] = [json.loads(line) for line in response.text.splitlines()]
                        refused = await http.post("/generate", json={**body, "privacy": True})
                        refusals[mode] = (refused.status_code, refused.json() if refused.status_code != 200 else None)
                    bad = await http.post("/generate", json={"prompt_ids": prompt, "mode": "picospec", "top_k": 0})
                    assert bad.status_code == 422
            await asyncio.sleep(0.05)
            assert not server.scheduler.sessions
            return events, refusals

    events, refusals = asyncio.run(main())
    for mode, stream in events.items():
        assert [t for e in stream if e["type"] == "tokens" for t in e["token_ids"]] == expected, mode
        done = stream[-1]
        assert done["type"] == "done" and done["stats"]["mode"] == mode
        assert done["stats"]["privacy"] is (mode == "hat-async")  # token ids went to the cloud in the others
    for mode in ("token-sd", "picospec"):
        status, body = refusals[mode]
        assert status == 400 and body["error"]["code"] == "privacy"
    assert refusals["hat-async"][0] == 200


# -- the verifier's side of TokenDraft ----------------------------------------------------------------------


def test_the_verifier_refuses_bad_draft_chunks_and_answers_stale_ones_without_running_them(demo_checkpoint):
    from websockets.asyncio.client import connect

    from shared.wire import schema as wire

    hidden = demo_checkpoint.hidden_size

    async def roundtrip(ws, message):
        await ws.send(wire.encode(message))
        return wire.decode(await asyncio.wait_for(ws.recv(), 10))

    async def main():
        async with verifier_on_loopback(
            demo_checkpoint, M, token_model=TokenModel(demo_checkpoint, M), full_model=True
        ) as (server, url):
            async with connect(url) as ws:
                # a privacy session never takes token ids
                await roundtrip(ws, wire.OpenSession(1, hidden, **split_identity(demo_checkpoint, M)))
                reply = await roundtrip(ws, wire.TokenDraft(1, 1, 0, 0, (5, 6), 1, False))
                assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.PRIVACY_VIOLATION
                assert await roundtrip(ws, wire.OpenTokenSession(2)) == wire.SessionOpened(2)
                first = await roundtrip(ws, wire.TokenPrefill(2, 2, PROMPTS[0]))
                start = len(PROMPTS[0])
                caches = server.runner.sessions[2]
                # a continuation chunk with nothing to continue, then ids outside the vocabulary: typed errors
                reply = await roundtrip(ws, wire.TokenDraft(2, 3, 0, start, (5,), 0, True))
                assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
                reply = await roundtrip(ws, wire.TokenDraft(2, 4, 0, start, (demo_checkpoint.vocab_size,), 1, True))
                assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
                assert caches.length == start
                # a draft the target rejects at once: the epoch goes up and the KV keeps the final token only
                wrong = (first.token_ids[0] + 1) % demo_checkpoint.vocab_size
                reply = await roundtrip(ws, wire.TokenDraft(2, 5, 0, start, (first.token_ids[0], wrong, 7), 1, True))
                assert isinstance(reply, wire.TokenVerdict) and reply.rejected and reply.num_accepted == 0
                assert reply.epoch == 1 and reply.token is not None and caches.length == start + 1
                correction = reply.token
                # a chunk drafted before the device heard of the rejection: stale, not run, KV untouched
                reply = await roundtrip(ws, wire.TokenDraft(2, 6, 0, start + 3, (9, 9), 0, True))
                assert isinstance(reply, wire.TokenVerdict) and reply.stale and reply.num_accepted == 0
                assert caches.length == start + 1
                # the session goes on in the new epoch from the correction
                reply = await roundtrip(ws, wire.TokenDraft(2, 7, 1, start + 1, (correction,), 1, False))
                assert isinstance(reply, wire.TokenVerdict) and not reply.stale and not reply.rejected
                assert reply.token is not None and caches.length == start + 2

    asyncio.run(main())
