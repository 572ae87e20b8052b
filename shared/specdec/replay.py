"""A cloud session that survives losing its verifier: keep what was sent, replay it elsewhere.

The verifier's whole state for a session is the middle layers' KV of the committed prefix,
and that is a function of the shallow hidden states the device sent for those positions. So,
as Petals' client keeps its inputs, `ReplayingCloud` keeps every shallow row it uploaded,
indexed by position (a verify's drafted rows are provisional: the next verify's `commit_len`
says how many of them the session kept). When a request fails because the verifier went away
(`is_lost(exc)`), it reopens the session (the inner cloud reconnects, to another replica when it
has several), replays the kept rows as prefill chunks, and sends the failed request again. The
user sees a gap, not an error; the tokens are the same, because the replayed cache holds the
same states. A recovery is retried with backoff for at most `deadline_s`; a session is recovered
at most `max_recoveries` times and spends at most `total_deadline_s` recovering, all its
recoveries together. Past any of these the replay gives up with `FailoverExhausted` (the last
failure is its cause): a verifier that keeps failing is not sent the whole context again and again.
What counts as lost is the caller's `is_lost`; the device agent's leaves timeouts out (an
overloaded verifier still holds the session, and a replay would only add the context to its load).

One recovery per loss: requests of the same session that fail together (pipelined prefill
chunks) wait for the first one's recovery instead of starting their own. The session's rows are
logged, and their frames sent, under the session's lock, which a recovery holds while it replays:
a chunk sent during a recovery goes up after the replayed rows, on the recovered session, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from shared.net.backoff import Backoff
from shared.specdec.decode_loop import Cloud, done_future
from shared.specdec.verify_layout import VerifyLayout, verify_on

log = logging.getLogger(__name__)


class FailoverExhausted(ConnectionError):
    """A session lost its verifier and the replay gave up: too many recoveries, or too long recovering."""

    def __init__(self, session_id: int, reason: str, recoveries: int, recovering_s: float, last: BaseException):
        super().__init__(
            f"session {session_id}: failover gave up ({reason}) after {recoveries} recoveries and "
            f"{recovering_s:.1f} s recovering; last failure: {type(last).__name__}: {last}"
        )
        self.session_id, self.recoveries, self.recovering_s = session_id, recoveries, recovering_s


class _ForkingCloud(Cloud, Protocol):
    """A `Cloud` that also forks sessions (WebSocketCloud); only a caller that forks asks for it."""

    async def fork(self, session_id: int, parent_id: int, length: int) -> None: ...


@dataclass
class _SessionLog:
    rows: list[torch.Tensor] = field(default_factory=list)  # one [H] shallow row per position sent
    prefill_done: bool = False  # the last prefill chunk was sent (its answer is the session's first deep row)
    epoch: int = 0  # bumped by every successful recovery
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_deep: torch.Tensor | None = None  # the replayed last prefill chunk's answer
    replays: int = 0
    recovering_s: float = 0.0  # the time spent recovering so far, every recovery together
    gave_up: FailoverExhausted | None = None  # set once failover gave up: later losses are not recovered either


class ReplayingCloud:
    """Wraps a `Cloud`; same protocol. `chunk_rows` bounds the rows of one replayed prefill frame."""

    def __init__(
        self,
        inner: Cloud,
        is_lost: Callable[[BaseException], bool],
        *,
        deadline_s: float = 30.0,
        max_recoveries: int = 3,
        total_deadline_s: float = 60.0,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
        chunk_rows: int = 512,
        on_replay: Callable[[int, int, float], None] | None = None,
    ) -> None:
        if min(deadline_s, total_deadline_s, backoff_s) <= 0 or chunk_rows < 1 or max_recoveries < 0:
            raise ValueError(
                "deadline_s, total_deadline_s and backoff_s must be > 0, chunk_rows >= 1 and max_recoveries >= 0"
            )
        self.inner = inner
        self.is_lost = is_lost
        self.deadline_s = deadline_s
        self.max_recoveries = max_recoveries
        self.total_deadline_s = total_deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._backoff = Backoff(backoff_s, max(max_backoff_s, backoff_s))  # a first wait above the cap is kept
        self.chunk_rows = chunk_rows
        self.on_replay = on_replay  # (session_id, rows replayed, seconds from the failure to recovered)
        self.sessions: dict[int, _SessionLog] = {}

    # -- the Cloud protocol ------------------------------------------------------------------------
    async def open(self, session_id: int) -> None:
        self.sessions[session_id] = _SessionLog()
        await self._with_recovery(session_id, lambda: self.inner.open(session_id), reopen_only=True)

    async def fork(self, session_id: int, parent_id: int, length: int, rows: list[torch.Tensor]) -> None:
        """Open `session_id` as a copy of `parent_id`'s first `length` positions (the inner cloud's `fork`);
        `rows` are the [H] shallow rows that built them, kept by whoever kept the parent: the child's log
        starts with them, so a verifier that lost the parent (or the child) is recovered by replaying them."""
        if len(rows) != length:
            raise ValueError(f"a fork of {length} positions needs {length} rows, got {len(rows)}")
        record = self.sessions[session_id] = _SessionLog(rows=list(rows))
        try:
            await cast(_ForkingCloud, self.inner).fork(session_id, parent_id, length)
        except Exception as exc:  # noqa: BLE001 - only a lost verifier (or parent) is recovered; others re-raised
            if not self.is_lost(exc):
                raise
            await self._recover(session_id, record.epoch, None, exc)

    def rows(self, session_id: int, length: int) -> list[torch.Tensor]:
        """The [H] shallow rows sent for the session's first `length` positions (what a fork of it replays)."""
        return list(self.sessions[session_id].rows[:length])

    async def send_prefill(
        self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool
    ) -> Awaitable[torch.Tensor | None]:
        record = self.sessions[session_id]
        lost: Exception | None = None
        async with record.lock:  # after a recovery in progress, whose replay sends the rows logged before this chunk
            del record.rows[start_pos:]
            record.rows.extend(shallow.unbind(0))  # shallow: [S, H]
            record.prefill_done = record.prefill_done or is_last
            epoch = record.epoch
            try:
                answer = await self.inner.send_prefill(session_id, start_pos, shallow, is_last)
            except Exception as exc:  # noqa: BLE001 - only a lost verifier is recovered; others re-raised
                if not self.is_lost(exc):
                    raise
                lost = exc
        if lost is not None:  # recovered outside the lock, which the recovery takes
            return done_future(await self._prefill_after_loss(session_id, epoch, is_last, lost))
        return asyncio.ensure_future(self._prefill_answer(session_id, epoch, answer, is_last))

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        record = self.sessions[session_id]
        async with record.lock:  # not while a recovery replays these rows
            if layout is not None and layout.kept:  # the last tree's accepted rows move down, as in the cloud's KV
                base = commit_len - len(layout.kept)
                record.rows[base:] = [record.rows[row] for row in layout.kept]
            del record.rows[commit_len:]  # the previous round's rejected drafts
            record.rows.extend(shallow.unbind(0))  # shallow: [k+1, H], provisional until the next commit_len
            epoch = record.epoch

        def request() -> Awaitable[torch.Tensor]:
            # After a recovery the replayed KV holds the committed rows in place: nothing left to move.
            moved = layout if layout is None or record.epoch == epoch else layout.without_kept()
            return verify_on(self.inner, session_id, commit_len, shallow, moved)

        return await self._with_recovery(session_id, request, keep=commit_len)

    async def close(self, session_id: int) -> None:
        self.sessions.pop(session_id, None)
        await self.inner.close(session_id)

    # -- recovery ------------------------------------------------------------------------------------
    async def _prefill_answer(
        self, session_id: int, epoch: int, answer: Awaitable[torch.Tensor | None], is_last: bool
    ) -> torch.Tensor | None:
        try:
            return await answer
        except Exception as exc:  # noqa: BLE001 - as in send_prefill
            if not self.is_lost(exc):
                raise
            return await self._prefill_after_loss(session_id, epoch, is_last, exc)

    async def _prefill_after_loss(
        self, session_id: int, epoch: int, is_last: bool, exc: BaseException
    ) -> torch.Tensor | None:
        """A prefill chunk was lost: the recovery replays every row logged when it starts (this chunk's, and
        any chunk sent after it on the lost session, included)."""
        record = await self._recover(session_id, epoch, None, exc)
        return record.last_deep if is_last else None

    async def _with_recovery(
        self, session_id: int, request: Callable[[], Awaitable], *, keep: int | None = None, reopen_only: bool = False
    ):
        while True:
            record = self.sessions[session_id]
            epoch = record.epoch
            try:
                return await request()
            except Exception as exc:  # noqa: BLE001 - as in send_prefill
                if not self.is_lost(exc):
                    raise
                await self._recover(session_id, epoch, 0 if reopen_only else keep, exc)
                if reopen_only:
                    return None  # the recovery's replay opened the session: opening it again would be refused

    async def _recover(self, session_id: int, epoch: int, keep: int | None, exc: BaseException) -> _SessionLog:
        """Reopen the session and replay its first `keep` rows (None: all), once per loss; give up with
        FailoverExhausted past `max_recoveries`, or past a deadline (this recovery's or the session's total)."""
        record = self.sessions[session_id]
        async with record.lock:
            if record.epoch != epoch:
                return record  # a request that failed with ours already recovered the session
            if record.gave_up is not None:
                raise record.gave_up  # requests that failed with the one that gave up fail with it
            if record.replays >= self.max_recoveries:
                raise self._give_up(session_id, record, f"at most {self.max_recoveries} recoveries", exc) from exc
            failed_at = time.monotonic()
            total_left_s = self.total_deadline_s - record.recovering_s
            if total_left_s < self.deadline_s:
                deadline_s, why = total_left_s, f"{self.total_deadline_s:g} s of recovering in all"
            else:
                deadline_s, why = self.deadline_s, f"no verifier within {self.deadline_s:g} s"
            log.warning(
                "session %d lost its verifier (%s); replaying %s rows",
                session_id,
                exc,
                len(record.rows) if keep is None else keep,
            )
            gave_up_on = await self._replay_until(session_id, record, keep, failed_at + deadline_s, exc)
            record.recovering_s += time.monotonic() - failed_at
            if gave_up_on is not None:
                raise self._give_up(session_id, record, why, gave_up_on) from gave_up_on
            record.epoch += 1
            record.replays += 1
            replayed = len(record.rows) if keep is None else keep
            log.info("session %d replayed %d rows in %.2f s", session_id, replayed, time.monotonic() - failed_at)
            if self.on_replay is not None:
                self.on_replay(session_id, replayed, time.monotonic() - failed_at)
            return record

    async def _replay_until(
        self, session_id: int, record: _SessionLog, keep: int | None, deadline: float, exc: BaseException
    ) -> BaseException | None:
        """Try the replay, with backoff, until one succeeds (None) or `deadline` (time.monotonic()) passes (the
        last failure); each try is cut at the deadline too (a replay to a verifier that does not answer would
        otherwise last as long as its request timeouts)."""
        delay, last_error = self._backoff.after(None), exc
        while (left := deadline - time.monotonic()) > 0:
            attempt = asyncio.timeout(left)
            try:
                async with attempt:
                    await self._replay(session_id, record, keep)
                return None
            except Exception as retry_exc:  # noqa: BLE001 - as in send_prefill
                if not (attempt.expired() or self.is_lost(retry_exc)):
                    raise
                last_error = retry_exc
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))  # the last try lands on it
            delay = self._backoff.after(delay)
        return last_error

    def _give_up(self, session_id: int, record: _SessionLog, reason: str, last: BaseException) -> FailoverExhausted:
        log.error("session %d: failover gave up (%s); last failure: %s", session_id, reason, last)
        record.gave_up = FailoverExhausted(session_id, reason, record.replays, record.recovering_s, last)
        return record.gave_up

    async def _replay(self, session_id: int, record: _SessionLog, keep: int | None) -> None:
        rows = record.rows[:keep]  # a copy (None: all); the log does not change meanwhile (the lock is held)
        # A verifier that still holds the session (a try cut at the deadline, or a caller whose is_lost counts
        # timeouts) must let it go before it is opened again (a dead one dropped it; closing is then a no-op).
        await self.inner.close(session_id)
        await self.inner.open(session_id)
        record.last_deep = None
        if not rows:
            return
        # The replayed prefix ends the prefill if the original prefill had ended (always, once verifying).
        final = record.prefill_done
        answers = []
        for start in range(0, len(rows), self.chunk_rows):
            chunk = torch.stack(rows[start : start + self.chunk_rows])  # [S, H]
            is_last = final and start + self.chunk_rows >= len(rows)
            answers.append(await self.inner.send_prefill(session_id, start, chunk, is_last))
        for answer in answers:
            deep = await answer
            if deep is not None:
                record.last_deep = deep
