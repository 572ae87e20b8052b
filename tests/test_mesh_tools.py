"""The test relay itself: it must never accept a frame it cannot pass on, or byte counts compared against it
(tests/e2e/test_metrics.py) disagree with the device's."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import InvalidStatus

from tests.mesh_tools import CapturingRelay


def test_relay_refuses_the_handshake_while_its_upstream_is_down_and_relays_once_it_is_up():
    async def echo(connection):
        async for frame in connection:
            await connection.send(b"re:" + frame)

    async def scenario():
        async with serve(echo, "127.0.0.1", 0) as upstream:
            port = upstream.sockets[0].getsockname()[1]
        # the port is free again: nothing listens upstream
        relay = CapturingRelay(f"ws://127.0.0.1:{port}/ws").start()
        try:
            with pytest.raises(InvalidStatus) as refused:
                async with connect(relay.url, open_timeout=10):
                    pass
            assert refused.value.response.status_code == 503
            async with serve(echo, "127.0.0.1", port):
                async with connect(relay.url, open_timeout=10) as device:
                    await device.send(b"hello")
                    assert await asyncio.wait_for(device.recv(), 10) == b"re:hello"
        finally:
            relay.stop()
        return relay

    relay = asyncio.run(scenario())
    assert relay.frames == [b"hello"] and relay.replies == [b"re:hello"]
