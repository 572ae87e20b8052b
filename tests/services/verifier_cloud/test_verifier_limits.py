"""What one peer can make the verifier spend: probe replies, frame buffering, NaN states, log lines,
sessions per device credential (across its connections); and what its debug log may show (no token).

A real verifier on a real loopback WebSocket (tests/mesh_tools.verifier_on_loopback).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.model.checkpoint import load_checkpoint
from shared.wire import schema as wire
from tests.auth_tools import bearer, jwks_server, wait_trusted
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
            fits = wire.encode(
                wire.PrefillChunk(3, 1, 0, True, torch.randn(rows, checkpoint.hidden_size)), wire_dtype="f2"
            )
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


# -- limits per credential: sessions per device, across its connections ---------------------------------
RING = KeyRing.generate()


def _bearer(device_id: str) -> dict[str, str]:
    return bearer(RING, device_id, "device", auth.VERIFIER)


@contextlib.asynccontextmanager
async def authenticated_verifier(checkpoint, **overrides):
    """The verifier checking devices' tokens against RING's keys (served as an issuer's): yields its ws URL."""
    credential = RING.mint("verifier-cloud", "service", auth.ISSUER, 600, time.time())
    async with (
        jwks_server(RING) as issuer,
        verifier_on_loopback(checkpoint, M, auth_issuer_url=issuer, auth_credential=credential, **overrides) as (
            server,
            url,
        ),
    ):
        await wait_trusted(server.trust)
        yield url


async def _open_session(ws, checkpoint, sid: int) -> wire.Message:
    reply, _ = await _exchange(
        ws, wire.encode(wire.OpenSession(sid, checkpoint.hidden_size, **split_identity(checkpoint, M)))
    )
    return reply


def _refused_as_overloaded(reply: wire.Message) -> bool:
    return isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.OVERLOADED


async def test_one_device_token_holds_at_most_its_sessions_across_connections(checkpoint):
    async with authenticated_verifier(checkpoint, max_sessions_per_device=3) as url:
        async with (
            connect(url, additional_headers=_bearer("dev-a")) as a1,
            connect(url, additional_headers=_bearer("dev-a")) as a2,
            connect(url, additional_headers=_bearer("dev-b")) as b,
        ):
            assert isinstance(await _open_session(a1, checkpoint, 1), wire.SessionOpened)
            assert isinstance(await _open_session(a1, checkpoint, 2), wire.SessionOpened)
            assert isinstance(await _open_session(a2, checkpoint, 3), wire.SessionOpened)
            # the device's fourth, on either of its connections: the per-connection limit's typed answer
            assert _refused_as_overloaded(await _open_session(a2, checkpoint, 4))
            assert _refused_as_overloaded(await _open_session(a1, checkpoint, 5))
            for sid in (11, 12, 13):  # another device's token is unaffected
                assert isinstance(await _open_session(b, checkpoint, sid), wire.SessionOpened)
            assert _refused_as_overloaded(await _open_session(b, checkpoint, 14))
            # closing a session frees its place for the device, on its other connection too
            closed, _ = await _exchange(a1, wire.encode(wire.CloseSession(1)))
            assert isinstance(closed, wire.SessionClosed)
            assert isinstance(await _open_session(a2, checkpoint, 6), wire.SessionOpened)
            assert _refused_as_overloaded(await _open_session(a2, checkpoint, 7))
        # closing connections frees every place they held
        async with connect(url, additional_headers=_bearer("dev-a")) as a3:
            for sid in (21, 22, 23):
                assert isinstance(await _open_session(a3, checkpoint, sid), wire.SessionOpened)


async def test_without_auth_the_device_bound_is_per_connection(checkpoint):
    async with verifier_on_loopback(checkpoint, M, max_sessions_per_device=2) as (_, url):
        async with connect(url) as one, connect(url) as two:
            for ws, sids in ((one, (1, 2)), (two, (3, 4))):
                for sid in sids:
                    assert isinstance(await _open_session(ws, checkpoint, sid), wire.SessionOpened)
                assert _refused_as_overloaded(await _open_session(ws, checkpoint, sids[-1] + 10))


async def test_the_handshake_debug_log_never_shows_a_token(checkpoint, caplog):
    caplog.set_level(logging.DEBUG, logger="websockets.server")
    headers = _bearer("dev-secretive")
    token = headers["Authorization"].removeprefix("Bearer ")
    async with authenticated_verifier(checkpoint) as url:
        async with connect(url, additional_headers=headers) as ws:
            assert isinstance(await _open_session(ws, checkpoint, 1), wire.SessionOpened)
    logged = [r.getMessage() for r in caplog.records] + [caplog.text]
    assert any("[redacted]" in line for line in logged)  # the handshake was logged, with its header blanked
    pieces = [token, *token.split(".")]
    assert not [line for line in logged if any(piece in line for piece in pieces)]
