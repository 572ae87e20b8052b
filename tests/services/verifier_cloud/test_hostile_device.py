"""A hostile device costs the verifier only its own budget (issue 47): the real verifier on a loopback
WebSocket, the demo model (a 2,048-position context), attacked from outside with frames a device can send.

* Forks of a full-context session: refused (KV_BUDGET) once the device's KV budget in bytes is spent, and
  the verifier's KV and RSS stay within it (without the budget 63 forks took 12 MiB of KV to 773 MiB).
* Frames that can never run (rows past the context, a start the session cannot have) are refused as they
  arrive, never queued; frames that could run queue only up to the device's budget of queued bytes.
* A device that stops reading its replies is closed once its unsent bytes pass send_buffer_bytes.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch
from websockets.asyncio.client import connect

from services.verifier_cloud.settings import Settings
from shared.processes.memory import return_freed_memory_to_os
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
F32 = wire.WireDtype.F32
MiB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


async def send(ws, message: wire.Message) -> None:
    await ws.send(wire.encode(message, wire_dtype=F32))


async def receive(ws, timeout_s: float = 10) -> wire.Message:
    return wire.decode(await asyncio.wait_for(ws.recv(), timeout_s))


async def roundtrip(ws, message: wire.Message) -> wire.Message:
    await send(ws, message)
    return await receive(ws)


def open_message(checkpoint, sid: int) -> wire.OpenSession:
    return wire.OpenSession(sid, checkpoint.hidden_size, F32, **split_identity(checkpoint, M))


async def hold_engine(server, ws, sid: int, hidden: int) -> threading.Event:
    """Keep the engine inside a step of session `sid` until the returned gate is set: other sessions'
    work then stays queued."""
    entered, gate, execute = [], threading.Event(), server.engine.execute
    server.engine.execute = lambda batch: (entered.append(1), gate.wait(20), execute(batch))[2]
    await send(ws, wire.PrefillChunk(sid, 1, 0, True, torch.randn(2, hidden)))
    for _ in range(1000):
        if entered:
            return gate
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never started session {sid}'s step")


async def test_forks_of_a_full_context_session_stop_at_the_device_kv_budget(demo_checkpoint):
    context, hidden = demo_checkpoint.config.max_position_embeddings, demo_checkpoint.hidden_size
    budget = 64 * MiB
    return_freed_memory_to_os()  # as the verifier's own main does: freed tensors leave the RSS
    async with verifier_on_loopback(demo_checkpoint, M, kv_bytes_per_device=budget) as (server, url):
        async with connect(url, max_size=None) as hostile, connect(url, max_size=None) as other:
            assert isinstance(await roundtrip(hostile, open_message(demo_checkpoint, 1)), wire.SessionOpened)
            full = await roundtrip(hostile, wire.PrefillChunk(1, 1, 0, True, torch.randn(context, hidden)))
            assert isinstance(full, wire.DeepHidden)
            kv_before, rss_before = server.runner.kv_bytes(), rss_bytes()
            for child in range(2, 65):  # 63 forks of a few dozen bytes each
                await send(hostile, wire.ForkSession(child, 1))
            replies = [await receive(hostile) for _ in range(63)]
            opened = sorted(r.session_id for r in replies if isinstance(r, wire.SessionOpened))
            refused = [r for r in replies if isinstance(r, wire.ErrorFrame)]
            assert len(opened) + len(refused) == 63
            assert {r.code for r in refused} == {wire.ErrorCode.KV_BUDGET}
            assert "kv_bytes_per_device" in refused[0].message and str(budget) in refused[0].message
            # As many forks as the budget holds, each a copy of the whole context
            per_fork = server.sessions.budgets.kv_charge(server.scheduler.sessions[opened[0]])
            parent = server.sessions.budgets.kv_charge(server.scheduler.sessions[1])
            assert len(opened) == (budget - parent) // per_fork >= 1
            assert server.runner.lengths()[opened[-1]] == context
            kv_after = server.runner.kv_bytes()
            assert kv_before <= kv_after <= budget
            assert server.sessions.budgets.kv_bytes() <= budget
            assert rss_bytes() - rss_before < budget + 32 * MiB  # without the budget: +773 MiB
            # Another device is not refused for what this one holds.
            assert isinstance(await roundtrip(other, open_message(demo_checkpoint, 100)), wire.SessionOpened)
            assert isinstance(await roundtrip(other, wire.ForkSession(101, 100)), wire.SessionOpened)
            # Closing the forks gives the budget back: a fork fits again.
            for sid in opened:
                assert isinstance(await roundtrip(hostile, wire.CloseSession(sid)), wire.SessionClosed)
            assert isinstance(await roundtrip(hostile, wire.ForkSession(200, 1)), wire.SessionOpened)
            assert server.runner.kv_bytes() <= budget


async def test_frames_that_can_never_run_are_refused_before_they_queue(demo_checkpoint):
    context, hidden = demo_checkpoint.config.max_position_embeddings, demo_checkpoint.hidden_size
    return_freed_memory_to_os()
    async with verifier_on_loopback(demo_checkpoint, M) as (server, url):
        async with connect(url, max_size=None) as ws:
            for sid in (1, 9):
                await roundtrip(ws, open_message(demo_checkpoint, sid))
            gate = await hold_engine(server, ws, 9, hidden)  # nothing of session 1 runs until the gate opens
            try:
                rss_before = rss_bytes()
                impossible = [
                    wire.PrefillChunk(1, 10, 0, False, torch.randn(2 * context, hidden)),  # rows past the context
                    wire.PrefillChunk(1, 11, 10**9, False, torch.randn(1, hidden)),  # a start it cannot have
                    wire.PrefillChunk(1, 12, 100, False, torch.randn(4, hidden)),  # the session holds nothing
                    wire.VerifyRequest(1, 13, 5, torch.randn(1, hidden)),  # commit_len past what it holds
                ]
                for message in impossible:
                    refusal = await receive_after(ws, message)
                    assert isinstance(refusal, wire.ErrorFrame), refusal
                    assert refusal.code in (wire.ErrorCode.BAD_SHAPE, wire.ErrorCode.MALFORMED)
                    assert (refusal.session_id, refusal.seq_no) == (1, message.seq_no)
                for seq in range(100, 164):  # 64 frames of 4 MiB that could never run: none is kept
                    await send(ws, wire.PrefillChunk(1, seq, 0, False, torch.randn(2 * context, hidden)))
                codes = {(await receive(ws)).code for _ in range(64)}
                assert codes == {wire.ErrorCode.BAD_SHAPE}
                session = server.scheduler.sessions[1]
                assert not session.queue and session.queued_bytes == 0
                await asyncio.sleep(0.3)  # the sockets' own buffers drain
                assert rss_bytes() - rss_before < 64 * MiB  # queued, they took 256 MiB
                # What can run still queues, and runs once the engine is free.
                await send(ws, wire.PrefillChunk(1, 200, 0, True, torch.randn(3, hidden)))
            finally:
                gate.set()
            replies = {(r.session_id, r.seq_no): r for r in [await receive(ws), await receive(ws)]}
            assert isinstance(replies[(1, 200)], wire.DeepHidden) and (9, 1) in replies
            assert server.scheduler.sessions[1].queued_bytes == 0


async def receive_after(ws, message: wire.Message) -> wire.Message:
    await send(ws, message)
    return await receive(ws, timeout_s=5)


async def test_queued_rows_stop_at_the_device_queue_budget(demo_checkpoint):
    hidden = demo_checkpoint.hidden_size
    budget = 1 * MiB
    async with verifier_on_loopback(demo_checkpoint, M, queued_bytes_per_device=budget) as (server, url):
        async with connect(url, max_size=None) as ws:
            for sid in (1, 9):
                await roundtrip(ws, open_message(demo_checkpoint, sid))
            gate = await hold_engine(server, ws, 9, hidden)
            try:
                for seq in range(2, 10):  # 8 verifies of 256 KiB each against a 1 MiB budget
                    await send(ws, wire.VerifyRequest(1, seq, 0, torch.randn(256, hidden)))
                refusals = []
                for _ in range(8):
                    try:
                        refusals.append(await receive(ws, timeout_s=2))
                    except TimeoutError:
                        break
                assert {r.code for r in refusals} == {wire.ErrorCode.QUEUE_BUDGET}
                assert "queued_bytes_per_device" in refusals[0].message and str(budget) in refusals[0].message
                queued = 8 - len(refusals)
                assert 3 <= queued <= 4 and [r.seq_no for r in refusals] == list(range(2 + queued, 10))
                assert 0 < server.sessions.budgets.queued_bytes() <= budget
            finally:
                gate.set()
            answers = [await receive(ws) for _ in range(queued + 1)]  # and session 9's prefill
            assert sorted(a.seq_no for a in answers if a.session_id == 1) == list(range(2, 2 + queued))
            assert server.sessions.budgets.queued_bytes() == 0


async def test_a_device_that_does_not_read_is_closed(demo_checkpoint):
    hidden = demo_checkpoint.hidden_size
    # send_timeout_s long: the connection is closed for its unsent bytes, not for a send that timed out
    async with verifier_on_loopback(demo_checkpoint, M, send_buffer_bytes=MiB, send_timeout_s=60) as (server, url):
        # A socket with a small receive buffer, and max_queue=1: once a reply waits unread the client stops
        # reading, as a stuck device would, and little of what the verifier sends hides in the kernel.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])))
        sock.setblocking(False)
        async with connect(url, max_size=None, max_queue=1, sock=sock, close_timeout=1) as ws:
            assert isinstance(await roundtrip(ws, open_message(demo_checkpoint, 1)), wire.SessionOpened)
            rows = torch.randn(256, hidden)  # each reply is 256 KiB of deep states
            for seq in range(1, 201):
                await send(ws, wire.VerifyRequest(1, seq, 0, rows))
                if 1 not in server.scheduler.sessions:
                    break
            for _ in range(200):
                if 1 not in server.scheduler.sessions:
                    break
                await asyncio.sleep(0.05)
            assert 1 not in server.scheduler.sessions, "a device that reads nothing still holds its session"
            assert server.runner.kv_bytes() == 0


def test_budget_settings():
    defaults = Settings()
    share = defaults.max_sessions_per_connection / defaults.max_sessions
    assert defaults.device_kv_bytes == int(defaults.kv_bytes_total * share)
    assert defaults.device_queued_bytes == int(defaults.queued_bytes_total * share)
    assert Settings(kv_bytes_per_device=5).device_kv_bytes == 5
    for bad in ({"kv_bytes_total": 0}, {"queued_bytes_per_device": -1}, {"send_buffer_bytes": 10}):
        with pytest.raises(ValueError):
            Settings(**bad).validate()
