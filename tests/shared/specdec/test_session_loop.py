"""drive(): the one driver of every mode's SessionLoop (shared/specdec/session_loop.py)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from shared.specdec.session_loop import SessionLoop, ShieldedOffload, drive


class CountingLoop(SessionLoop):
    """Steps that make tokens on even steps and nothing on odd ones, for `total` steps; records the calls."""

    def __init__(self, total: int, fail_at: int | None = None):
        self.total, self.fail_at = total, fail_at
        self.steps = 0
        self.calls: list[str] = []

    @property
    def finished(self) -> bool:
        return self.steps >= self.total

    async def open(self) -> None:
        self.calls.append("open")

    async def step(self) -> list[int] | None:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("step failed")
        self.calls.append(f"step{self.steps}")
        return [self.steps] if self.steps % 2 == 0 else None

    def consumed(self) -> None:
        self.calls.append("consumed")

    async def close(self) -> None:
        self.calls.append("close")


async def _collect(loop: SessionLoop) -> list[list[int]]:
    return [tokens async for tokens in drive(loop)]


def test_drive_yields_only_steps_that_made_tokens_and_closes_once():
    loop = CountingLoop(5)
    assert asyncio.run(_collect(loop)) == [[2], [4]]
    assert loop.calls == ["open", "step1", "step2", "consumed", "step3", "step4", "consumed", "step5", "close"]


def test_drive_closes_a_loop_whose_step_fails():
    loop = CountingLoop(5, fail_at=3)
    with pytest.raises(RuntimeError, match="step failed"):
        asyncio.run(_collect(loop))
    assert loop.calls[-1] == "close" and loop.calls.count("close") == 1


def test_drive_closes_a_loop_its_consumer_leaves():
    loop = CountingLoop(10)

    async def first_only() -> list[int]:
        async with aclosing(drive(loop)) as tokens:
            async for first in tokens:
                return first
        raise AssertionError("no tokens")

    assert asyncio.run(first_only()) == [2]
    assert loop.calls == ["open", "step1", "step2", "close"]  # not consumed: the consumer left instead


def test_shielded_offload_keeps_the_step_running_past_a_cancel():
    async def main() -> tuple[bool, bool]:
        release = asyncio.Event()

        async def slow_step(fn):
            await release.wait()
            return fn()

        offload = ShieldedOffload(slow_step)
        waiter = asyncio.ensure_future(offload(lambda: "done"))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert offload.last is not None
        still_running = not offload.last.done()
        release.set()
        await offload.last
        return still_running, offload.last.result() == "done"

    assert asyncio.run(main()) == (True, True)
