"""A cloud session that survives losing its verifier: keep what was sent, replay it elsewhere.

The verifier's whole state for a session is the middle layers' KV of the committed prefix,
and that is a function of the shallow hidden states the device sent for those positions. So,
as Petals' client keeps its inputs, `ReplayingCloud` keeps every shallow row it uploaded,
indexed by position (a verify's drafted rows are provisional: the next verify's `commit_len`
says how many of them the session kept). When a request fails because the verifier went away
(`is_lost(exc)`), it reopens the session (the inner cloud reconnects, to another replica when it
has several), replays the kept rows as prefill chunks, and sends the failed request again. The
user sees a gap, not an error; the tokens are the same, because the replayed cache holds the
same states. Recovery is retried with backoff until `deadline_s` after the failure; then the
last failure is raised.

One recovery per loss: requests of the same session that fail together (pipelined prefill
chunks) wait for the first one's recovery instead of starting their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from shared.backoff import Backoff
from shared.specdec.engine import Cloud, done_future
from shared.specdec.verify_layout import VerifyLayout, verify_on

log = logging.getLogger(__name__)


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


class ReplayingCloud:
    """Wraps a `Cloud`; same protocol. `chunk_rows` bounds the rows of one replayed prefill frame."""

    def __init__(
        self,
        inner: Cloud,
        is_lost: Callable[[BaseException], bool],
        *,
        deadline_s: float = 30.0,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
        chunk_rows: int = 512,
        on_replay: Callable[[int, int, float], None] | None = None,
    ) -> None:
        if deadline_s <= 0 or backoff_s <= 0 or chunk_rows < 1:
            raise ValueError("deadline_s and backoff_s must be > 0 and chunk_rows >= 1")
        self.inner = inner
        self.is_lost = is_lost
        self.deadline_s = deadline_s
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
        del record.rows[start_pos:]
        record.rows.extend(shallow.unbind(0))  # shallow: [S, H]
        record.prefill_done = record.prefill_done or is_last
        epoch = record.epoch
        try:
            answer = await self.inner.send_prefill(session_id, start_pos, shallow, is_last)
        except Exception as exc:  # noqa: BLE001 - only a lost verifier is recovered; others re-raised below
            if not self.is_lost(exc):
                raise
            return done_future(await self._prefill_after_loss(session_id, epoch, is_last, exc))
        return asyncio.ensure_future(self._prefill_answer(session_id, epoch, answer, is_last))

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        record = self.sessions[session_id]
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
        """A prefill chunk was lost: the recovery replays every row sent so far (this chunk's included)."""
        record = await self._recover(session_id, epoch, len(self.sessions[session_id].rows), exc)
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
        """Reopen the session and replay its first `keep` rows (None: all), once per loss."""
        record = self.sessions[session_id]
        async with record.lock:
            if record.epoch != epoch:
                return record  # a request that failed with ours already recovered the session
            failed_at = time.monotonic()
            log.warning(
                "session %d lost its verifier (%s); replaying %s rows",
                session_id,
                exc,
                len(record.rows) if keep is None else keep,
            )
            delay, last_error = self._backoff.after(None), exc
            while True:
                try:
                    await self._replay(session_id, record, keep)
                    break
                except Exception as retry_exc:  # noqa: BLE001 - as in send_prefill
                    if not self.is_lost(retry_exc):
                        raise
                    last_error = retry_exc
                left = self.deadline_s - (time.monotonic() - failed_at)
                if left <= 0:
                    log.error("session %d: no verifier within %.1f s", session_id, self.deadline_s)
                    raise last_error
                await asyncio.sleep(min(delay, left))  # the last try lands on the deadline
                delay = self._backoff.after(delay)
            record.epoch += 1
            record.replays += 1
            replayed = len(record.rows) if keep is None else keep
            log.info("session %d replayed %d rows in %.2f s", session_id, replayed, time.monotonic() - failed_at)
            if self.on_replay is not None:
                self.on_replay(session_id, replayed, time.monotonic() - failed_at)
            return record

    async def _replay(self, session_id: int, record: _SessionLog, keep: int | None) -> None:
        rows = record.rows if keep is None else record.rows[:keep]
        # A verifier that timed out but still holds the session must let it go before it is opened again
        # (a dead one dropped it with the connection; closing is then a no-op).
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
