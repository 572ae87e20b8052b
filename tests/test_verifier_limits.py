"""What one peer can make the verifier spend: probe replies, frame buffering, NaN states, log lines.

A real verifier on a real loopback WebSocket (tests/mesh_tools.verifier_on_loopback).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from shared import wire
from shared.model.checkpoint import load_checkpoint
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


async def _exchange(ws, frame: bytes) -> tuple[wire.Message, int]:
    """(reply, reply size in bytes) for one frame."""
    await ws.send(frame)
    reply = await asyncio.wait_for(ws.recv(), 10)
    return wire.decode(reply, max_frame_bytes=2**31), len(reply)


async def test_a_probe_reply_is_no_bigger_than_its_request(checkpoint):
    hidden = checkpoint.hidden_size
    async with verifier_on_loopback(checkpoint, M) as (_, url):
        async with connect(url, max_size=None) as ws:
            small = wire.encode(wire.BandwidthProbe(0, 1, 4096, torch.zeros(1, hidden)))  # asks x4096 its size
            reply, size = await _exchange(ws, small)
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.BAD_SHAPE
            assert size <= len(small) + 256
            for up, down in [(1, 1), (8, 8), (8, 1), (32, 32)]:
                request = wire.encode(wire.BandwidthProbe(0, 2, down, torch.zeros(up, hidden, dtype=torch.float16)))
                reply, size = await _exchange(ws, request)
                assert isinstance(reply, wire.ProbeReply) and reply.hidden.shape == (down, hidden)
                assert size <= len(request) + 16


async def test_the_transport_refuses_a_frame_over_the_limit_before_buffering_it(checkpoint):
    async with verifier_on_loopback(checkpoint, M, max_frame_bytes=LIMIT) as (_, url):
        async with connect(url, max_size=None) as ws:
            at_limit = b"\xc1" * LIMIT  # not msgpack, but exactly the limit: read, refused with a typed error
            reply, _ = await _exchange(ws, at_limit)
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.MALFORMED
            rows = wire.max_rows_per_frame(checkpoint.hidden_size, "f2", LIMIT)
            fits = wire.encode(wire.PrefillChunk(3, 1, 0, True, torch.randn(rows, checkpoint.hidden_size)),
                               wire_dtype="f2")
            assert len(fits) <= LIMIT
            reply, _ = await _exchange(ws, fits)
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.UNKNOWN_SESSION
        async with connect(url, max_size=None) as ws:
            await ws.send(b"\xc1" * (LIMIT + 1))  # one byte over: closed on the frame header, before its payload
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 10)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_hidden_states_are_refused_as_bad_value(checkpoint, bad):
    hidden = checkpoint.hidden_size
    async with verifier_on_loopback(checkpoint, M) as (server, url):
        async with connect(url) as ws:
            opened, _ = await _exchange(ws, wire.encode(wire.OpenSession(4, hidden, **split_identity(checkpoint, M))))
            assert isinstance(opened, wire.SessionOpened)
            prompt = torch.randn(3, hidden)  # prompt: [3, H]
            prompt[1, 5] = bad
            reply, _ = await _exchange(ws, wire.encode(wire.PrefillChunk(4, 1, 0, True, prompt)))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.BAD_VALUE
            assert (reply.session_id, reply.seq_no) == (4, 1)
            prompt[1, 5] = 0.0
            reply, _ = await _exchange(ws, wire.encode(wire.PrefillChunk(4, 2, 0, True, prompt)))
            assert isinstance(reply, wire.DeepHidden) and bool(torch.isfinite(reply.hidden).all())


async def test_a_thousand_bad_frames_make_a_few_info_lines_and_a_full_count(checkpoint, caplog):
    caplog.set_level(logging.DEBUG, logger="services.verifier_cloud")
    async with verifier_on_loopback(checkpoint, M) as (_, url):
        async with connect(url) as ws:
            for i in range(1000):
                reply, _ = await _exchange(ws, b"\xc1" if i % 2 else wire.encode(wire.CloseSession(10**6 + i)))
                assert isinstance(reply, wire.ErrorFrame)
        for _ in range(100):  # the summary of what is left is written when the connection ends
            if sum(getattr(r, "bad_frames", 0) for r in caplog.records) >= 1000:
                break
            await asyncio.sleep(0.05)
    verifier = [r for r in caplog.records if r.name == "services.verifier_cloud"]
    info = [r for r in verifier if r.levelno >= logging.INFO and "bad frame" in r.getMessage()]
    debug = [r for r in verifier if r.levelno == logging.DEBUG and "bad frame" in r.getMessage()]
    assert 1 <= len(info) <= 3, [r.getMessage() for r in info]
    assert len(debug) == 1000
    assert sum(r.bad_frames for r in info) == 1000  # every bad frame counted in a summary
    text = " ".join(r.getMessage() for r in info)
    assert "MALFORMED" in text and "UNKNOWN_SESSION" in text  # counted by code
