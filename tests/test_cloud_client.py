"""The device's WebSocket client against a misbehaving verifier (a fake peer: outside the product)."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.server import serve

from services.device_agent.cloud_client import CloudUnavailable, WebSocketCloud

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
        cloud = WebSocketCloud(f"ws://127.0.0.1:{port}/ws", 8, max_frame_bytes=FRAME_LIMIT, request_timeout_s=5,
                               split_layers=1, fingerprint=1)
        try:
            with pytest.raises(CloudUnavailable):
                await cloud.open(1)
            async with asyncio.timeout(5):
                while not closed_with:
                    await asyncio.sleep(0.01)
        finally:
            await cloud.close_connection()
    assert closed_with == [1009]  # message too big, refused from its header
