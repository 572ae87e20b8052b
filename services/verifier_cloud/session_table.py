"""The verifier's open sessions: the scheduler's records and the KV behind them, opened and closed together.

A session exists in two places, the scheduler's record (session.py: its queue, who owns it) and
its KV (runner.py in this process, or one slice per stage worker, pipeline.py); this table keeps
the two in step, so no half-open session stays behind when either refuses. It also holds the
bound on sessions per device over all its connections, by the device's token subject.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from websockets.asyncio.server import ServerConnection

from services.verifier_cloud.frames import to_wire
from services.verifier_cloud.pipeline import StagePipeline
from services.verifier_cloud.runner import ModelRunner
from services.verifier_cloud.scheduler import Scheduler
from services.verifier_cloud.session import Session
from services.verifier_cloud.settings import Settings
from services.verifier_cloud.work import EngineError, ErrorKind
from services.verifier_cloud.work_item import WorkItem
from shared import wire

log = logging.getLogger("services.verifier_cloud")


class SessionTable:
    def __init__(
        self, settings: Settings, scheduler: Scheduler, runner: ModelRunner | None, pipeline: StagePipeline | None
    ) -> None:
        """`runner` for the in-process path (P = 1), else `pipeline` (P > 1 stage workers)."""
        self.settings = settings
        self.scheduler = scheduler
        self.runner = runner
        self.pipeline = pipeline
        # Whom each connection's sessions count toward: its device token's subject, kept at the handshake
        self.device_of: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()

    def get(self, session_id: int, connection: ServerConnection, seq_no: int | None = None) -> Session:
        try:
            return self.scheduler.get(session_id, connection, seq_no)
        except EngineError as exc:
            raise to_wire(exc) from None

    def device(self, connection: object) -> object:
        """Whom a connection's sessions count toward: its token's device id; with auth off, itself."""
        return self.device_of.get(connection, connection)

    def check_device_limit(self, session: Session) -> None:
        """One device holds at most `max_sessions_per_device` sessions over all its connections: OVERLOADED,
        as the per-connection bound answers (more connections buy a device nothing)."""
        device, limit = self.device(session.owner), self.settings.device_session_limit
        held = sum(1 for other in self.scheduler.sessions.values() if self.device(other.owner) == device)
        if held >= limit:
            raise EngineError(
                ErrorKind.OVERLOADED,
                f"this device holds {limit} sessions over its connections, the most one device may",
                session.session_id,
            )

    def open(self, session: Session, fork_of: tuple[int, int | None] | None = None) -> wire.Message:
        """`fork_of` (parent_id, length): the new session's KV copies that prefix of the parent's."""
        try:
            self.check_device_limit(session)
            self.scheduler.open(session)
            if self.runner is not None and fork_of is not None:
                self.runner.fork(session.session_id, *fork_of, opened_as=session)
            elif self.runner is not None:
                self.runner.open(session.session_id, session.sampling, opened_as=session)
            else:
                assert self.pipeline is not None  # without a runner the KV lives in the pipeline's stages
                if fork_of is not None:
                    self.pipeline.fork_session(session.session_id, *fork_of)
                else:
                    self.pipeline.open_session(session.session_id)
        except Exception as exc:  # noqa: BLE001 - whatever refused it, no half-open session stays behind
            if self.scheduler.sessions.get(session.session_id) is session:  # the runner refused or failed it
                self.scheduler.close(session.session_id)
            if isinstance(exc, EngineError):
                raise to_wire(exc, session.session_id) from None
            raise
        return wire.SessionOpened(session.session_id)

    def close(self, session_id: int) -> None:
        if self.scheduler.close(session_id) is None:
            return
        if self.runner is not None:
            self.runner.close(session_id)  # deferred by the runner while a pass is using the caches
        else:
            assert self.pipeline is not None  # without a runner the KV lives in the pipeline's stages
            self.pipeline.close_session(session_id)

    def close_owned_by(self, connection: ServerConnection) -> list[int]:
        closed = self.scheduler.owned_by(connection)
        for sid in closed:
            self.close(sid)
        return closed

    def submit(self, item: WorkItem, connection: ServerConnection) -> None:
        try:
            self.scheduler.submit(item, connection)
        except EngineError as exc:
            raise to_wire(exc, item.session_id, item.seq_no) from None

    async def close_idle(self) -> None:
        """A task: close sessions without traffic for `session_idle_ttl_s`, a few times per TTL."""
        ttl_s = self.settings.session_idle_ttl_s
        while True:
            await asyncio.sleep(min(ttl_s / 3, 10.0))
            try:
                for sid in self.scheduler.idle(time.monotonic(), ttl_s):
                    log.info("session %d idle for %.0fs; closing it and freeing its KV", sid, ttl_s)
                    self.close(sid)
            except Exception:  # noqa: BLE001 - a failed sweep must not end the server; the next one retries
                log.exception("idle-session sweep failed")
