"""Tools for the end-to-end tests: a WebSocket relay that records every frame
a device sends to the cloud (to prove what crosses the wire)."""

from __future__ import annotations

import asyncio
import threading

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed


class CapturingRelay:
    """Listens on a free port, relays each connection to `upstream`, keeps device->cloud frames."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.frames: list[bytes] = []
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._ready = threading.Event()

    async def _pipe(self, source, sink, record: bool) -> None:
        try:
            async for frame in source:
                if record:
                    self.frames.append(frame)
                await asyncio.wait_for(sink.send(frame), 30)
        except ConnectionClosed:
            pass
        finally:
            await sink.close()

    async def _handle(self, device_side) -> None:
        async with connect(self.upstream, max_size=None, compression=None, open_timeout=10) as cloud_side:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._pipe(device_side, cloud_side, record=True))
                tasks.create_task(self._pipe(cloud_side, device_side, record=False))

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self._handle, "127.0.0.1", 0, max_size=None, compression=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self) -> "CapturingRelay":
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
