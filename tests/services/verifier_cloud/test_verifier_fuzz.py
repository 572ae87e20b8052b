"""Fuzz the real verifier over a real loopback WebSocket: 10,000 seeded mutations of valid frames.

Every bad frame must get an ErrorFrame with the code the schema gives it, no still-valid frame
may meet an INTERNAL error, the connection must stay open, sessions opened before the fuzz on the
fuzzed connection must answer a verify exactly as they did before, and a healthy session on a
second connection keeps verifying correctly while the fuzz runs.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from websockets.asyncio.client import connect

from loadgen.fuzz_wire import fuzz_connection
from shared.model.checkpoint import load_checkpoint
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

log = logging.getLogger(__name__)

M = 2
PROTECTED = (1, 2)
HEALTHY = 3  # on its own connection, verifying all through the fuzz
FRAMES = 10_000


async def _roundtrip(ws, message: wire.Message) -> wire.Message:
    await ws.send(wire.encode(message, wire_dtype=wire.WireDtype.F32))
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


async def _deep_states(ws, sid: int, shallow: torch.Tensor, seq_no: int = 100) -> torch.Tensor:
    """Roll session `sid` back to its 4-position prompt and verify 3 fixed rows: deep states [3, H]."""
    reply = await _roundtrip(ws, wire.VerifyRequest(sid, seq_no, 4, shallow))
    assert isinstance(reply, wire.VerifyResult), reply
    return reply.hidden.clone()


async def _open_with_prompt(ws, sid: int, prompt: torch.Tensor, identity: dict) -> None:
    opened = await _roundtrip(ws, wire.OpenSession(sid, prompt.shape[1], "f4", **identity))
    assert isinstance(opened, wire.SessionOpened), opened
    assert isinstance(await _roundtrip(ws, wire.PrefillChunk(sid, 1, 0, True, prompt)), wire.DeepHidden)


async def _keep_verifying(
    ws, sid: int, drafts: torch.Tensor, expected: torch.Tensor, fuzz_done: asyncio.Event
) -> tuple[int, int]:
    """Verify the same drafts again and again until the fuzz is done: (verifies, wrong answers).
    Close, not bitwise: a verify batched with the fuzz's own valid frames runs in other matmul shapes."""
    verifies = wrong = 0
    while not fuzz_done.is_set():
        got = await _deep_states(ws, sid, drafts, seq_no=200 + verifies)
        verifies += 1
        wrong += not torch.allclose(got, expected, atol=1e-4)
    return verifies, wrong


@pytest.mark.slow
async def test_ten_thousand_mutated_frames_get_typed_errors_and_change_nothing(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    hidden = checkpoint.hidden_size
    gen = torch.Generator().manual_seed(1)
    prompts = {sid: torch.randn(4, hidden, generator=gen) for sid in PROTECTED}  # prompt: [4, H]
    drafts = {sid: torch.randn(3, hidden, generator=gen) for sid in PROTECTED}  # drafts: [3, H]
    prompts[HEALTHY], drafts[HEALTHY] = torch.randn(4, hidden, generator=gen), torch.randn(3, hidden, generator=gen)
    identity = split_identity(checkpoint, M)
    async with verifier_on_loopback(checkpoint, M) as (server, url):
        async with connect(url, max_size=None) as ws, connect(url, max_size=None) as healthy_ws:
            for sid in PROTECTED:
                await _open_with_prompt(ws, sid, prompts[sid], identity)
            await _open_with_prompt(healthy_ws, HEALTHY, prompts[HEALTHY], identity)
            before = {sid: await _deep_states(ws, sid, drafts[sid]) for sid in PROTECTED}
            healthy_expected = await _deep_states(healthy_ws, HEALTHY, drafts[HEALTHY])

            fuzz_done = asyncio.Event()
            healthy = asyncio.create_task(
                _keep_verifying(healthy_ws, HEALTHY, drafts[HEALTHY], healthy_expected, fuzz_done)
            )
            try:
                counts = await fuzz_connection(
                    ws, hidden, frames=FRAMES, seed=9, protected=frozenset(PROTECTED), open_fields=identity
                )
            finally:
                fuzz_done.set()
                verifies, wrong = await asyncio.wait_for(healthy, 30)

            report = f"{counts.summary()}; healthy session: {verifies} verifies, {wrong} wrong"
            log.info("live verifier fuzz: %s", report)
            assert counts.frames_sent == FRAMES and counts.connections_dropped == 0, report
            assert not counts.wrong_replies, f"{report}; {counts.wrong_replies[:5]}"
            assert counts.typed_errors == counts.bad_frames >= 0.8 * FRAMES, report
            assert len(counts.by_code) >= 6, report  # the mutations reach many different checks
            assert verifies >= 20 and wrong == 0, report
            after = {sid: await _deep_states(ws, sid, drafts[sid]) for sid in PROTECTED}
            assert all(sid in server.scheduler.sessions for sid in (*PROTECTED, HEALTHY))
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
            for bad in (
                {"v": wire.WIRE_VERSION, "t": 3, "s": -1},
                {"v": wire.WIRE_VERSION, "t": 0x20, "s": 5, "q": -3},
            ):
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
