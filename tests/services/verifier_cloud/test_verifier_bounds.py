"""Per-device bounds of the real verifier on a loopback WebSocket: sessions per connection,
queued items per session, idle sessions closed after their TTL."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from websockets.asyncio.client import connect

from services.verifier_cloud.settings import Settings, load_settings
from shared.model.checkpoint import load_checkpoint
from shared.settings import SettingsError
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
F32 = wire.WireDtype.F32


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


async def roundtrip(ws, message: wire.Message) -> wire.Message:
    await ws.send(wire.encode(message, wire_dtype=F32))
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


def open_message(checkpoint, sid: int) -> wire.OpenSession:
    return wire.OpenSession(sid, checkpoint.hidden_size, F32, **split_identity(checkpoint, M))


async def test_one_connection_cannot_lock_other_devices_out(checkpoint):
    async with verifier_on_loopback(checkpoint, M, max_sessions_per_connection=2) as (server, url):
        async with connect(url) as greedy, connect(url) as other:
            for sid in (1, 2):
                assert isinstance(await roundtrip(greedy, open_message(checkpoint, sid)), wire.SessionOpened)
            refused = await roundtrip(greedy, open_message(checkpoint, 3))
            assert isinstance(refused, wire.ErrorFrame) and refused.code == wire.ErrorCode.OVERLOADED
            assert refused.session_id == 3 and 3 not in server.scheduler.sessions
            assert isinstance(await roundtrip(other, open_message(checkpoint, 4)), wire.SessionOpened)


async def test_a_session_cannot_queue_without_bound(checkpoint):
    hidden = checkpoint.hidden_size
    async with verifier_on_loopback(checkpoint, M, max_queue_per_session=2) as (server, url):
        async with connect(url) as ws:
            for sid in (1, 9):
                await roundtrip(ws, open_message(checkpoint, sid))
            assert isinstance(
                await roundtrip(ws, wire.PrefillChunk(1, 1, 0, True, torch.randn(3, hidden))), wire.DeepHidden
            )
            # Hold the engine on session 9's step, so session 1's verifies stay queued.
            entered, gate, execute = [], threading.Event(), server.engine.execute
            server.engine.execute = lambda batch: (entered.append(1), gate.wait(10), execute(batch))[2]
            await ws.send(wire.encode(wire.PrefillChunk(9, 1, 0, True, torch.randn(2, hidden)), wire_dtype=F32))
            for _ in range(1000):
                if entered:
                    break
                await asyncio.sleep(0.01)
            assert entered, "the engine never started session 9's step"
            for seq in (2, 3, 4, 5):
                await ws.send(wire.encode(wire.VerifyRequest(1, seq, 3, torch.randn(1, hidden)), wire_dtype=F32))
            refusals = [wire.decode(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
            assert [(r.code, r.seq_no) for r in refusals] == [
                (wire.ErrorCode.OVERLOADED, 4),
                (wire.ErrorCode.OVERLOADED, 5),
            ]
            gate.set()
            answers = [wire.decode(await asyncio.wait_for(ws.recv(), 10)) for _ in range(3)]
            assert sorted((type(a).__name__, a.seq_no) for a in answers) == [
                ("DeepHidden", 1),
                ("VerifyResult", 2),
                ("VerifyResult", 3),
            ]


async def test_an_idle_session_is_closed_and_its_kv_freed(checkpoint):
    hidden = checkpoint.hidden_size
    async with verifier_on_loopback(checkpoint, M, session_idle_ttl_s=0.3) as (server, url):
        async with connect(url) as ws:
            await roundtrip(ws, open_message(checkpoint, 1))
            await roundtrip(ws, wire.PrefillChunk(1, 1, 0, True, torch.randn(3, hidden)))
            cache = server.runner.sessions[1].middle
            for _ in range(200):  # bounded: the sweep runs a few times per TTL
                if 1 not in server.scheduler.sessions:
                    break
                await asyncio.sleep(0.05)
            assert 1 not in server.scheduler.sessions and cache.is_freed
            reply = await roundtrip(ws, wire.VerifyRequest(1, 2, 3, torch.randn(1, hidden)))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.UNKNOWN_SESSION
            # The connection itself stays: the device opens a new session on it.
            assert isinstance(await roundtrip(ws, open_message(checkpoint, 2)), wire.SessionOpened)


def test_bound_settings():
    defaults = Settings()
    assert defaults.max_sessions_per_connection < defaults.max_sessions
    assert load_settings({"TOPHAT_VERIFIER_SESSION_IDLE_TTL_S": "30"}).session_idle_ttl_s == 30.0
    for name in ("MAX_SESSIONS_PER_CONNECTION", "MAX_QUEUE_PER_SESSION", "SESSION_IDLE_TTL_S"):
        with pytest.raises(SettingsError):
            load_settings({f"TOPHAT_VERIFIER_{name}": "0"})
