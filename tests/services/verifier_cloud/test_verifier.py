"""verifier-cloud in-process on a real loopback WebSocket: batching, bad frames, disconnects.

The server is the real VerifierServer; devices are real WebSocketCloud clients
(the device agent's transport), so everything crosses a real socket.
"""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest
import torch
from websockets.asyncio.client import connect

from services.device_agent.cloud_client import CloudError, WebSocketCloud
from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2


def running_verifier(checkpoint, **overrides):
    return verifier_on_loopback(checkpoint, M, **overrides)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


async def generate_over_ws(checkpoint, cloud, prompt, session_id, max_new=16, chunk=4, wire_dtype=None):
    device = DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M))
    session = DeviceSession(device, prompt, draft_config=DraftConfig(eta=0.3, max_draft=4), max_new_tokens=max_new)
    tokens = []
    async for emitted in run_session(
        session, cloud, session_id, fixed_chunks(len(prompt), chunk), offload=asyncio.to_thread
    ):
        tokens += emitted
    return tokens


@pytest.mark.slow
async def test_concurrent_sessions_are_batched_and_exact(checkpoint):
    prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(8)]
    expected = [generate_full(checkpoint, p, 16).token_ids for p in prompts]
    steps = []
    async with running_verifier(checkpoint) as (server, url):
        original = server.engine.execute

        def recording_execute(batch):
            results, stats = original(batch)
            steps.append(stats)
            return results, stats

        server.engine.execute = recording_execute
        cloud = WebSocketCloud(url, checkpoint.hidden_size, wire.WireDtype.F32, **split_identity(checkpoint, M))
        got = await asyncio.gather(*(generate_over_ws(checkpoint, cloud, p, 100 + i) for i, p in enumerate(prompts)))
        await cloud.close_connection()
        assert not server.scheduler.sessions  # every session closed and freed
    assert got == expected
    assert max(s.num_sessions for s in steps) >= 4  # sessions shared forward passes
    assert any(s.num_prefill and s.num_verify for s in steps) or max(s.num_sessions for s in steps) >= 4


async def test_fp16_wire_keeps_greedy_output_on_this_model(checkpoint):
    prompt = [5, 17, 33, 2, 9]
    expected = generate_full(checkpoint, prompt, 16).token_ids  # the unsplit model, fp32 all the way
    async with running_verifier(checkpoint) as (_, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size, wire.WireDtype.F16, **split_identity(checkpoint, M))
        tokens = await generate_over_ws(checkpoint, cloud, prompt, 7)
        await cloud.close_connection()
    assert tokens == expected  # rounding the boundary states to fp16 changes no greedy token on this model


def raw_prefill(hidden: int, dtype: str = "f2", data: bytes = b"") -> bytes:
    """A prefill frame built by hand, to say things the typed encoder refuses to say."""
    tensor = {"d": dtype, "s": [3, hidden], "b": data}
    return msgpack.packb({"v": wire.WIRE_VERSION, "t": 0x10, "s": 1, "q": 9, "p": 0, "l": True, "h": tensor})


async def _roundtrip(ws, frame: bytes) -> wire.Message:
    await ws.send(frame)
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


