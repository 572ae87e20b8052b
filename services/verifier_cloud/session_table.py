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

from services.verifier_cloud.budgets import Budgets
from services.verifier_cloud.frames import to_wire
from services.verifier_cloud.pipeline import StagePipeline
from services.verifier_cloud.runner import ModelRunner
from services.verifier_cloud.scheduler import Scheduler
from services.verifier_cloud.session import Session
from services.verifier_cloud.settings import Settings
from services.verifier_cloud.work import EngineError, ErrorKind
from services.verifier_cloud.work_item import WorkItem
from shared.wire import schema as wire

log = logging.getLogger("services.verifier_cloud")


class SessionTable:
    def __init__(
        self,
        settings: Settings,
        scheduler: Scheduler,
        runner: ModelRunner | None,
        pipeline: StagePipeline | None,
        kv_bytes_per_position: tuple[int, int | None] = (0, None),
        static_capacity: int | None = None,
    ) -> None:
        """`runner` for the in-process path (P = 1), else `pipeline` (P > 1 stage workers);
        `kv_bytes_per_position`: (a session's, a token session's or None) KV bytes per position (budgets.py);
        `static_capacity`: the static KV layout's slot in positions (None: growable caches)."""
        self.settings = settings
        self.scheduler = scheduler
        self.runner = runner
        self.pipeline = pipeline
        # Whom each connection's sessions count toward: its device token's subject, kept at the handshake
        self.device_of: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
        self.budgets = Budgets(
            settings,
            scheduler.context_length,
            *kv_bytes_per_position,
            device_of=self.device,
            sessions=lambda: scheduler.sessions.values(),
            static_capacity=static_capacity,
        )

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

    def open(self, session: Session, fork_of: tuple[Session, int | None] | None = None) -> wire.Message | None:
        """Open `session`, its KV charged to its device's budget (budgets.py). `fork_of` (parent, length):
        its KV copies that prefix (None: all) of the parent's. With the in-process runner the copy runs in a
        worker thread: this returns None and the caller awaits `copy_fork` for the answer."""
        try:
            self.check_device_limit(session)
            if fork_of is None:
                self.budgets.open(session)
            else:
                self.budgets.fork(session, fork_of[0], fork_of[1])
            self.scheduler.open(session)
            if fork_of is not None and self.runner is not None:
                session.opening = True  # nothing runs on it, nor on the parent, until the copy is in
                fork_of[0].copies += 1
                return None
            if self.runner is not None:
                self.runner.open(session.session_id, session.sampling, opened_as=session)
            else:
                assert self.pipeline is not None  # without a runner the KV lives in the pipeline's stages
                if fork_of is not None:  # the stage workers copy, in their own processes
                    self.pipeline.fork_session(session.session_id, fork_of[0].session_id, fork_of[1])
                else:
                    self.pipeline.open_session(session.session_id)
        except Exception as exc:  # noqa: BLE001 - whatever refused it, no half-open session stays behind
            if self.scheduler.sessions.get(session.session_id) is session:  # the runner refused or failed it
                self.scheduler.close(session.session_id)
            if isinstance(exc, EngineError):
                raise to_wire(exc, session.session_id) from None
            raise
        return wire.SessionOpened(session.session_id)

    async def copy_fork(self, session: Session, parent: Session, length: int | None) -> wire.Message | None:
        """The copy of a fork `open` admitted, in a worker thread (an event loop that copied a full-context
        KV would keep every other device waiting): SessionOpened, or the error as a frame; None when the
        session was closed meanwhile (nobody to answer). While it runs neither session is scheduled."""
        assert self.runner is not None  # `open` leaves a copy to await only on the in-process path
        sid = session.session_id
        try:
            caches = await asyncio.to_thread(self.runner.fork_copy, sid, parent.session_id, length, opened_as=session)
        except EngineError as exc:
            if self.scheduler.sessions.get(sid) is session:
                self.scheduler.close(sid)
            return to_wire(exc, sid).to_frame()
        except Exception as exc:  # noqa: BLE001 - a failed copy fails this fork, never the connection
            log.exception("session %d: fork of session %d failed", sid, parent.session_id)
            if self.scheduler.sessions.get(sid) is session:
                self.scheduler.close(sid)
            return wire.WireError(wire.ErrorCode.INTERNAL, f"fork failed: {type(exc).__name__}", sid).to_frame()
        finally:
            parent.copies -= 1
            session.opening = False
            self.scheduler.wake()
        if self.scheduler.sessions.get(sid) is not session:  # closed (perhaps reopened) while it copied
            caches.free()
            return None
        self.runner.install(sid, caches)
        return wire.SessionOpened(sid)

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
        """Queue `item`, unless it can never run or would pass a budget (budgets.py) or the queue's bound."""
        try:
            session = self.scheduler.get(item.session_id, connection, item.seq_no)
            admission = self.budgets.admit(item, session)
            self.scheduler.submit(item, connection)
            admission.apply(session, item)
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
