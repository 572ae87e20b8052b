"""Token mode ("cloud": HAT's whole-model-in-the-cloud baseline) on a real loopback WebSocket.

The verifier is the real VerifierServer with a TokenModel (what
TOPHAT_VERIFIER_FULL_MODEL builds); devices are the device agent's real
WebSocketCloud client, so token ids cross a real socket.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from websockets.asyncio.client import ClientConnection, connect

from services.device_agent import settings as device_settings
from services.device_agent.cloud_client import CloudError, WebSocketCloud
from services.device_agent.token_mode import token_decode
from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.settings import Settings, load_settings
from services.verifier_cloud.token_mode import TokenModel
from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.settings import SettingsError
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from shared.wire import schema as wire
from tests.mesh_tools import CapturingRelay, device_agent_http, split_identity, verifier_on_loopback

M = 2
F32 = wire.WireDtype.F32


def running_verifier(checkpoint, full_model: bool = True, **overrides):
    token_model = TokenModel(checkpoint, M) if full_model else None
    return verifier_on_loopback(checkpoint, M, token_model=token_model, full_model=full_model, **overrides)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


async def cloud_generate(cloud, prompt, session_id, max_new=16, params=SamplingParams(), eos=0):
    tokens = []
    async for emitted in token_decode(cloud, session_id, prompt, params, max_new, eos):
        assert len(emitted) == 1  # autoregressive: one token per round trip
        tokens += emitted
    return tokens


async def roundtrip(ws: ClientConnection, message: wire.Message) -> wire.Message:
    await ws.send(wire.encode(message, wire_dtype=F32))
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


# -- correctness ---------------------------------------------------------------------------------


async def test_greedy_cloud_mode_equals_the_full_model_and_sessions_share_steps(checkpoint):
    prompts = [[(13 * i + j) % 200 + 1 for j in range(4 + 5 * i)] for i in range(6)]
    expected = [generate_full(checkpoint, p, 16).token_ids for p in prompts]
    async with running_verifier(checkpoint) as (server, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size)
        got = await asyncio.gather(*(cloud_generate(cloud, p, 200 + i) for i, p in enumerate(prompts)))
        await cloud.close_connection()
        assert not server.scheduler.sessions  # every token session closed, both caches freed
        steps = list(server.recent_steps)
    assert got == expected
    assert max(s.num_token for s in steps) >= 3  # token sessions were batched into shared passes


async def test_seeded_sampling_draws_what_the_reference_draws(checkpoint):
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    expected = generate_full(checkpoint, prompt, 12, params).token_ids
    async with running_verifier(checkpoint) as (_, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size)
        first = await cloud_generate(cloud, prompt, 1, 12, params)
        again = await cloud_generate(cloud, prompt, 2, 12, params)
        await cloud.close_connection()
    assert first == again == expected


async def test_token_and_hidden_state_sessions_share_the_middle_pass(checkpoint):
    """A full-model verifier still serves HAT sessions; both kinds stay exact when packed together."""
    prompts = [[(7 * i + j) % 200 + 1 for j in range(9)] for i in range(4)]
    expected = [generate_full(checkpoint, p, 14).token_ids for p in prompts]

    async def hat(cloud, prompt, sid):
        device = DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M))
        session = DeviceSession(device, prompt, draft_config=DraftConfig(eta=0.3, max_draft=3), max_new_tokens=14)
        return [
            t
            async for emitted in run_session(
                session, cloud, sid, fixed_chunks(len(prompt), 4), offload=asyncio.to_thread
            )
            for t in emitted
        ]

    async with running_verifier(checkpoint) as (server, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size, F32, **split_identity(checkpoint, M))
        got = await asyncio.gather(
            hat(cloud, prompts[0], 1),
            cloud_generate(cloud, prompts[1], 2, 14),
            hat(cloud, prompts[2], 3),
            cloud_generate(cloud, prompts[3], 4, 14),
        )
        await cloud.close_connection()
        steps = list(server.recent_steps)
    assert got == expected
    assert any(0 < s.num_token < s.num_sessions for s in steps)  # mixed packed passes happened


# -- refusals ------------------------------------------------------------------------------------


async def test_token_messages_on_a_privacy_session_are_privacy_violations(checkpoint):
    hidden = checkpoint.hidden_size
    async with running_verifier(checkpoint) as (server, url):
        async with connect(url) as ws:
            opened = await roundtrip(ws, wire.OpenSession(1, hidden, F32, **split_identity(checkpoint, M)))
            assert isinstance(opened, wire.SessionOpened)
            for message in (wire.TokenPrefill(1, 1, [5, 6, 7]), wire.TokenStep(1, 2, 0, [5])):
                reply = await roundtrip(ws, message)
                assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.PRIVACY_VIOLATION
                assert (reply.session_id, reply.seq_no) == (message.session_id, message.seq_no)
            assert server.runner.sessions[1].middle.length == 0  # nothing ran
            # A hidden-state session opened with privacy off is still not a token session.
            await roundtrip(ws, wire.OpenSession(2, hidden, F32, privacy=False, **split_identity(checkpoint, M)))
            reply = await roundtrip(ws, wire.TokenPrefill(2, 3, [5]))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
            # ...and a token session takes no hidden states (its two caches must stay in step).
            assert isinstance(await roundtrip(ws, wire.OpenTokenSession(3)), wire.SessionOpened)
            reply = await roundtrip(ws, wire.PrefillChunk(3, 4, 0, True, torch.randn(2, hidden)))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
            # Bad ids are refused up front; the session keeps working.
            reply = await roundtrip(ws, wire.TokenPrefill(3, 5, [checkpoint.vocab_size]))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
            reply = await roundtrip(ws, wire.TokenPrefill(3, 6, [5, 6]))
            assert isinstance(reply, wire.TokenResult) and reply.seq_no == 6 and len(reply.token_ids) == 1
            reply = await roundtrip(ws, wire.TokenStep(3, 7, 5, [1]))  # roll back beyond the cache
            assert isinstance(reply, wire.ErrorFrame) and reply.seq_no == 7
            reply = await roundtrip(ws, wire.TokenStep(3, 8, 2, [1]))
            assert isinstance(reply, wire.TokenResult)


async def test_a_verifier_without_the_full_model_refuses_token_sessions(checkpoint):
    async with running_verifier(checkpoint, full_model=False) as (server, url):
        assert server.token_model is None
        async with connect(url) as ws:
            reply = await roundtrip(ws, wire.OpenTokenSession(9, temperature=0.5))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.UNKNOWN_TYPE
            assert reply.session_id == 9 and "FULL_MODEL" in reply.message
        cloud = WebSocketCloud(url, checkpoint.hidden_size)
        with pytest.raises(CloudError) as info:
            await cloud_generate(cloud, [1, 2, 3], 10)
        assert info.value.code == wire.ErrorCode.UNKNOWN_TYPE
        await cloud.close_connection()
        assert not server.scheduler.sessions


def test_full_model_settings():
    assert Settings().full_model is False  # a privacy-mode verifier holds no embeddings or head
    assert load_settings({"TOPHAT_VERIFIER_FULL_MODEL": "true"}).full_model is True
    with pytest.raises(SettingsError, match="pipeline_stages = 1"):
        load_settings({"TOPHAT_VERIFIER_FULL_MODEL": "1", "TOPHAT_VERIFIER_PIPELINE_STAGES": "2"})
    with pytest.raises(SettingsError, match="pipeline_stages = 1"):
        VerifierServer.from_settings(Settings(full_model=True, pipeline_stages=2))
    with pytest.raises(SettingsError, match="mode must be one of"):
        device_settings.load_settings({"TOPHAT_DEVICE_MODE": "edge"})
    assert device_settings.load_settings({"TOPHAT_DEVICE_MODE": "cloud"}).mode == "cloud"


def test_from_settings_builds_the_token_path_only_when_asked(tiny_llama_dir):
    plain = VerifierServer.from_settings(Settings(model_dir=str(tiny_llama_dir), split_layers=M))
    assert plain.token_model is None and plain.runner.token_model is None
    full = VerifierServer.from_settings(Settings(model_dir=str(tiny_llama_dir), split_layers=M, full_model=True))
    assert full.token_model is not None and full.token_model.lower.stop == M


# -- privacy audit -------------------------------------------------------------------------------


async def test_privacy_audit_flags_every_token_frame(checkpoint):
    """What crosses the wire in cloud mode, recorded by a relay: every token-mode frame is flagged."""
    async with running_verifier(checkpoint) as (_, url):
        relay = CapturingRelay(url).start()
        try:
            cloud = WebSocketCloud(relay.url, checkpoint.hidden_size)
            await cloud_generate(cloud, [4, 8, 15, 16], 5, max_new=4)
            await cloud.close_connection()
        finally:
            await asyncio.to_thread(relay.stop)  # the verifier shares this loop: keep it running meanwhile
    kinds = []
    for frame in relay.frames:
        message = wire.decode(frame)
        kinds.append(type(message).__name__)
        if message.carries_token_ids:
            with pytest.raises(wire.WireError) as info:
                wire.assert_privacy_safe(frame)
            assert info.value.code == wire.ErrorCode.PRIVACY_VIOLATION
        else:
            wire.assert_privacy_safe(frame)
    assert kinds[:2] == ["OpenTokenSession", "TokenPrefill"] and kinds[-1] == "CloseSession"
    assert kinds.count("TokenStep") >= 1


# -- the device agent's HTTP API in cloud mode ------------------------------------------------------


async def test_device_agent_streams_cloud_mode_per_request(tiny_llama_dir, checkpoint):
    prompt = [9, 8, 7, 6, 5, 4]
    expected = generate_full(checkpoint, prompt, 10).token_ids
    async with running_verifier(checkpoint) as (server, url):
        async with device_agent_http(tiny_llama_dir, url, M) as http:
            events = {}
            for mode in ("cloud", "hat"):
                body = {"prompt_ids": prompt, "max_new_tokens": 10, "mode": mode, "speculative": False}
                response = await http.post("/generate", json=body)
                assert response.status_code == 200
                events[mode] = [json.loads(line) for line in response.text.splitlines()]
            bad = await http.post("/generate", json={"prompt_ids": prompt, "mode": "edge"})
            assert bad.status_code == 422
            assert (await http.get("/info")).json()["mode"] == "hat"
        assert not server.scheduler.sessions
    cloud = events["cloud"]
    assert cloud[0]["type"] == "start" and cloud[-1]["type"] == "done"
    tokens = [e["token_ids"] for e in cloud if e["type"] == "tokens"]
    assert all(len(t) == 1 for t in tokens)
    assert [t[0] for t in tokens] == expected
    assert cloud[-1]["stats"]["mode"] == "cloud" and cloud[-1]["stats"]["completion_tokens"] == len(expected)
    hat = [t for e in events["hat"] if e["type"] == "tokens" for t in e["token_ids"]]
    assert hat == expected  # same mesh, same verifier, the other mode
