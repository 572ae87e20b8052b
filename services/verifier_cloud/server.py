"""The verifier's WebSocket server: frames in, scheduler, frames out.

One connection per device agent; a device multiplexes its sessions over it.
Frames are validated on receipt (device_link.py, the connection's frame loop); a
bad frame gets a typed ErrorFrame back and the connection (and every other
session) keeps working. When a connection ends, every session it opened is
closed and its KV freed.

With `pipeline_stages` P = 1 (the default) the middle submodel runs in this
process, one batch at a time, in a worker thread. With P > 1 it runs in P
stage worker processes (pipeline.py, stages.py) with up to P micro-batches in
flight; this process keeps only the scheduler, the sockets and the replies.

The parts: frames.py turns request frames into work items and results into
reply frames; scheduler.py (policy only) picks each step's items from the
session records (session.py); engine.py runs them, through runner.py's
ModelRunner in this process or through the stage workers (pipeline.py,
stages.py), each of which has a ModelRunner of its own.

With `full_model` the verifier also serves token mode (token_mode.py; its frames
are token_frames.py's): sessions
opened with OpenTokenSession send token ids and get sampled tokens back. Token
messages on a session opened with privacy on are refused with PRIVACY_VIOLATION,
and a verifier without the full model refuses OpenTokenSession with
UNKNOWN_TYPE, the same answer a verifier that predates token mode gives.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from websockets.asyncio.server import ServerConnection, serve

from services.verifier_cloud.budgets import kv_bytes_per_position
from services.verifier_cloud.device_link import DeviceLink
from services.verifier_cloud.engine import InProcessEngine, PipelineEngine, StepStats
from services.verifier_cloud.forks import fork
from services.verifier_cloud.frames import TOKEN_WORK, check_split, probe_reply, to_wire, work_item
from services.verifier_cloud.http_front import WS_PATH, HttpFront
from services.verifier_cloud.kv_plan import KVPlan
from services.verifier_cloud.model_loading import load_model
from services.verifier_cloud.pipeline import StagePipeline
from services.verifier_cloud.runner import ModelRunner
from services.verifier_cloud.scheduler import Scheduler
from services.verifier_cloud.session import Session
from services.verifier_cloud.session_table import SessionTable
from services.verifier_cloud.settings import Settings
from services.verifier_cloud.stage_specs import remote_stages
from services.verifier_cloud.stages import StageSpec
from services.verifier_cloud.step_records import StepRecorder
from services.verifier_cloud.token_frames import TokenFrames
from services.verifier_cloud.token_mode import TokenModel
from services.verifier_cloud.work import EngineError, ErrorKind
from shared.auth import client as auth_client
from shared.auth import verify as auth
from shared.auth.tls import client_context, server_context
from shared.capture import CaptureWriter
from shared.model.checkpoint import split_fingerprint
from shared.model.split import MiddleSubmodel
from shared.model.static_kv import static_capacity
from shared.planning.compute_delay import ComputeDelayPredictor
from shared.privacy.hidden_rotation import rotated_fingerprint
from shared.settings import SettingsError
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import VerifierMetrics
from shared.wire import schema as wire

log = logging.getLogger("services.verifier_cloud")


class VerifierServer:
    def __init__(
        self,
        settings: Settings,
        middle: MiddleSubmodel | None,
        context_length: int,
        hidden_size: int,
        stages: list[StageSpec] | None = None,
        token_model: TokenModel | None = None,
        calibration: Sequence[tuple[int, float]] = (),
    ):
        """`middle` for the in-process path (P = 1); `stages` (and middle=None) for P > 1 worker processes.
        `token_model` (P = 1 only) turns token mode on; `from_settings` builds it when `full_model` is set.
        `calibration`: (rows, seconds) of timed passes, sent to the monitor as g(mu) samples once serving."""
        if (middle is None) == (stages is None):
            raise ValueError("give exactly one of middle (in-process) or stages (worker processes)")
        if token_model is not None and middle is None:
            raise ValueError("token mode needs the in-process middle submodel (pipeline_stages == 1)")
        self.settings = settings
        self.hidden_size = hidden_size
        # What every OpenSession must match (read from the files, so P > 1 needs no weights here)
        # With a hidden rotation the fingerprint names it too: a device with another secret (or none) is refused.
        self.split_fingerprint = rotated_fingerprint(
            split_fingerprint(settings.model_dir, settings.split_layers), settings.hidden_rotation
        )
        self.token_model = token_model
        # g(mu) as this verifier measures it: its startup passes, then every step it serves (prefill pieces' sizes)
        self.step_cost = ComputeDelayPredictor()
        for rows, seconds in calibration:
            self.step_cost.observe(rows, seconds)
        self.scheduler = Scheduler(
            settings.max_batch_tokens,
            settings.max_sessions,
            context_length,
            server_chunk_tokens=settings.server_chunk_tokens,
            prefill_sessions_per_step=settings.prefill_sessions_per_step,
            max_prefill_step_s=settings.max_prefill_step_ms / 1e3,
            step_cost=self.step_cost.predict,
            prefill_pipelining=stages is not None and settings.prefill_pipelining,
            max_sessions_per_owner=settings.max_sessions_per_connection,
            max_queue=settings.max_queue_per_session,
        )
        # Its own calls (telemetry to the monitor) carry a token for the monitor, from its service credential;
        # the devices' handshakes are checked with the issuer's public keys, re-read by `trust_refresher`.
        self.broker = auth_client.broker_for(settings, verify=client_context(settings.tls_ca))
        self.trust: auth.TokenVerifier | None
        self.trust_refresher: auth_client.TrustRefresher | None
        self.trust, self.trust_refresher = auth_client.trust_for(settings, client_context(settings.tls_ca))
        self.telemetry = TelemetryClient(
            settings.state_monitor_url or None,
            verify=client_context(settings.tls_ca),
            auth=auth_client.BrokerAuth(self.broker, auth.ISSUER) if self.broker is not None else None,
        )
        auth.warn_if_open("the verifier", settings.authenticated, settings.host, "TOPHAT_VERIFIER_AUTH_ISSUER_URL")
        first = next(middle.parameters(), None) if middle is not None else None  # where the step records say it runs
        self.runs_on = str(first.device) if first is not None else f"{settings.device} x{settings.pipeline_stages}"
        self.runner: ModelRunner | None = None  # P = 1: the in-process runner and its KV
        self.ready = False
        self.capture: CaptureWriter | None = None  # settings.capture_path: opened while serving (serve_forever)
        self.pipeline: StagePipeline | None = None  # P > 1: the stage workers, each with its own runner
        self.engine: InProcessEngine | PipelineEngine
        if stages is None:
            assert middle is not None  # exactly one of middle / stages, checked above
            kv_plan = KVPlan.of(settings, on_cuda=middle.device.type == "cuda")
            self.runner = ModelRunner(
                middle, context_length, token_model, *kv_plan.runner_parts(middle, context_length)
            )
            self.engine = InProcessEngine(self.scheduler, self.runner, self._record_step)
        else:
            self.pipeline = StagePipeline(
                stages,
                settings.stage_start_timeout_s,
                settings.stage_timeout_s,
                remote=remote_stages(settings, self.broker),
            )
            self.engine = PipelineEngine(self.scheduler, self.pipeline, self._record_step)
        # a static slot is charged whole if any runner holds one (a pipeline's stages decide per device)
        static = kv_plan.static if stages is None else any(spec.kv.static for spec in stages)
        self.sessions = SessionTable(
            settings,
            self.scheduler,
            self.runner,
            self.pipeline,
            kv_bytes_per_position(settings, middle, token_model),
            static_capacity(context_length) if static else None,
        )
        self.forks: set[asyncio.Task] = set()  # forks copying in worker threads (forks.py)
        # With P > 1 the KV lives in the stage workers: no KV gauge here.
        self.metrics = VerifierMetrics(
            sessions=lambda: len(self.scheduler.sessions),
            kv_bytes=self.runner.kv_bytes if self.runner is not None else None,
        )
        self.steps = StepRecorder(self.telemetry, self.metrics, settings.pipeline_stages, self.runs_on, calibration)
        self.telemetry.count_into(self.metrics.registry)  # its drops show on /metrics
        self.http = HttpFront(settings, self.sessions, self.metrics, self.readiness, self.trust)
        self.link = DeviceLink(settings, hidden_size, self.sessions, self.metrics.bad_frame)
        self.tokens = TokenFrames(self.sessions, token_model)

    @classmethod
    def from_settings(cls, settings: Settings) -> "VerifierServer":
        try:
            settings.validate()  # also when built in code rather than by load_settings
        except ValueError as exc:
            raise SettingsError(f"Settings: {exc}") from exc
        loaded = load_model(settings)
        return cls(
            settings,
            loaded.middle,
            loaded.context_length,
            loaded.hidden_size,
            stages=loaded.stages,
            token_model=loaded.token_model,
            calibration=loaded.calibration,
        )

    @property
    def recent_steps(self) -> deque[StepStats]:
        """P = 1: what each packed pass ran (introspection; empty with P > 1, see pipeline.recent)."""
        return self.engine.recent_steps

    @property
    def is_ready(self) -> bool:
        return self.ready and (self.pipeline is None or self.pipeline.healthy)

    def readiness(self) -> tuple[bool, str]:
        """(ready, what /readyz says): sessions and steps, and why a failed pipeline is down."""
        body = f"sessions={len(self.scheduler.sessions)} steps={self.steps.steps}\n"
        if self.pipeline is not None and not self.pipeline.healthy and self.pipeline.last_failure is not None:
            body += f"pipeline failed: {self.pipeline.last_failure} (restart {self.pipeline.restarts + 1})\n"
        return self.is_ready, body

    # -- connections -----------------------------------------------------------------
    async def handle(self, connection: ServerConnection) -> None:
        """One device connection (device_link.py): its frames through `on_message`, looked up as it connects."""
        await self.link.serve(connection, self.on_message)

    def on_message(self, connection: ServerConnection, message: wire.Message) -> wire.Message | None:
        """One request frame from `connection`: its reply frame, or None where the reply comes later (queued
        work) or never (a reauthentication)."""
        if isinstance(message, wire.BandwidthProbe):
            return probe_reply(message)
        if isinstance(message, wire.OpenSession):
            return self._open_session(connection, message)
        if isinstance(message, wire.ForkSession):
            return fork(self, connection, message)
        if isinstance(message, wire.Reauthenticate):
            self.http.reauthenticate(connection, message)  # no reply; a refusal ends the connection
            return None
        if isinstance(message, wire.OpenTokenSession):
            return self.tokens.open(connection, message, self.is_ready)
        if isinstance(message, TOKEN_WORK):
            self.tokens.submit(connection, message, self.link.replier(connection))
            return None
        if isinstance(message, wire.CloseSession):
            self.sessions.get(message.session_id, connection)
            self.sessions.close(message.session_id)
            return wire.SessionClosed(message.session_id)
        if isinstance(message, (wire.PrefillChunk, wire.VerifyRequest)):
            self._submit_hidden(connection, message)
            return None
        raise wire.WireError(
            wire.ErrorCode.UNKNOWN_TYPE,
            f"{type(message).__name__} is not accepted by the verifier",
            getattr(message, "session_id", None),
            getattr(message, "seq_no", None),
        )

    def _open_session(self, connection: ServerConnection, message: wire.OpenSession) -> wire.Message | None:
        check_split(message, self.settings.split_layers, self.split_fingerprint)
        if not self.is_ready:
            raise wire.WireError(wire.ErrorCode.OVERLOADED, "verifier is not ready", message.session_id)
        return self.sessions.open(
            Session(
                message.session_id,
                connection,
                privacy=message.privacy,
                wire_dtype=wire.WireDtype(message.wire_dtype),
            )
        )

    def _submit_hidden(self, connection: ServerConnection, message: wire.PrefillChunk | wire.VerifyRequest) -> None:
        """Queue a hidden-state frame's work (its reply comes when a step has run it), and capture it when on."""
        if self.sessions.get(message.session_id, connection, message.seq_no).is_token:
            raise wire.WireError(
                wire.ErrorCode.MALFORMED,
                "a token-mode session takes token messages only",
                message.session_id,
                message.seq_no,
            )
        item = work_item(message, self.link.replier(connection))
        if item.layout is not None and self.pipeline is not None:
            raise wire.WireError(
                wire.ErrorCode.MALFORMED, "draft trees need pipeline_stages = 1", message.session_id, message.seq_no
            )
        self.sessions.submit(item, connection)
        if self.capture is not None:  # only what was accepted as work: a refused frame raised above
            if isinstance(message, wire.PrefillChunk):
                self.capture.record(message.session_id, message.seq_no, "prefill", message.start_pos, message.hidden)
            else:
                self.capture.record(message.session_id, message.seq_no, "verify", message.commit_len, message.hidden)

    def _sessions_lost(self, reason: str) -> None:
        """The stage workers died and every session's KV with them: answer each session's queued
        work and the session itself with a typed error, and close it (the device starts over)."""
        error = EngineError(
            ErrorKind.INTERNAL,
            f"verifier pipeline failed ({reason}); this session's KV is lost and the session is closed",
        )
        lost = list(self.scheduler.sessions.values())
        for session in lost:
            for item in list(session.queue):
                if item.reply is not None:
                    item.reply(item, None, error)
            self.link.send_soon(session.owner, to_wire(error, session.session_id).to_frame())
            self.sessions.close(session.session_id)
        log.warning("pipeline failure closed %d session(s); restarting the stage workers", len(lost))

    def _record_step(self, stats: StepStats, overhead_s: float | None) -> None:
        self.steps.record(stats, overhead_s)  # the engines are built before the recorder: they call through here
        if stats.batched_tokens >= 1 and stats.compute_s >= 0:
            self.step_cost.observe(stats.batched_tokens, stats.compute_s)

    async def serve_forever(self, stop: asyncio.Event, started: asyncio.Future | None = None) -> None:
        try:
            if self.settings.capture_path:
                self.capture = CaptureWriter.open(self.settings.capture_path)
                log.warning(
                    "CAPTURE ON: every hidden-state frame accepted is appended to %s (an audit tool; "
                    "it stores users' states)",
                    self.settings.capture_path,
                )
            if self.pipeline is not None:
                await self.pipeline.start()  # bounded by stage_start_timeout_s; raises PipelineFailed
            await self._serve(stop, started)
        except BaseException as exc:
            if started is not None and not started.done():
                started.set_exception(exc if isinstance(exc, Exception) else RuntimeError("verifier cancelled"))
            raise
        finally:
            if self.pipeline is not None:
                await self.pipeline.aclose()
            if self.capture is not None:
                self.capture.close()

    async def _serve(self, stop: asyncio.Event, started: asyncio.Future | None) -> None:
        # The transport's limit is the frame limit: a bigger frame is refused (close 1009) from its header,
        # before its payload is read into memory; a typed OVERSIZED answer would need it buffered first.
        tls = server_context(self.settings.tls_cert, self.settings.tls_key)  # None: plain ws://
        auth.redact_credentials(("websockets.server",))  # at debug it logs each handshake header, tokens included
        async with serve(
            self.handle,
            self.settings.host,
            self.settings.port,
            process_request=self.http.process_request,
            max_size=self.settings.max_frame_bytes,
            compression=None,
            ping_interval=20,
            ping_timeout=20,
            ssl=tls,
        ) as server:
            async with asyncio.TaskGroup() as tasks:
                engine = tasks.create_task(self.engine.run())
                sweeper = tasks.create_task(self.sessions.close_idle())
                trust = tasks.create_task(self.trust_refresher.run()) if self.trust_refresher is not None else None
                watch = tasks.create_task(self.http.watch.run()) if self.http.watch is not None else None
                # a pipeline (P > 1) comes with a PipelineEngine (__init__)
                collector = (
                    tasks.create_task(self.engine.supervise(self._sessions_lost))
                    if isinstance(self.engine, PipelineEngine)
                    else None
                )
                self.ready = True
                port = server.sockets[0].getsockname()[1] if server.sockets else self.settings.port
                log.info(
                    "verifier-cloud ready on %s://%s:%d%s (%d pipeline stage(s), token mode %s, server chunks %s, "
                    "prefill pieces while others decode: %s)",
                    "wss" if tls is not None else "ws",
                    self.settings.host,
                    port,
                    WS_PATH,
                    self.settings.pipeline_stages if self.pipeline is not None else 1,
                    "on" if self.token_model is not None else "off",
                    self.settings.server_chunk_tokens or "off",
                    f"<= {self.settings.max_prefill_step_ms:g} ms" if self.settings.max_prefill_step_ms else "off",
                )
                self.steps.send_calibration()
                if started is not None:
                    started.set_result(port)
                await stop.wait()
                self.ready = False
                engine.cancel()
                sweeper.cancel()
                if trust is not None:
                    trust.cancel()
                if watch is not None:
                    watch.cancel()
                if self.pipeline is not None:
                    await self.pipeline.aclose()  # Stop flows down the chain; the collector returns on it
                if collector is not None:
                    collector.cancel()
            await self.telemetry.aclose()
            if self.broker is not None:
                await self.broker.aclose()
