"""shared/specdec/replay.py: a session whose verifier dies mid-generation is replayed on a fresh one
and its greedy tokens are still the unsplit model's, whether the loss hits a prefill chunk, a chunk's
pending answer, a verification or the reopen itself; a verifier that never comes back is a typed
error after the deadline."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from shared.model.adapter import DraftAdapter
from shared.model.split import MiddleSubmodel
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.engine import LocalCloud, generate
from shared.specdec.reference import generate_full
from shared.specdec.replay import ReplayingCloud
from shared.specdec.sampling import SamplingParams

M = 2


class VerifierLost(ConnectionError):
    pass


class StrictLocalCloud(LocalCloud):
    """Refuses to open a session that is already open, as the verifier does."""

    async def open(self, session_id):
        if session_id in self.caches:
            raise RuntimeError(f"session {session_id} is already open")
        await super().open(session_id)


class DyingCloud:
    """A LocalCloud that 'dies' at chosen calls: the call fails and every session's KV is gone (as
    when the verifier process is killed and another one, empty, takes its place)."""

    def __init__(self, middle, die_at: set[int], answer_dies: set[int] = frozenset(), down_for: int = 0):
        self.local = StrictLocalCloud(middle)
        self.calls = 0
        self.die_at = set(die_at)
        self.answer_dies = set(answer_dies)  # prefill calls whose answer (not the send) fails
        self.down_for = down_for  # after a death, this many more calls fail (the replica is restarting)
        self.down = 0
        self.deaths = 0

    def _tick(self) -> None:
        self.calls += 1
        if self.down > 0:
            self.down -= 1
            raise VerifierLost("still down")
        if self.calls in self.die_at:
            self.deaths += 1
            self.local.caches.clear()
            self.down = self.down_for
            raise VerifierLost(f"died at call {self.calls}")

    async def open(self, session_id):
        self._tick()
        await self.local.open(session_id)

    async def send_prefill(self, session_id, start_pos, shallow, is_last):
        self._tick()
        if self.calls in self.answer_dies:
            self.deaths += 1
            self.local.caches.clear()

            async def lost():
                raise VerifierLost("connection closed before the answer")

            return asyncio.ensure_future(lost())
        return await self.local.send_prefill(session_id, start_pos, shallow, is_last)

    async def verify(self, session_id, commit_len, shallow):
        self._tick()
        return await self.local.verify(session_id, commit_len, shallow)

    async def close(self, session_id):
        await self.local.close(session_id)


def run(checkpoint, ids, cloud, max_new=24, chunk_size=4, generate_options=None, **replay):
    device = DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M))
    session = DeviceSession(device, ids, SamplingParams(), DraftConfig(eta=0.3, max_draft=4), max_new)
    replaying = ReplayingCloud(cloud, lambda exc: isinstance(exc, VerifierLost), backoff_s=0.001, **replay)
    result = asyncio.run(generate(session, replaying, chunk_size=chunk_size, **(generate_options or {})))
    result.degraded = session.degraded
    return result, replaying


@pytest.mark.parametrize("die_at,answer_dies,down_for", [
    ({1}, set(), 0),          # the open
    ({1}, set(), 2),          # the open, while the verifier is down for a while
    ({3}, set(), 0),          # the second prefill chunk's send
    (set(), {2}, 0),          # the first chunk's answer, while later chunks are in flight
    ({6}, set(), 0),          # the first verification
    ({9, 14}, set(), 0),      # two losses in the decode
    ({8}, set(), 3),          # a verification, and the first reconnects fail too
])
def test_greedy_tokens_survive_a_lost_verifier(tiny_llama_dir, die_at, answer_dies, down_for):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    rng = random.Random(len(die_at) * 7 + down_for)
    ids = [rng.randrange(1, checkpoint.vocab_size) for _ in range(11)]
    expected = generate_full(checkpoint, ids, 24).token_ids
    cloud = DyingCloud(MiddleSubmodel(checkpoint, M), die_at, answer_dies, down_for)
    replays: list[tuple[int, int, float]] = []
    result, replaying = run(checkpoint, ids, cloud, on_replay=lambda *event: replays.append(event))
    assert result.token_ids == expected
    assert cloud.deaths == len(die_at) + len(answer_dies) and len(replays) == cloud.deaths
    assert all(rows >= 0 and seconds >= 0 for _, rows, seconds in replays)


def test_a_verifier_that_never_returns_is_an_error_after_the_deadline(tiny_llama_dir):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    cloud = DyingCloud(MiddleSubmodel(checkpoint, M), {6}, down_for=10**9)
    started = time.monotonic()
    with pytest.raises(VerifierLost):
        run(checkpoint, [5, 6, 7, 8, 9], cloud, deadline_s=0.3, max_backoff_s=0.25)
    assert time.monotonic() - started >= 0.3  # retried until the deadline, not given up one backoff early


def test_other_errors_are_not_replayed(tiny_llama_dir):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)

    class Refusing(DyingCloud):
        async def verify(self, session_id, commit_len, shallow):
            raise ValueError("a bad request is the caller's bug, not a lost verifier")

    cloud = Refusing(MiddleSubmodel(checkpoint, M), set())
    with pytest.raises(ValueError, match="caller's bug"):
        run(checkpoint, [5, 6, 7, 8, 9], cloud)
    assert cloud.deaths == 0


@pytest.mark.parametrize("parallel_candidates", [0, 2])
def test_finish_alone_ends_on_the_draft_model_after_the_deadline(tiny_llama_dir, parallel_candidates):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    ids = [5, 6, 7, 8, 9, 10, 11]
    expected = generate_full(checkpoint, ids, 24).token_ids
    cloud = DyingCloud(MiddleSubmodel(checkpoint, M), {7}, down_for=10**9)
    lost = lambda exc: isinstance(exc, VerifierLost)  # noqa: E731
    result, _ = run(checkpoint, ids, cloud, deadline_s=0.2,
                    generate_options={"finish_alone_on": lost, "parallel_candidates": parallel_candidates,
                                      "parallel_steps": 2})
    assert result.degraded and len(result.token_ids) == 24
    verified = sum(result.accept_lengths) + 1  # the prefill's token and every verified round's
    assert 1 < verified < 24 and result.token_ids[:verified] == expected[:verified]
