"""The verifier's side of one device connection: the frame loop and the sends back.

`DeviceLink.serve` reads a connection's frames until it closes or stays idle for `idle_timeout_s`.
Each frame is decoded and checked (size, hidden size, finite values) and handed to the server's handler;
a refused frame, or a bug met by one, is answered with a typed ErrorFrame (frames.py's BadFrameLog counts
them) and the connection and every other session keep working. When the connection ends, every session
it opened is closed and its KV freed. Sends are bounded by `send_timeout_s`; replies from the engine's
synchronous callbacks go out as owned tasks, in the session's wire dtype. The bytes written to a connection
and not yet taken by its socket are bounded by `send_buffer_bytes`: a device that stops reading is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from services.verifier_cloud.frames import BadFrameLog, reply_frame
from services.verifier_cloud.session_table import SessionTable
from services.verifier_cloud.settings import Settings
from services.verifier_cloud.work import EngineError
from services.verifier_cloud.work_item import Reply, WorkItem
from shared.specdec.draft_stream import ChunkVerdict
from shared.wire import schema as wire

log = logging.getLogger("services.verifier_cloud")


class EndConnection(Exception):
    """Raised by a handler: answer the frame with `reply`, then close the connection (`code`, `reason`)."""

    def __init__(self, reply: wire.ErrorFrame, code: int, reason: str) -> None:
        super().__init__(reason)
        self.reply, self.code, self.reason = reply, code, reason


# (connection, a decoded frame) -> the reply frame, or None when the answer comes later (queued work);
# EndConnection: the frame is answered and the connection closed
MessageHandler = Callable[[ServerConnection, wire.Message], wire.Message | None]


class DeviceLink:
    def __init__(
        self, settings: Settings, hidden_size: int, sessions: SessionTable, on_bad_frame: Callable[[str], None]
    ) -> None:
        """`on_bad_frame(code name)`: every refused frame, as it comes (the verifier's metrics)."""
        self.settings = settings
        self.hidden_size = hidden_size
        self.sessions = sessions
        self.on_bad_frame = on_bad_frame
        self.pending_sends: set[asyncio.Task] = set()

    async def send(self, connection: ServerConnection, message: wire.Message, wire_dtype=None) -> None:
        frame = wire.encode(message, wire_dtype=wire_dtype)
        if not self.room_for(connection, len(frame)):
            return
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await connection.send(frame)
        except (ConnectionClosed, TimeoutError) as exc:
            log.info("could not reply to a device (%s); dropping the frame", type(exc).__name__)

    def room_for(self, connection: ServerConnection, size: int) -> bool:
        """Whether a frame of `size` bytes may join what is already written to the connection and not yet
        taken by its socket. A device that stops reading would otherwise have every reply pile up here
        (send_timeout_s bounds the wait, not the bytes): past `send_buffer_bytes` it is cut off, and its
        sessions are freed as the frame loop ends."""
        transport = connection.transport
        unsent = transport.get_write_buffer_size() if transport is not None else 0
        if unsent == 0 or unsent + size <= self.settings.send_buffer_bytes:
            return True
        if not transport.is_closing():
            log.warning(
                "device %s does not read its replies: %d bytes unsent, send_buffer_bytes is %d; closing it",
                connection.remote_address,
                unsent + size,
                self.settings.send_buffer_bytes,
            )
            transport.abort()  # no closing handshake: it would queue behind the bytes the peer does not read
        return False

    async def close(self, connection: ServerConnection, code: int, reason: str) -> None:
        """Close a connection (its closing handshake bounded by send_timeout_s; past it, the socket is cut)."""
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await connection.close(code, reason)
        except TimeoutError:
            log.info(
                "device %s did not answer its close within %.0fs",
                connection.remote_address,
                self.settings.send_timeout_s,
            )
            if connection.transport is not None:
                connection.transport.abort()

    def send_soon(self, connection, message: wire.Message, wire_dtype=None) -> None:
        """Send from synchronous code (engine callbacks): an owned task, bounded by send_timeout_s."""
        task = asyncio.create_task(self.send(connection, message, wire_dtype))
        self.pending_sends.add(task)
        task.add_done_callback(self.pending_sends.discard)

    def replier(self, connection: ServerConnection) -> Reply:
        """The reply callback of a work item from `connection`: its result as a frame, in the session's dtype."""

        def reply(item: WorkItem, out: torch.Tensor | ChunkVerdict | None, error: EngineError | None) -> None:
            session = self.sessions.scheduler.sessions.get(item.session_id)
            dtype = session.wire_dtype if session is not None and session.wire_dtype is not None else wire.WireDtype.F16
            self.send_soon(connection, reply_frame(item, out, error), dtype)

        return reply

    async def serve(self, connection: ServerConnection, on_message: MessageHandler) -> None:
        """The connection's frames through `on_message`, each reply sent back, until the connection ends."""
        peer = connection.remote_address
        log.info("device connected from %s", peer)
        bad_frames = BadFrameLog(peer, on_count=self.on_bad_frame)
        try:
            while True:
                async with asyncio.timeout(self.settings.idle_timeout_s):
                    frame = await connection.recv()
                if isinstance(frame, str):
                    error = wire.WireError(wire.ErrorCode.MALFORMED, "text frames are not accepted")
                    bad_frames.bad_frame(error)
                    await self.send(connection, error.to_frame())
                    continue
                message: wire.Message | None = None
                try:
                    message = wire.decode(
                        frame,
                        max_frame_bytes=self.settings.max_frame_bytes,
                        expected_hidden_size=self.hidden_size,
                        finite_only=True,
                    )
                    reply = on_message(connection, message)
                except EndConnection as end:
                    await self.send(connection, end.reply)
                    await self.close(connection, end.code, end.reason)
                    return
                except wire.WireError as exc:
                    bad_frames.bad_frame(exc)
                    reply = exc.to_frame()
                except Exception as exc:  # a bug met by one frame answers that frame, never ends the connection
                    bad_frames.internal(exc)
                    reply = wire.WireError(
                        wire.ErrorCode.INTERNAL,
                        f"{type(exc).__name__} handling this frame",
                        getattr(message, "session_id", None),
                        getattr(message, "seq_no", None),
                    ).to_frame()
                if reply is not None:
                    await self.send(connection, reply)
        except TimeoutError:
            log.info("device %s idle for %.0fs; disconnecting", peer, self.settings.idle_timeout_s)
        except ConnectionClosed:
            pass
        finally:
            bad_frames.flush()
            closed = self.sessions.close_owned_by(connection)
            log.info("device %s gone; freed %d session(s)", peer, len(closed))
