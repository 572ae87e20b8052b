"""shared/specdec/replay.py: a session whose verifier dies mid-generation is replayed on a fresh one
and its greedy tokens are still the unsplit model's, whether the loss hits a prefill chunk, a chunk's
pending answer, a verification or the reopen itself; a verifier that never comes back, or keeps
failing, is a typed error (FailoverExhausted) after the deadline, the most recoveries or the total
deadline; a prefill chunk sent while a replay is under way goes up once, after the replayed rows."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from shared.model.adapter import DraftAdapter
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.replay import FailoverExhausted, ReplayingCloud
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

    def __init__(
        self, middle, die_at: set[int], answer_dies: set[int] = frozenset(), down_for: int = 0, link_yields: int = 0
    ):
        self.local = StrictLocalCloud(middle)
        self.link_yields = link_yields  # a slow link: each prefill frame lets the event loop run this often
        self.prefills: list[tuple[int, int]] = []  # (start, rows) of every prefill frame the verifier took
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
        for _ in range(self.link_yields):
            await asyncio.sleep(0)
        if self.calls in self.answer_dies:
            self.deaths += 1
            self.local.caches.clear()

            async def lost():
                raise VerifierLost("connection closed before the answer")

            return asyncio.ensure_future(lost())
        answer = await self.local.send_prefill(session_id, start_pos, shallow, is_last)
        self.prefills.append((start_pos, shallow.shape[0]))
        return answer

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


@pytest.mark.parametrize(
    "die_at,answer_dies,down_for",
    [
        ({1}, set(), 0),  # the open
        ({1}, set(), 2),  # the open, while the verifier is down for a while
        ({3}, set(), 0),  # the second prefill chunk's send
        (set(), {2}, 0),  # the first chunk's answer, while later chunks are in flight
        ({6}, set(), 0),  # the first verification
        ({9, 14}, set(), 0),  # two losses in the decode
        ({8}, set(), 3),  # a verification, and the first reconnects fail too
    ],
)
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
    with pytest.raises(FailoverExhausted, match="no verifier within 0.3 s") as gave_up:
        run(checkpoint, [5, 6, 7, 8, 9], cloud, deadline_s=0.3, max_backoff_s=0.25)
    assert isinstance(gave_up.value.__cause__, VerifierLost)  # the last failure goes with it
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
    lost = lambda exc: isinstance(exc, (VerifierLost, FailoverExhausted))  # noqa: E731
    result, _ = run(
        checkpoint,
        ids,
        cloud,
        deadline_s=0.2,
        generate_options={"finish_alone_on": lost, "parallel_candidates": parallel_candidates, "parallel_steps": 2},
    )
    assert result.degraded and len(result.token_ids) == 24
    verified = sum(result.accept_lengths) + 1  # the prefill's token and every verified round's
    assert 1 < verified < 24 and result.token_ids[:verified] == expected[:verified]


class FailingAfterReplay(DyingCloud):
    """A verifier that takes every replay and then loses the session at the next verification, for ever (up to
    `guard` deaths: past them it refuses with an error no replay catches, so an unbounded replay fails, not hangs);
    each reopen takes `reopen_s`."""

    def __init__(self, middle, reopen_s: float = 0.0, guard: int = 40):
        super().__init__(middle, set())
        self.reopen_s, self.guard = reopen_s, guard

    async def open(self, session_id):
        await asyncio.sleep(self.reopen_s)
        await super().open(session_id)

    async def verify(self, session_id, commit_len, shallow):
        if self.deaths >= self.guard:
            raise RuntimeError(f"still replaying after {self.deaths} losses")
        self.deaths += 1
        self.local.caches.clear()
        raise VerifierLost("the verifier lost the session again")


def test_a_verifier_that_keeps_failing_is_given_up_after_max_recoveries(tiny_llama_dir):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    cloud = FailingAfterReplay(MiddleSubmodel(checkpoint, M))
    replays: list[tuple[int, int, float]] = []
    with pytest.raises(FailoverExhausted, match="at most 3 recoveries") as gave_up:
        run(checkpoint, [5, 6, 7, 8, 9], cloud, max_recoveries=3, on_replay=lambda *event: replays.append(event))
    assert len(replays) == 3 and cloud.deaths == 4  # three replays of the context, then no fourth
    assert gave_up.value.recoveries == 3 and isinstance(gave_up.value.__cause__, VerifierLost)


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
def test_the_total_deadline_holds_when_each_recovery_is_within_its_own(tiny_llama_dir):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    cloud = FailingAfterReplay(MiddleSubmodel(checkpoint, M), reopen_s=0.1)  # each recovery takes ~0.1 s
    replays: list[tuple[int, int, float]] = []
    started = time.monotonic()
    with pytest.raises(FailoverExhausted, match="0.35 s of recovering in all") as gave_up:
        run(
            checkpoint,
            [5, 6, 7, 8, 9],
            cloud,
            deadline_s=5.0,
            max_recoveries=100,
            total_deadline_s=0.35,
            on_replay=lambda *event: replays.append(event),
        )
    assert all(seconds < 5.0 for _, _, seconds in replays)  # no recovery reached its own deadline
    assert 2 <= len(replays) <= 4 and 0.35 <= gave_up.value.recovering_s < 0.6
    assert time.monotonic() - started < 3.0


class HeldReplay(StrictLocalCloud):
    """A verifier that dies with the first prefill chunk's answer, then holds the replay's frame at `hold_at`
    until `release` is set (a slow link mid-replay); it logs every prefill frame it takes."""

    def __init__(self, middle, hold_at: int):
        super().__init__(middle)
        self.hold_at, self.died = hold_at, False
        self.reached, self.release = asyncio.Event(), asyncio.Event()
        self.prefills: list[tuple[int, int]] = []  # (start, rows) after the death

    async def send_prefill(self, session_id, start_pos, shallow, is_last):
        if not self.died:
            self.died = True
            self.caches.clear()

            async def lost():
                raise VerifierLost("connection closed before the answer")

            return asyncio.ensure_future(lost())
        if start_pos == self.hold_at and not self.release.is_set():
            self.reached.set()
            await self.release.wait()
        answer = await super().send_prefill(session_id, start_pos, shallow, is_last)
        self.prefills.append((start_pos, shallow.shape[0]))
        return answer


def test_a_prefill_chunk_sent_during_a_replay_goes_up_once_after_it(tiny_llama_dir):
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    middle = MiddleSubmodel(checkpoint, M)
    shallow = torch.randn(7, checkpoint.hidden_size, generator=torch.Generator().manual_seed(3)).to(middle.dtype)

    async def failover_with_a_chunk_in_between():
        cloud = HeldReplay(middle, hold_at=2)
        replaying = ReplayingCloud(cloud, lambda exc: isinstance(exc, VerifierLost), backoff_s=0.001, chunk_rows=2)
        await replaying.open(1)
        first = await replaying.send_prefill(1, 0, shallow[:4], False)  # its answer is lost: a replay starts
        async with asyncio.timeout(5):
            await cloud.reached.wait()  # the replay sent rows 0-1 and is sending rows 2-3
        second = asyncio.ensure_future(replaying.send_prefill(1, 4, shallow[4:], True))
        for _ in range(20):
            await asyncio.sleep(0)  # the chunk's send runs as far as it can while the replay is held
        cloud.release.set()
        async with asyncio.timeout(5):
            assert await first is None
            deep = await (await second)
        return cloud.prefills, cloud.caches[1], deep

    async def without_failure():
        cloud = LocalCloud(middle)
        await cloud.open(1)
        await (await cloud.send_prefill(1, 0, shallow[:4], False))
        deep = await (await cloud.send_prefill(1, 4, shallow[4:], True))
        return cloud.caches[1], deep

    prefills, cache, deep = asyncio.run(failover_with_a_chunk_in_between())
    assert prefills == [(0, 2), (2, 2), (4, 3)]  # the replayed rows, then the new chunk: each once, in order
    expected_cache, expected_deep = asyncio.run(without_failure())
    assert cache.length == expected_cache.length == 7
    for index in range(M, checkpoint.num_layers - M):
        got, want = cache.layer(index - M), expected_cache.layer(index - M)
        torch.testing.assert_close(got.keys[:, :7], want.keys[:, :7])
        torch.testing.assert_close(got.values[:, :7], want.values[:, :7])
    torch.testing.assert_close(deep, expected_deep)


def test_greedy_tokens_survive_a_prefill_chunk_sent_during_the_replay(tiny_llama_dir):
    """Through the decode loop: the first chunk's answer is lost while the next chunks are computed and sent
    over a slow link, so the next chunk is sent while the replay (two frames) is under way."""
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    expected = generate_full(checkpoint, ids, 24).token_ids
    cloud = DyingCloud(MiddleSubmodel(checkpoint, M), set(), answer_dies={2}, link_yields=5)
    result, replaying = run(checkpoint, ids, cloud, chunk_rows=2)
    assert result.token_ids == expected
    assert cloud.deaths == 1
    assert cloud.prefills == [(0, 2), (2, 2), (4, 4), (8, 3)]  # the lost chunk replayed, then the later ones once
