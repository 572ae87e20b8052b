"""One request's decode loop, the same shape in every mode: open, then `step()` until finished, then close.

A mode's loop (HAT's `HatLoop`, the streamed modes' `StreamLoop`, the draft model alone, the cloud alone, ...)
is a `SessionLoop`: its `step()` reads schedule -> run -> postprocess and returns the tokens the step made
final (None when it made none: a streamed draft step). `drive(loop)` is the one driver: it yields those tokens
and releases the loop however it ends, so a loop holds no generator, thread or callback of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import ParamSpec, Protocol

P = ParamSpec("P")


class SessionLoop:
    """One request's rounds (see the module docstring); a mode's loop subclasses it."""

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    async def open(self) -> None:
        """What comes before the first step (open the cloud's session); inside drive's release."""

    async def step(self) -> list[int] | None:
        """One step: the tokens it made final, or None."""
        raise NotImplementedError

    def consumed(self) -> None:
        """The consumer has taken the last step's tokens and asked for more (a round's end)."""

    async def close(self) -> None:
        """Free the device's KV and close the cloud's session; called once, however the loop ends."""


async def drive(loop: SessionLoop) -> AsyncGenerator[list[int], None]:
    """Yield the tokens each step of `loop` makes final, until it finishes; close it however it ends. Open
    inside the release: a request cancelled while its session opens still closes it (the frame may have
    opened it already)."""
    try:
        await loop.open()
        while not loop.finished:
            tokens = await loop.step()
            if tokens is not None:
                yield tokens
                loop.consumed()
    finally:
        await loop.close()


def driven(loop_type: Callable[P, SessionLoop]) -> Callable[P, AsyncGenerator[list[int], None]]:
    """A function taking `loop_type`'s arguments that returns the loop driven (`drive`): the tokens of each
    step, as an async iterator."""

    def run(*args: P.args, **kwargs: P.kwargs) -> AsyncGenerator[list[int], None]:
        return drive(loop_type(*args, **kwargs))

    run.__doc__ = f"The tokens each step of a `{getattr(loop_type, '__name__', 'loop')}` makes final (driven)."
    return run


async def inline(fn, *args):
    """Device compute on the event loop itself (the tests', the bench's in-process default)."""
    return fn(*args)


class ShieldedOffload:
    """`offload(fn, *args)` for device steps, shielded: a cancelled request stops waiting at once, but the
    step (a worker thread that cannot be interrupted) keeps its handle in `last`, so the release frees the
    device KV only after it is done."""

    def __init__(self, offload: Callable[..., Awaitable]):
        self.offload = offload
        self.last: asyncio.Future | None = None  # the offloaded step running now (or the last one)

    async def __call__(self, fn, *args):
        return await asyncio.shield(self.start(fn, *args))

    def start(self, fn, *args) -> asyncio.Future:
        """The step, started now (its task is queued before anything the caller starts after it)."""
        self.last = asyncio.ensure_future(self.offload(fn, *args))
        return self.last


class Freeable(Protocol):
    def free(self) -> None: ...


class Closeable(Protocol):
    async def close(self, session_id: int) -> None: ...


async def release_session(cloud: Closeable, session_id: int, session: Freeable, step: asyncio.Future | None) -> None:
    """Free the device's KV once `step` (its last offloaded step) is done, and close the cloud's session;
    shielded, so a cancelled request still releases both."""
    release = asyncio.ensure_future(_release(cloud, session_id, session, step))
    try:
        await asyncio.shield(release)
    except asyncio.CancelledError:
        # Cancelled again while releasing (a client that went away under a level-triggered cancel scope):
        # the release finishes on its own, owned by _RELEASES until it is done.
        _RELEASES.add(release)
        release.add_done_callback(_RELEASES.discard)
        raise


# Releases that outlived their cancelled request: kept here so they are owned until they finish.
_RELEASES: set[asyncio.Future] = set()


async def _release(cloud: Closeable, session_id: int, session: Freeable, step: asyncio.Future | None) -> None:
    """Free the device's KV once its last offloaded step is done with it, and close the cloud's session."""
    try:
        if step is not None and not step.done():
            await asyncio.wait([step])  # a worker-thread step ends on its own; its KV is freed after it
    finally:
        session.free()
    await cloud.close(session_id)  # bounded: the cloud client times out its requests