async def test_bad_frames_get_typed_errors_and_the_connection_survives(checkpoint):
    hidden = checkpoint.hidden_size
    async with running_verifier(checkpoint, max_frame_bytes=64 * 1024) as (server, url):
        async with connect(url) as ws:
            opened = await _roundtrip(ws, wire.encode(wire.OpenSession(1, hidden, **split_identity(checkpoint, M))))
            assert isinstance(opened, wire.SessionOpened)
            good = wire.encode(wire.PrefillChunk(1, 1, 0, True, torch.randn(3, hidden)))
            cases = {
                wire.ErrorCode.MALFORMED: b"\xc1not msgpack",
                wire.ErrorCode.UNKNOWN_TYPE: wire.encode(
                    wire.OpenSession(2, hidden, **split_identity(checkpoint, M))
                ).replace(b"\xa1t\x01", b"\xa1t\x66"),
                wire.ErrorCode.BAD_DTYPE: raw_prefill(hidden, dtype="i8", data=b"\0" * (3 * hidden * 8)),
                wire.ErrorCode.BAD_SHAPE: wire.encode(wire.PrefillChunk(1, 2, 0, True, torch.randn(3, hidden + 1))),
                wire.ErrorCode.LENGTH_MISMATCH: raw_prefill(hidden, data=b"\0" * 10),
                wire.ErrorCode.UNKNOWN_SESSION: wire.encode(wire.VerifyRequest(999, 3, 0, torch.randn(1, hidden))),
            }
            for code, frame in cases.items():
                reply = await _roundtrip(ws, frame)
                assert isinstance(reply, wire.ErrorFrame), code
                assert reply.code == code, (code, reply)
            # The unknown session error is addressed to the session and seq it concerned.
            reply = await _roundtrip(ws, cases[wire.ErrorCode.UNKNOWN_SESSION])
            assert (reply.session_id, reply.seq_no) == (999, 3)
            # The same connection and session still work.
            deep = await _roundtrip(ws, good)
            assert isinstance(deep, wire.DeepHidden) and deep.hidden.shape == (1, hidden)
            # Rolling back beyond the cache is refused, without harming the session.
            reply = await _roundtrip(ws, wire.encode(wire.VerifyRequest(1, 5, 10, torch.randn(1, hidden))))
            assert isinstance(reply, wire.ErrorFrame) and reply.seq_no == 5
            ok = await _roundtrip(ws, wire.encode(wire.VerifyRequest(1, 6, 3, torch.randn(2, hidden))))
            assert isinstance(ok, wire.VerifyResult) and ok.hidden.shape == (2, hidden)


async def test_vanished_device_frees_its_sessions(checkpoint):
    hidden = checkpoint.hidden_size
    async with running_verifier(checkpoint) as (server, url):
        ws = await connect(url)
        for sid in (11, 12):
            await _roundtrip(ws, wire.encode(wire.OpenSession(sid, hidden, **split_identity(checkpoint, M))))
        await ws.send(wire.encode(wire.PrefillChunk(11, 1, 0, False, torch.randn(5, hidden))))
        assert isinstance(wire.decode(await asyncio.wait_for(ws.recv(), 10)), wire.ChunkAck)
        caches = [server.runner.sessions[sid].middle for sid in (11, 12)]
        ws.transport.abort()  # the peer vanishes mid-request, without a close handshake
        for _ in range(100):
            if not server.scheduler.sessions:
                break
            await asyncio.sleep(0.05)
        assert not server.scheduler.sessions
        assert all(cache.is_freed for cache in caches)
        # Others are unaffected: a new device can still generate.
        cloud = WebSocketCloud(url, hidden, wire.WireDtype.F32, **split_identity(checkpoint, M))
        assert len(await generate_over_ws(checkpoint, cloud, [3, 4, 5], 13, max_new=4)) == 4
        await cloud.close_connection()


async def test_errors_reach_the_device_as_cloud_errors(checkpoint):
    async with running_verifier(checkpoint) as (_, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size)
        with pytest.raises(CloudError, match="UNKNOWN_SESSION"):
            await cloud.verify(424242, 0, torch.randn(1, checkpoint.hidden_size))
        await cloud.close_connection()


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
async def test_bandwidth_probe_measures_the_emulated_link(checkpoint):
    from shared.net.links import LinkProfile

    link = LinkProfile(uplink_bytes_s=250_000, downlink_bytes_s=500_000, latency_s=0.004, jitter_s=0.0)
    async with running_verifier(checkpoint) as (_, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size, link=link)
        (up_bytes, up_s), (down_bytes, down_s), rtt_s = await cloud.measure_link(rows=512)
        await cloud.close_connection()
    assert abs(up_bytes / up_s - 250_000) <= 0.15 * 250_000
    assert abs(down_bytes / down_s - 500_000) <= 0.15 * 500_000
    assert 2 * 0.004 <= rtt_s < 2 * 0.004 + 0.25  # both latencies, plus framing on a loaded box


