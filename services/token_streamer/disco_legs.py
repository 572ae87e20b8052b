"""The legs of one request under a DiSCo dispatch (disco_stream.py): a leg is one endpoint's generation, a
/generate stream on the request's device agent. Every leg is read into the request's one inbox as
(leg, kind, payload): "event" (a stream event), "alive" (its heartbeat: waiting, not dead), "failed" (its
DeviceError) or "open_failed" (the same, before its first event); a closed leg stops at once and its stream is
closed in an owned task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from services.token_streamer.device_stream import HEARTBEAT, DeviceStream
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.router import DeviceError, DeviceState
from shared.disco.cost import Endpoint


@dataclass(eq=False)
class Leg:
    endpoint: Endpoint
    prefix: int  # tokens of the answer it continues (0: it starts the answer)
    started: float = field(default_factory=time.perf_counter)
    stream: DeviceStream | None = None
    task: asyncio.Task | None = None
    first_at: float | None = None
    closed: bool = False


class Legs:
    """A request's legs in the order they were started. `body` is a leg's /generate body, made when it is
    opened; `opened` is told of each leg's stream before it is read."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        inbox: asyncio.Queue[tuple[Leg | None, str, Any]],
        body: Callable[[Leg], dict[str, Any]],
        opened: Callable[[Leg, DeviceStream], None],
    ) -> None:
        self.dispatcher, self.inbox, self.body, self.opened = dispatcher, inbox, body, opened
        self.started: list[Leg] = []
        self.closing: set[asyncio.Task] = set()

    def __iter__(self) -> Iterator[Leg]:
        return iter(self.started)

    def __len__(self) -> int:
        return len(self.started)

    def adopt(self, leg: Leg, stream: DeviceStream) -> None:
        """Read a leg whose stream is already open."""
        leg.stream = stream
        self.opened(leg, stream)
        self.started.append(leg)
        leg.task = asyncio.create_task(self._read(leg), name=f"disco-{leg.endpoint}")

    def open_beside(self, device: DeviceState, leg: Leg) -> None:
        """Start a leg on the request's device without blocking delivery."""
        self.started.append(leg)
        leg.task = asyncio.create_task(self._open_and_read(device, leg), name=f"disco-open-{leg.endpoint}")

    async def _open_and_read(self, device: DeviceState, leg: Leg) -> None:
        try:
            stream = await self.dispatcher.open_beside(device, self.body(leg))
        except DeviceError as exc:
            await self.inbox.put((leg, "open_failed", exc))
            return
        leg.stream = stream
        self.opened(leg, stream)
        await self._read(leg)

    async def _read(self, leg: Leg) -> None:
        assert leg.stream is not None  # set by adopt / _open_and_read before reading
        try:
            async for event in leg.stream.events(heartbeats=True):
                # a heartbeat only says the leg is alive (waiting): it wakes the request's idle timeout
                await self.inbox.put((leg, "alive" if event.get("type") == HEARTBEAT else "event", event))
        except DeviceError as exc:
            await self.inbox.put((leg, "failed", exc))

    def close(self, leg: Leg) -> None:
        """Stop a leg now (its reader) and close its stream in an owned task (bounded by DeviceStream)."""
        if leg.closed:
            return
        leg.closed = True
        if leg.task is not None and leg.task is not asyncio.current_task():
            leg.task.cancel()
        task = asyncio.create_task(self._close_stream(leg), name=f"disco-close-{leg.endpoint}")
        self.closing.add(task)
        task.add_done_callback(self.closing.discard)

    def close_all(self) -> None:
        for leg in self.started:
            self.close(leg)

    @staticmethod
    async def _close_stream(leg: Leg) -> None:
        if leg.task is not None:
            await asyncio.gather(leg.task, return_exceptions=True)
        if leg.stream is not None:
            await leg.stream.aclose()
