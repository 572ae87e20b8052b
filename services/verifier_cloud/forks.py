"""ForkSession on the verifier: a session whose KV copies a parent's prefix, the copy in a worker thread so the
event loop (every other device's socket) never waits for it."""

from __future__ import annotations

import asyncio
from typing import Protocol

from websockets.asyncio.server import ServerConnection

from services.verifier_cloud.device_link import DeviceLink
from services.verifier_cloud.scheduler import Scheduler
from services.verifier_cloud.session import Session
from services.verifier_cloud.session_table import SessionTable
from services.verifier_cloud.work import EngineError
from shared.wire import schema as wire


class VerifierServer(Protocol):
    """What a fork uses of server.VerifierServer (named here, not imported: the server imports this module)."""

    scheduler: Scheduler
    sessions: SessionTable
    link: DeviceLink
    forks: set[asyncio.Task]

    @property
    def is_ready(self) -> bool: ...


def fork(server: VerifierServer, connection: ServerConnection, message: wire.ForkSession) -> wire.Message | None:
    """A session whose KV copies a parent's prefix (a kept prompt goes on without being computed again);
    None while the copy runs in a worker thread (its answer follows, `finish_fork`)."""
    sid = message.session_id
    try:
        parent = server.scheduler.get(message.parent_id, connection)
    except EngineError:
        raise wire.WireError(
            wire.ErrorCode.UNKNOWN_SESSION, f"unknown parent session {message.parent_id}", sid
        ) from None
    if parent.is_busy or parent.is_token:  # a busy parent's KV may be changing under the copy
        raise wire.WireError(
            wire.ErrorCode.OVERLOADED if parent.is_busy else wire.ErrorCode.MALFORMED,
            f"parent session {message.parent_id} is {'busy' if parent.is_busy else 'a token-mode session'}",
            sid,
        )
    if not server.is_ready:
        raise wire.WireError(wire.ErrorCode.OVERLOADED, "verifier is not ready", sid)
    parent.touch()  # forking a kept prefix is using it: the idle sweep leaves it be
    if parent.opening:  # a fork whose own copy is not in yet
        raise wire.WireError(
            wire.ErrorCode.OVERLOADED, f"parent session {message.parent_id} is still being opened", sid
        )
    session = Session(sid, connection, privacy=parent.privacy, wire_dtype=parent.wire_dtype)
    opened = server.sessions.open(session, fork_of=(parent, message.length))
    if opened is not None:  # stage workers (P > 1) copy in their own processes
        return opened
    # In-process: the copy runs in a worker thread, and SessionOpened (or the error) follows it.
    task = asyncio.create_task(finish_fork(server, connection, session, parent, message.length))
    server.forks.add(task)
    task.add_done_callback(server.forks.discard)
    return None


async def finish_fork(
    server: VerifierServer, connection: ServerConnection, session: Session, parent: Session, length: int | None
) -> None:
    reply = await server.sessions.copy_fork(session, parent, length)
    if reply is not None:
        await server.link.send(connection, reply)
