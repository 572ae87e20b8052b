"""The device's WebSocket client against a misbehaving verifier (a fake peer: outside the product); a verifier
that does not answer in time is a CloudTimeout, which the failover replay does not count as a lost verifier."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.server import serve

from services.device_agent.cloud_client import CloudUnavailable, WebSocketCloud
from services.device_agent.cloud_errors import CloudTimeout, cloud_gone, verifier_lost
from shared.specdec.replay import FailoverExhausted, ReplayingCloud

FRAME_LIMIT = 4096


async def test_a_reply_over_the_frame_limit_closes_the_connection_unbuffered() -> None:
    """The device's transport limit is the frame limit: a verifier cannot make it buffer 4x a frame."""
    closed_with: list[int | None] = []

    async def oversized_replies(connection) -> None:
        await connection.recv()
        await connection.send(b"\x00" * (FRAME_LIMIT + 1))
        await connection.wait_closed()
        closed_with.append(connection.close_code)

    async with serve(oversized_replies, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        cloud = WebSocketCloud(
            f"ws://127.0.0.1:{port}/ws",
            8,
            max_frame_bytes=FRAME_LIMIT,
            request_timeout_s=5,
            split_layers=1,
            fingerprint=1,
        )
        try:
            with pytest.raises(CloudUnavailable):
                await cloud.open(1)
            async with asyncio.timeout(5):
                while not closed_with:
                    await asyncio.sleep(0.01)
        finally:
            await cloud.close_connection()
    assert closed_with == [1009]  # message too big, refused from its header


async def test_several_replicas_are_tried_in_turn() -> None:
    """A dead first replica is skipped; after the live one's connection closes, the other is tried first."""
    import socket

    from shared.wire import schema as wire

    accepted: list[int] = []

    async def one_session_then_hang_up(connection) -> None:
        frame = wire.decode(await connection.recv())
        accepted.append(connection.local_address[1])
        await connection.send(wire.encode(wire.SessionOpened(frame.session_id)))
        await connection.close()

    with socket.socket() as unused:  # a port nothing listens on: a dead replica
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]
    async with (
        serve(one_session_then_hang_up, "127.0.0.1", 0) as first,
        serve(one_session_then_hang_up, "127.0.0.1", 0) as second,
    ):
        ports = [first.sockets[0].getsockname()[1], second.sockets[0].getsockname()[1]]
        urls = ",".join(f"ws://127.0.0.1:{p}/ws" for p in [dead_port, *ports])
        cloud = WebSocketCloud(urls, 8, request_timeout_s=5, split_layers=1, fingerprint=1)
        try:
            await cloud.open(1)  # the dead one is skipped
            assert cloud.url.endswith(f":{ports[0]}/ws")
            async with asyncio.timeout(5):
                while cloud._reader is not None and not cloud._reader.done():  # the replica hangs up
                    await asyncio.sleep(0.01)
            await cloud.open(2)  # the next replica first
            assert cloud.url.endswith(f":{ports[1]}/ws")
        finally:
            await cloud.close_connection()
    assert accepted == ports
    with pytest.raises(ValueError):
        WebSocketCloud(" , ", 8)


async def test_an_overloaded_verifier_times_out_and_is_not_sent_the_context_again() -> None:
    """A verifier that opens the session and then never answers: the request fails with CloudTimeout on the same
    connection; the replay does not count it as lost, so the verifier is not sent the session again."""
    import torch

    from shared.wire import schema as wire

    received: list[str] = []

    async def opens_then_stalls(connection) -> None:
        async for frame in connection:
            message = wire.decode(frame)
            received.append(type(message).__name__)
            if isinstance(message, wire.OpenSession):
                await connection.send(wire.encode(wire.SessionOpened(message.session_id)))

    async with serve(opens_then_stalls, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        cloud = WebSocketCloud(f"ws://127.0.0.1:{port}/ws", 8, request_timeout_s=0.3, split_layers=1, fingerprint=1)
        replaying = ReplayingCloud(cloud, verifier_lost, deadline_s=5, backoff_s=0.01)
        try:
            await replaying.open(1)
            answer = await replaying.send_prefill(1, 0, torch.zeros(3, 8), True)
            with pytest.raises(CloudTimeout, match="did not answer within 0.3s") as timed_out:
                async with asyncio.timeout(5):
                    await answer
            assert cloud.connected  # the connection is up: the verifier is slow, not gone
        finally:
            await cloud.close_connection()
    assert received == ["OpenSession", "PrefillChunk"]  # no CloseSession, no second OpenSession, no replay
    assert not verifier_lost(timed_out.value) and cloud_gone(timed_out.value)  # finish_on_device still finishes
    assert verifier_lost(CloudUnavailable("connection to the verifier closed"))
    assert cloud_gone(FailoverExhausted(1, "at most 3 recoveries", 3, 1.0, CloudUnavailable("closed")))
