"""The verifier's WebSocket server: frames in, scheduler, frames out.

One connection per device agent; a device multiplexes its sessions over it.
Frames are validated on receipt; a bad frame gets a typed ErrorFrame back and
the connection (and every other session) keeps working. When a connection
ends, every session it opened is closed and its KV freed.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

import torch
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from services.verifier_cloud.scheduler import Scheduler, SchedulerOutput, WorkItem
from services.verifier_cloud.settings import Settings
from shared import wire
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.telemetry import TelemetryClient

log = logging.getLogger("services.verifier_cloud")

WS_PATH = "/ws"


class VerifierServer:
    def __init__(self, settings: Settings, middle: MiddleSubmodel, context_length: int, hidden_size: int):
        self.settings = settings
        self.hidden_size = hidden_size
        self.scheduler = Scheduler(middle, settings.max_batch_tokens, settings.max_sessions, context_length)
        self.telemetry = TelemetryClient(settings.state_monitor_url or None)
        self.wire_dtypes: dict[int, wire.WireDtype] = {}
        self.steps = 0
        self.ready = False
        self._pending_sends: set[asyncio.Task] = set()

    @classmethod
    def from_settings(cls, settings: Settings) -> "VerifierServer":
        checkpoint = load_checkpoint(settings.model_dir, with_tokenizer=False)
        middle = MiddleSubmodel(checkpoint, settings.split_layers)
        return cls(settings, middle, checkpoint.config.max_position_embeddings, checkpoint.hidden_size)

    # -- HTTP health on the same port ----------------------------------------------
    def process_request(self, connection: ServerConnection, request):
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if request.path == "/readyz":
            status = HTTPStatus.OK if self.ready else HTTPStatus.SERVICE_UNAVAILABLE
            return connection.respond(status, f"sessions={len(self.scheduler.sessions)} steps={self.steps}\n")
        if request.path != WS_PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        return None

    # -- connections -----------------------------------------------------------------
    async def send(self, connection: ServerConnection, message: wire.Message, wire_dtype=None) -> None:
        frame = wire.encode(message, wire_dtype=wire_dtype)
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await connection.send(frame)
        except (ConnectionClosed, TimeoutError) as exc:
            log.info("could not reply to a device (%s); dropping the frame", type(exc).__name__)

    async def handle(self, connection: ServerConnection) -> None:
        peer = connection.remote_address
        log.info("device connected from %s", peer)
        try:
            while True:
                async with asyncio.timeout(self.settings.idle_timeout_s):
                    frame = await connection.recv()
                if isinstance(frame, str):
                    await self.send(connection, wire.ErrorFrame(wire.ErrorCode.MALFORMED, "text frames are not accepted"))
                    continue
                try:
                    message = wire.decode(frame, max_frame_bytes=self.settings.max_frame_bytes,
                                          expected_hidden_size=self.hidden_size)
                    reply = self.on_message(connection, message)
                except wire.WireError as exc:
                    log.info("bad frame from %s: %s", peer, exc)
                    reply = exc.to_frame()
                if reply is not None:
                    await self.send(connection, reply)
        except TimeoutError:
            log.info("device %s idle for %.0fs; disconnecting", peer, self.settings.idle_timeout_s)
        except ConnectionClosed:
            pass
        finally:
            closed = self.scheduler.close_owned_by(connection)
            for sid in closed:
                self.wire_dtypes.pop(sid, None)
            log.info("device %s gone; freed %d session(s)", peer, len(closed))

    def on_message(self, connection: ServerConnection, message: wire.Message) -> wire.Message | None:
        if isinstance(message, wire.OpenSession):
            self.scheduler.open(message.session_id, connection)
            self.wire_dtypes[message.session_id] = wire.WireDtype(message.wire_dtype)
            return wire.SessionOpened(message.session_id)
        if isinstance(message, wire.CloseSession):
            self.scheduler.get(message.session_id, connection)
            self.scheduler.close(message.session_id)
            self.wire_dtypes.pop(message.session_id, None)
            return wire.SessionClosed(message.session_id)
        if isinstance(message, (wire.PrefillChunk, wire.VerifyRequest)):
            is_prefill = isinstance(message, wire.PrefillChunk)
            item = WorkItem(
                session_id=message.session_id,
                seq_no=message.seq_no,
                kind="prefill" if is_prefill else "verify",
                hidden=message.hidden,
                position=message.start_pos if is_prefill else message.commit_len,
                is_last=message.is_last if is_prefill else True,
                reply=lambda item, out, err, conn=connection: self._reply(conn, item, out, err),
            )
            self.scheduler.submit(item, connection)
            return None
        raise wire.WireError(wire.ErrorCode.UNKNOWN_TYPE, f"{type(message).__name__} is not accepted by the verifier",
                             getattr(message, "session_id", None), getattr(message, "seq_no", None))

    def _reply(self, connection, item: WorkItem, out: torch.Tensor | None, error: wire.WireError | None) -> None:
        if error is not None:
            message: wire.Message = error.to_frame()
        elif item.kind == "verify":
            message = wire.VerifyResult(item.session_id, item.seq_no, out)
        elif item.is_last:
            message = wire.DeepHidden(item.session_id, item.seq_no, out[-1:])
        else:
            message = wire.ChunkAck(item.session_id, item.seq_no)
        dtype = self.wire_dtypes.get(item.session_id, wire.WireDtype.F16)
        task = asyncio.create_task(self.send(connection, message, dtype))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    # -- the engine loop ------------------------------------------------------------------
    async def run_scheduler(self) -> None:
        while True:
            await self.scheduler.work_ready.wait()
            batch: SchedulerOutput = self.scheduler.schedule()
            if not batch.items:
                continue
            try:
                results, stats = await asyncio.to_thread(self.scheduler.execute, batch)
            finally:
                self.scheduler.finish_step()
            self.steps += 1
            for item, out, error in results:
                item.reply(item, out, error)
            self.telemetry.emit_verifier_step(stats.batched_tokens, stats.compute_s, stats.num_sessions,
                                              {"prefill": stats.num_prefill, "verify": stats.num_verify})
            log.debug("step %d: %d tokens, %d sessions, %.1f ms", self.steps, stats.batched_tokens,
                      stats.num_sessions, stats.compute_s * 1e3)

    async def serve_forever(self, stop: asyncio.Event, started: asyncio.Future | None = None) -> None:
        # websockets' own limit sits above ours so oversized frames reach our check
        # and get a typed error; only absurd frames (4x the limit) close the connection.
        async with serve(self.handle, self.settings.host, self.settings.port, process_request=self.process_request,
                         max_size=4 * self.settings.max_frame_bytes, compression=None, ping_interval=20,
                         ping_timeout=20) as server:
            server: Server
            async with asyncio.TaskGroup() as tasks:
                scheduler_task = tasks.create_task(self.run_scheduler())
                self.ready = True
                port = server.sockets[0].getsockname()[1] if server.sockets else self.settings.port
                log.info("verifier-cloud ready on ws://%s:%d%s", self.settings.host, port, WS_PATH)
                if started is not None:
                    started.set_result(port)
                await stop.wait()
                scheduler_task.cancel()
            await self.telemetry.aclose()
