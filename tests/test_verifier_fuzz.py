"""Fuzz the real verifier over a real loopback WebSocket: ~2,000 seeded mutations of valid frames.

Every bad frame must get an ErrorFrame with the code the schema gives it, the connection must
stay open, and sessions opened before the fuzz must answer a verify exactly as they did before.
"""

from __future__ import annotations

import asyncio

import torch
from websockets.asyncio.client import connect

from loadgen.fuzz_wire import fuzz_connection
from shared import wire
from shared.model.checkpoint import load_checkpoint
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
PROTECTED = (1, 2)


async def _roundtrip(ws, message: wire.Message) -> wire.Message:
    await ws.send(wire.encode(message, wire_dtype=wire.WireDtype.F32))
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


async def _deep_states(ws, sid: int, shallow: torch.Tensor) -> torch.Tensor:
    """Roll session `sid` back to its 4-position prompt and verify 3 fixed rows: deep states [3, H]."""
    reply = await _roundtrip(ws, wire.VerifyRequest(sid, 100, 4, shallow))
    assert isinstance(reply, wire.VerifyResult), reply
    return reply.hidden.clone()


async def test_two_thousand_mutated_frames_get_typed_errors_and_change_nothing(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    hidden = checkpoint.hidden_size
    gen = torch.Generator().manual_seed(1)
    prompts = {sid: torch.randn(4, hidden, generator=gen) for sid in PROTECTED}  # prompt: [4, H]
    drafts = {sid: torch.randn(3, hidden, generator=gen) for sid in PROTECTED}  # drafts: [3, H]
    identity = split_identity(checkpoint, M)
    async with verifier_on_loopback(checkpoint, M) as (server, url):
        async with connect(url, max_size=None) as ws:
            for sid in PROTECTED:
                assert isinstance(await _roundtrip(ws, wire.OpenSession(sid, hidden, "f4", **identity)),
                                  wire.SessionOpened)
                assert isinstance(await _roundtrip(ws, wire.PrefillChunk(sid, 1, 0, True, prompts[sid])),
                                  wire.DeepHidden)
            before = {sid: await _deep_states(ws, sid, drafts[sid]) for sid in PROTECTED}

            counts = await fuzz_connection(ws, hidden, frames=2000, seed=9, protected=frozenset(PROTECTED),
                                           open_fields=identity)

            print(counts.summary())
            assert counts.frames_sent == 2000 and counts.connections_dropped == 0
            assert not counts.wrong_replies, counts.wrong_replies[:5]
            assert counts.typed_errors == counts.bad_frames >= 1500
            assert len(counts.by_code) >= 6  # the mutations reach many different checks
            after = {sid: await _deep_states(ws, sid, drafts[sid]) for sid in PROTECTED}
            assert all(sid in server.scheduler.sessions for sid in PROTECTED)
    for sid in PROTECTED:
        assert torch.equal(before[sid], after[sid])


async def test_a_negative_session_id_gets_an_error_not_a_closed_connection(tiny_llama_dir):
    """The frame from the report: CloseSession with s = -1 used to close the connection with 1011."""
    import msgpack

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    async with verifier_on_loopback(checkpoint, M) as (server, url):
        async with connect(url) as ws:
            opened = await _roundtrip(ws, wire.OpenSession(5, checkpoint.hidden_size, **split_identity(checkpoint, M)))
            assert isinstance(opened, wire.SessionOpened)
            for bad in ({"v": wire.WIRE_VERSION, "t": 3, "s": -1}, {"v": wire.WIRE_VERSION, "t": 0x20, "s": 5, "q": -3}):
                await ws.send(msgpack.packb(bad))
                reply = wire.decode(await asyncio.wait_for(ws.recv(), 10))
                assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
                assert reply.session_id in (None, 5) and reply.seq_no is None
            assert 5 in server.scheduler.sessions
            assert isinstance(await _roundtrip(ws, wire.CloseSession(5)), wire.SessionClosed)


async def test_an_unexpected_exception_in_one_frame_answers_internal_and_keeps_the_connection(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    async with verifier_on_loopback(checkpoint, M) as (server, url):
        handled = server.on_message

        def buggy(connection, message):  # a bug that only a probe meets
            if isinstance(message, wire.BandwidthProbe):
                raise IndexError("a bug")
            return handled(connection, message)

        server.on_message = buggy
        async with connect(url) as ws:
            opened = await _roundtrip(ws, wire.OpenSession(6, checkpoint.hidden_size, **split_identity(checkpoint, M)))
            assert isinstance(opened, wire.SessionOpened)
            reply = await _roundtrip(ws, wire.BandwidthProbe(6, 41, 1, torch.zeros(1, checkpoint.hidden_size)))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.INTERNAL
            assert (reply.session_id, reply.seq_no) == (6, 41)
            assert isinstance(await _roundtrip(ws, wire.CloseSession(6)), wire.SessionClosed)