# -- faults: one item fails, the verifier goes on ----------------------------------------------


async def test_a_fault_in_one_session_fails_its_item_alone_and_the_verifier_goes_on(checkpoint):
    hidden, sids, f32 = checkpoint.hidden_size, (1, 2, 3), wire.WireDtype.F32
    torch.manual_seed(3)
    prefixes = {sid: torch.randn(4 + sid, hidden) for sid in sids}
    drafts = {sid: torch.randn(3, hidden) for sid in sids}
    middle = MiddleSubmodel(checkpoint, M)  # the unsplit middle over each whole sequence, in one pass
    expected = {
        sid: middle.forward_batch([(middle.new_cache(), torch.cat([prefixes[sid], drafts[sid]]))])[0][-3:]
        for sid in sids
    }

    async def send(ws, message):
        await ws.send(wire.encode(message, wire_dtype=f32))

    async with running_verifier(checkpoint) as (server, url):
        async with connect(url) as ws:
            for sid in (*sids, 4):
                opened = await _roundtrip(
                    ws, wire.encode(wire.OpenSession(sid, hidden, f32, **split_identity(checkpoint, M)))
                )
                assert isinstance(opened, wire.SessionOpened)
            for sid in sids:
                await send(ws, wire.PrefillChunk(sid, 1, 0, True, prefixes[sid]))
                assert isinstance(wire.decode(await asyncio.wait_for(ws.recv(), 10)), wire.DeepHidden)
            # Session 2's rows raise IndexError after the layers appended (a fault mid-pass).
            runner, forward = server.runner, server.runner.layers.forward_packed

            def faulty(states, caches, lengths):
                out = forward(states, caches, lengths)
                if any(cache is runner.sessions[2].middle for cache in caches):
                    raise IndexError("injected fault in session 2's rows")
                return out

            runner.layers.forward_packed = faulty
            # Hold the engine on session 4's step until the three verifies are queued: they share the next pass.
            gate, execute, batch_sizes = threading.Event(), server.engine.execute, []
            server.engine.execute = lambda batch: (batch_sizes.append(len(batch.items)), gate.wait(10), execute(batch))[
                2
            ]
            await send(ws, wire.PrefillChunk(4, 1, 0, True, torch.randn(2, hidden)))
            for _ in range(1000):
                if batch_sizes:
                    break
                await asyncio.sleep(0.01)
            assert batch_sizes, "the engine never started session 4's step"
            for sid in sids:
                await send(ws, wire.VerifyRequest(sid, 2, prefixes[sid].shape[0], drafts[sid]))
            for _ in range(1000):
                if sum(len(server.scheduler.sessions[sid].queue) for sid in sids) == 3:
                    break
                await asyncio.sleep(0.01)
            assert sum(len(server.scheduler.sessions[sid].queue) for sid in sids) == 3, "verifies not queued"
            gate.set()
            replies = [wire.decode(await asyncio.wait_for(ws.recv(), 10)) for _ in range(4)]
            by_session = {r.session_id: r for r in replies}
            assert batch_sizes[:2] == [1, 3]
            assert isinstance(by_session[2], wire.ErrorFrame) and by_session[2].code == wire.ErrorCode.INTERNAL
            assert by_session[2].seq_no == 2 and "IndexError" in by_session[2].message
            for sid in (1, 3):
                assert isinstance(by_session[sid], wire.VerifyResult)
                assert torch.allclose(by_session[sid].hidden, expected[sid], atol=1e-4)
            # Session 2 was rolled back to before the failed pass: once the fault is gone, it is exact.
            runner.layers.forward_packed = forward
            again = await _roundtrip(
                ws, wire.encode(wire.VerifyRequest(2, 3, prefixes[2].shape[0], drafts[2]), wire_dtype=f32)
            )
            assert isinstance(again, wire.VerifyResult) and torch.allclose(again.hidden, expected[2], atol=1e-4)
            # A fault outside the runner (here: in the scheduler) costs a step, never the engine loop.
            schedule, calls = server.scheduler.schedule, []

            def fails_once(*args, **kwargs):
                calls.append(1)
                if len(calls) == 1:
                    raise KeyError("injected fault in the scheduler")
                return schedule(*args, **kwargs)

            server.scheduler.schedule = fails_once
            deep = await _roundtrip(ws, wire.encode(wire.PrefillChunk(4, 2, 2, True, torch.randn(2, hidden))))
            assert isinstance(deep, wire.DeepHidden) and len(calls) >= 2


