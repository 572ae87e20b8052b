"""Kept sessions: a finished HAT request's KV, held so later requests fork it instead of recomputing it.

`"keep": true` on /generate keeps what a request built once it finishes normally, on both sides of the
split: the device's input and adapter caches and the verifier's session (the middle layers' KV), under an
opaque handle. `"fork": handle` starts a request from copies of them: its prompt is a continuation of the
kept sequence (prompt + generated), and only the continuation is computed and sent. Jupiter's outline
decoding uses it: a fixed directive prefilled once, then question + outline, then every point expanded as
its own request sharing that prefix, concurrently (the kept session itself never changes).

A kept session expires `ttl_s` after it was kept or last forked; past `max_kept` the least recently used
goes first. Dropping one frees the device caches at once and closes the verifier's session from the
registry's own cleanup task.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from shared.model.kv_cache import SessionKV
from shared.specdec.decode_loop import prefill_on_cloud
from shared.specdec.device_session import DeviceSession
from shared.specdec.session_loop import SessionLoop, ShieldedOffload, release_session
from shared.specdec.verify_layout import VerifyLayout, verify_on

log = logging.getLogger("services.device_agent.kept")

CLEANUP_INTERVAL_S = 5.0  # at most this long between expiry sweeps (sooner when the TTL is shorter)


class UnknownKeptSession(KeyError):
    """No kept session has this handle (never kept, deleted, expired or evicted)."""


@dataclass(eq=False)
class KeptSession:
    handle: str
    token_ids: list[int]  # the kept sequence: prompt + generated
    cache_len: int  # positions in the caches: the last generated token, if any, is not in them yet
    input_cache: SessionKV
    adapter_cache: SessionKV | None
    cloud_session_id: int  # the verifier's session holding the same positions
    rows: list[torch.Tensor]  # the [H] shallow rows of those positions: what a lost verifier is replayed
    last_used: float

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def fork_caches(self) -> tuple[SessionKV, SessionKV | None]:
        """Independent copies of the kept device caches (the kept ones stay as they are)."""
        adapter = self.adapter_cache.fork(self.cache_len) if self.adapter_cache is not None else None
        return self.input_cache.fork(self.cache_len), adapter

    def free_device(self) -> None:
        self.input_cache.free()
        if self.adapter_cache is not None:
            self.adapter_cache.free()


class KeptSessions:
    """The agent's kept sessions by handle: TTL, LRU cap and an owned cleanup task (`cleanup_loop`)."""

    def __init__(
        self,
        ttl_s: float,
        max_kept: int,
        close_cloud: Callable[[int], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl_s, self.max_kept = ttl_s, max_kept
        self.close_cloud = close_cloud  # closes a verifier session; bounded by the cloud client's timeout
        self.clock = clock
        self._kept: OrderedDict[str, KeptSession] = OrderedDict()  # least recently used first
        self._to_close: list[int] = []  # verifier sessions of dropped entries, closed by the cleanup task
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(
        self,
        token_ids: Sequence[int],
        cache_len: int,
        input_cache: SessionKV,
        adapter_cache: SessionKV | None,
        cloud_session_id: int,
        rows: list[torch.Tensor],
    ) -> KeptSession:
        """Take over these caches (and the verifier's session) under a fresh handle."""
        entry = KeptSession(
            secrets.token_urlsafe(16),
            list(token_ids),
            cache_len,
            input_cache,
            adapter_cache,
            cloud_session_id,
            rows,
            self.clock(),
        )
        self._kept[entry.handle] = entry
        while len(self._kept) > self.max_kept:
            _, oldest = self._kept.popitem(last=False)
            log.info("kept session %s evicted: more than %d kept", oldest.handle, self.max_kept)
            self._drop(oldest)
        return entry

    def get(self, handle: str) -> KeptSession:
        """The live kept session with this handle (using it restarts its TTL), else UnknownKeptSession."""
        self.expire()
        entry = self._kept.get(handle)
        if entry is None:
            raise UnknownKeptSession(handle)
        entry.last_used = self.clock()
        self._kept.move_to_end(handle)
        return entry

    async def delete(self, handle: str) -> bool:
        entry = self._kept.pop(handle, None)
        if entry is None:
            return False
        entry.free_device()
        await self.close_cloud(entry.cloud_session_id)
        return True

    def expire(self) -> int:
        """Drop every entry unused for the TTL; returns how many."""
        deadline = self.clock() - self.ttl_s
        stale = [handle for handle, entry in self._kept.items() if entry.last_used <= deadline]
        for handle in stale:
            log.info("kept session %s expired after %.0f s unused", handle, self.ttl_s)
            self._drop(self._kept.pop(handle))
        return len(stale)

    def _drop(self, entry: KeptSession) -> None:
        entry.free_device()
        self._to_close.append(entry.cloud_session_id)
        self._wake.set()

    async def flush(self) -> None:
        """Close the verifier sessions of dropped entries."""
        while self._to_close:
            await self.close_cloud(self._to_close.pop())

    async def cleanup_loop(self) -> None:
        """The owned background task: expire on time, close what was dropped."""
        while True:
            try:
                async with asyncio.timeout(min(self.ttl_s / 4, CLEANUP_INTERVAL_S)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.expire()
                await self.flush()
            except Exception:  # noqa: BLE001 - a failed sweep must not end the task; the next one retries
                log.exception("kept-session cleanup failed")

    async def aclose(self) -> None:
        """Drop everything (shutdown)."""
        while self._kept:
            self._drop(self._kept.popitem()[1])
        await self.flush()


class KeepableSession(DeviceSession):
    """A DeviceSession whose caches can outlive it: finished normally, `free()` hands them to `on_keep`
    (and then `close` of its `SessionCloud` leaves the verifier's session open) instead of freeing them."""

    on_keep: Callable[["KeepableSession"], KeptSession] | None = None  # set for "keep": true
    kept: KeptSession | None = None
    fork_of: KeptSession | None = None  # "fork": its caches start as copies of this one's
    prefill_only = False  # max_new_tokens 0: prefill the prompt, generate nothing
    prefilled = False

    def start_from(self, parent: KeptSession) -> None:
        """Continue `parent`'s sequence: its caches, copied; `prompt_ids` must begin with its tokens."""
        DeviceSession.free(self)  # the fresh, empty caches
        self.input_cache, self.adapter_cache = parent.fork_caches()
        self.fork_of = parent

    @property
    def cached_tokens(self) -> int:
        return self.fork_of.cache_len if self.fork_of is not None else 0

    @property
    def finished_normally(self) -> bool:
        return not self.degraded and (self.prefilled if self.prefill_only else self.is_finished)

    def free(self) -> None:
        if self.on_keep is not None and self.kept is None and self.finished_normally:
            self.kept = self.on_keep(self)
            return
        DeviceSession.free(self)


class SessionCloud:
    """One request's view of the agent's (replaying) cloud: it opens by forking the kept session its
    device session starts from, and leaves the verifier's session open once that device session was kept."""

    def __init__(self, inner, session: KeepableSession):
        self.inner, self.session = inner, session

    async def open(self, session_id: int) -> None:
        parent = self.session.fork_of
        if parent is None:
            await self.inner.open(session_id)
        else:
            await self.inner.fork(session_id, parent.cloud_session_id, parent.cache_len, parent.rows)

    async def send_prefill(self, session_id: int, start_pos: int, shallow: torch.Tensor, is_last: bool):
        return await self.inner.send_prefill(session_id, start_pos, shallow, is_last)

    async def verify(
        self, session_id: int, commit_len: int, shallow: torch.Tensor, layout: VerifyLayout | None = None
    ) -> torch.Tensor:
        return await verify_on(self.inner, session_id, commit_len, shallow, layout)

    async def send_verify(self, session_id: int, commit_len: int, shallow: torch.Tensor):
        return await self.inner.send_verify(session_id, commit_len, shallow)

    async def close(self, session_id: int) -> None:
        if self.session.kept is None:
            await self.inner.close(session_id)


class PrefillOnlyLoop(SessionLoop):
    """max_new_tokens 0: prefill the prompt on both sides (to keep it), deliver no token."""

    def __init__(
        self,
        session: KeepableSession,
        cloud: SessionCloud,
        session_id: int,
        chunk_sizes: Sequence[int],
        offload: Callable[..., Awaitable],
        overlap_prefill: bool,
    ):
        self.session, self.cloud, self.session_id = session, cloud, session_id
        self.chunk_sizes, self.overlap_prefill = chunk_sizes, overlap_prefill
        self.offload = ShieldedOffload(offload)

    @property
    def finished(self) -> bool:
        return self.session.prefilled

    async def open(self) -> None:
        await self.cloud.open(self.session_id)

    async def step(self) -> None:
        await prefill_on_cloud(
            self.session, self.cloud, self.session_id, self.chunk_sizes, self.offload, self.overlap_prefill
        )
        self.session.prefilled = True

    async def close(self) -> None:
        await release_session(self.cloud, self.session_id, self.session, self.offload.last)
