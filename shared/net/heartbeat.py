"""Heartbeats between the items of a slow async generator: liveness for a stream that is waiting, not dead.

A device agent's NDJSON stream is silent while its request waits (in the verifier's queue, behind other
sessions' prefills); the token streamer reads silence longer than its line timeout as a dead device. With
`with_heartbeats` the agent says "still here" every `interval_s` of such a wait: the reader's line timeout
then measures a dead device (no line at all), not a busy one.

The source is iterated by one task of its own, one item per item asked for (it never runs ahead of the
consumer), so a generator holding a per-task context across its yields still sees a single task. Closing the
heartbeat generator cancels that task and closes the source there (so the caller must not close the source
itself: it may still be running its cleanup); an exception of the source is raised to the consumer as it was.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TypeVar, cast

T = TypeVar("T")


async def with_heartbeats(source: AsyncGenerator[T, None], interval_s: float) -> AsyncGenerator[T | None, None]:
    """The items of `source`, and None after every `interval_s` without one (a heartbeat)."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    wanted: asyncio.Queue[None] = asyncio.Queue()
    got: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def pump() -> None:
        try:
            while True:
                await wanted.get()
                try:
                    item = await anext(source)
                except StopAsyncIteration:
                    got.put_nowait(("end", None))
                    return
                except Exception as exc:  # noqa: BLE001 - the consumer's to handle, raised there as it was
                    got.put_nowait(("error", exc))
                    return
                got.put_nowait(("item", item))
        finally:
            await source.aclose()  # here: the task that iterated it runs its cleanup

    task = asyncio.create_task(pump(), name="heartbeat-source")
    try:
        while True:
            wanted.put_nowait(None)
            while True:
                try:
                    async with asyncio.timeout(interval_s):
                        kind, value = await got.get()
                    break
                except TimeoutError:
                    yield None
            if kind == "end":
                return
            if kind == "error":
                assert isinstance(value, Exception)
                raise value
            yield cast(T, value)  # an item of the source
    finally:
        task.cancel()  # nothing if it ended
        try:
            await asyncio.wait([task])  # the source's cleanup, before the caller goes on
        except asyncio.CancelledError:
            # Cancelled again while waiting (a level-triggered cancel scope: a client gone): the cleanup
            # finishes on its own, owned here until it is done.
            _DETACHED.add(task)
            task.add_done_callback(_DETACHED.discard)
            raise


# Sources whose cleanup outlived a cancelled consumer: kept here so they are owned until they finish.
_DETACHED: set[asyncio.Task] = set()