async def test_an_open_that_fails_inside_the_runner_leaves_no_half_open_session(checkpoint, monkeypatch):
    """Any fault while opening (not only a typed refusal) answers INTERNAL and leaves no session record behind
    to count against the caps; the same id opens fine afterwards."""
    async with running_verifier(checkpoint) as (server, url):
        real_open = server.runner.open

        def fails_once(session_id, sampling=None, opened_as=None):
            monkeypatch.setattr(server.runner, "open", real_open)
            raise RuntimeError("allocation failed")

        monkeypatch.setattr(server.runner, "open", fails_once)
        async with connect(url) as ws:
            opening = wire.OpenSession(5, checkpoint.hidden_size, **split_identity(checkpoint))
            await ws.send(wire.encode(opening))
            reply = wire.decode(await asyncio.wait_for(ws.recv(), 10))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.INTERNAL
            assert 5 not in server.scheduler.sessions
            await ws.send(wire.encode(opening))
            assert wire.decode(await asyncio.wait_for(ws.recv(), 10)) == wire.SessionOpened(5)


async def test_a_reopened_session_id_never_gets_its_predecessors_result(checkpoint):
    """P = 1: session 7 is closed and opened again under its id after its old first chunk was scheduled, before
    the pass ran. The device must see only the new session's replies (the old ChunkAck would answer the new
    seq 1), and the old chunk must not land in the new session's KV (it starts at position 0 too)."""
    hidden, f32 = checkpoint.hidden_size, wire.WireDtype.F32
    torch.manual_seed(5)
    old_prefix = torch.randn(4, hidden)
    new_prefix, new_draft = torch.randn(5, hidden), torch.randn(3, hidden)
    middle = MiddleSubmodel(checkpoint, M)
    expected = middle.forward_batch([(middle.new_cache(), torch.cat([new_prefix, new_draft]))])[0]

    async def send(ws, message):
        await ws.send(wire.encode(message, wire_dtype=f32))

    opening = wire.encode(wire.OpenSession(7, hidden, f32, **split_identity(checkpoint, M)))
    async with running_verifier(checkpoint) as (server, url), connect(url) as ws:
        assert isinstance(await _roundtrip(ws, opening), wire.SessionOpened)
        # Hold the engine between scheduling the old chunk and running it until the id is closed and opened again.
        entered, gate, execute = threading.Event(), threading.Event(), server.engine.execute

        def held_once(batch):
            if not entered.is_set():
                entered.set()
                gate.wait(10)
            return execute(batch)

        server.engine.execute = held_once
        await send(ws, wire.PrefillChunk(7, 1, 0, False, old_prefix))
        assert await asyncio.to_thread(entered.wait, 10), "the engine never took the old chunk"
        assert isinstance(await _roundtrip(ws, wire.encode(wire.CloseSession(7))), wire.SessionClosed)
        assert isinstance(await _roundtrip(ws, opening), wire.SessionOpened)
        await send(ws, wire.PrefillChunk(7, 1, 0, True, new_prefix))
        await send(ws, wire.VerifyRequest(7, 2, 5, new_draft))
        gate.set()
        replies = [wire.decode(await asyncio.wait_for(ws.recv(), 10)) for _ in range(2)]
        assert [(type(r), r.seq_no) for r in replies] == [(wire.DeepHidden, 1), (wire.VerifyResult, 2)]
        assert torch.allclose(replies[0].hidden, expected[4:5], atol=1e-4)
        assert torch.allclose(replies[1].hidden, expected[5:], atol=1e-4)
        with pytest.raises(TimeoutError):  # and the old result never comes after them either
            await asyncio.wait_for(ws.recv(), 0.3)
        assert server.runner.lengths() == {7: 8}
