"""`python -m services.verifier_cloud.stage` / `tophat stage`: one pipeline stage, started on its own.

It loads one contiguous range of the middle layers, listens on `TOPHAT_STAGE_LISTEN`, and serves whichever
verifier wires it (services/verifier_cloud/remote_stages.py) with a service credential, run after run, until
SIGTERM. Settings come from `TOPHAT_STAGE_*` environment variables (or a settings file); flags override them.
The stage holds no sessions of its own: a run that ends drops every session's KV.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from services.verifier_cloud.remote_stages import await_wiring
from services.verifier_cloud.stage_plan import parse_address, parse_stage_layers
from services.verifier_cloud.stages import STAGE_CODEC, StageSpec, StageWorker, build_worker, serve_messages
from shared.auth import verify as auth
from shared.auth.client import JWKS_PATH
from shared.auth.tls import client_context
from shared.model.checkpoint import ModelLoadError
from shared.model.split import SplitError
from shared.processes.memory import return_freed_memory_to_os
from shared.service_settings import ServiceSettings
from shared.settings import SettingsError, from_env
from shared.wire.stage_chain import accept_link, bind_listener, connect_link
from shared.wire.stage_codec import StageLinkError
from shared.wire.stage_handshake import HANDSHAKE_TIMEOUT_S
from shared.wire.stage_link import LinkReceiver, LinkSender

log = logging.getLogger("services.verifier_cloud.stage")

ENV_PREFIX = "TOPHAT_STAGE_"
HOP_TIMEOUT_S = 30.0  # connecting downstream and being connected from upstream, once wired


@dataclass(frozen=True)
class StageSettings(ServiceSettings):
    model_dir: str = "models/demo"
    split_layers: int = 2  # m: the device's layers; the middle starts here (a stage checks its range against it)
    layers: str = ""  # this stage's range of the middle layers, "start-stop" ([start, stop)), required
    index: int = 0  # its place in the pipeline: 0 is fed by the verifier
    listen: str = "127.0.0.1:7200"  # host:port the verifier's control connection and the upstream hop reach
    device: str = "auto"
    dtype: str = "auto"
    torch_threads: int = 1
    slowdown: float = 1.0  # an emulated slower device (shared/planning/device_speed.py); 1 on real hardware
    hidden_rotation: str = ""  # the verifier's secret rotation (shared/privacy/hidden_rotation.py), if it uses one
    # What each connection to `listen` (a control connection, the upstream hop) has to present its credential or
    # run token in; connections are read concurrently, so a silent one costs only itself, never the wiring.
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S

    def validate(self) -> None:
        super().validate()
        if self.index < 0 or self.torch_threads < 1 or self.slowdown < 1.0 or self.handshake_timeout_s <= 0:
            raise ValueError("index must be >= 0, torch_threads >= 1, slowdown >= 1 and handshake_timeout_s > 0")
        self.layer_range()
        parse_address(self.listen)

    def layer_range(self) -> tuple[int, int]:
        ranges = parse_stage_layers(self.layers) if self.layers.strip() else []
        if len(ranges) != 1 or ranges[0][0] < self.split_layers:
            raise ValueError(f"layers must be one range start-stop of the middle layers (from {self.split_layers})")
        return ranges[0]

    def spec(self) -> StageSpec:
        return StageSpec(
            self.index,
            self.model_dir,
            self.split_layers,
            self.layer_range(),
            self.torch_threads,
            self.log_level,
            device=self.device,
            dtype=self.dtype,
            slowdown=self.slowdown,
            hidden_rotation=self.hidden_rotation,
        )


class CredentialCheck:
    """What a control connection must present: a service token for the stages' audience, checked against the
    issuer's public keys and revocation list, read again (synchronously: the stage is one thread) when older than
    `refresh_s`, so a revocation lands by the next wiring. A device's token is refused. With no issuer the
    mesh runs open and anything is accepted."""

    def __init__(self, settings: StageSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self.verifier = auth.TokenVerifier(leeway_s=settings.auth_leeway_s)
        self._read_at: float | None = None

    def _refresh(self) -> None:
        now = self.clock()
        if self._read_at is not None and now - self._read_at < self.settings.auth_refresh_s:
            return
        url = self.settings.auth_issuer_url.rstrip("/") + JWKS_PATH
        try:
            response = httpx.get(url, timeout=5.0, verify=client_context(self.settings.tls_ca), trust_env=False)
            response.raise_for_status()
            self.verifier.trust = auth.Trust.from_document(response.json())
            self._read_at = now
        except (httpx.HTTPError, ValueError) as exc:  # keep the last keys; none yet: every token is refused
            log.warning("cannot read the issuer's keys at %s: %s", url, exc)

    def __call__(self, presented: bytes) -> None:
        if not self.settings.authenticated:
            return
        self._refresh()
        try:
            claims = self.verifier.verify(presented, auth.STAGE)
        except auth.AuthError as exc:
            raise StageLinkError(f"credential refused: {exc.reason}") from None
        if claims.role != "service":
            raise StageLinkError(f"a {claims.role} credential cannot wire a stage")


def serve_stage(
    spec: StageSpec,
    worker: StageWorker,
    listener: socket.socket,
    check_credential: Callable[[bytes], None],
    should_stop: Callable[[], bool],
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> None:
    """Run after run: wait to be wired, join the chain, serve until the run ends, drop its KV."""
    while not should_stop():
        wiring = await_wiring(
            listener, spec.index, spec.layers, check_credential, should_stop, handshake_timeout_s=handshake_timeout_s
        )
        if wiring is None:
            return
        next_hop, token = wiring
        try:
            downstream = connect_link(next_hop, token, HOP_TIMEOUT_S)
        except StageLinkError as exc:
            log.warning("stage %d: next hop %s:%d unreachable: %s", spec.index, *next_hop, exc)
            continue
        try:
            upstream = accept_link(
                listener, token, HOP_TIMEOUT_S, lambda: "stopping" if should_stop() else None, handshake_timeout_s
            )
        except StageLinkError as exc:
            log.warning("stage %d: no upstream hop: %s", spec.index, exc)
            downstream.close()
            continue
        _run(spec, worker, upstream, downstream)


def _run(spec: StageSpec, worker: StageWorker, upstream: socket.socket, downstream: socket.socket) -> None:
    inbox = LinkReceiver(upstream, STAGE_CODEC, f"hop {spec.index} (into stage {spec.index})")
    outbox = LinkSender(downstream, STAGE_CODEC, name=f"hop {spec.index + 1} (from stage {spec.index})")
    log.info("stage %d: run started", spec.index)
    try:
        serve_messages(spec, worker, inbox, outbox)
    except StageLinkError as exc:
        log.warning("stage %d: %s; the run ends", spec.index, exc)
    finally:
        outbox.close(timeout_s=1.0)
        inbox.close()
        dropped = list(worker.runner.lengths())
        for session_id in dropped:
            worker.runner.close(session_id)
        log.info("stage %d: run ended; dropped %d session(s)' KV; waiting to be wired again", spec.index, len(dropped))


def parse_args(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m services.verifier_cloud.stage", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model-dir", help="checkpoint directory (env TOPHAT_STAGE_MODEL_DIR)")
    parser.add_argument("--split-layers", type=int, help="m, the device's layer count (env TOPHAT_STAGE_SPLIT_LAYERS)")
    parser.add_argument("--layers", help="this stage's middle layers, start-stop (env TOPHAT_STAGE_LAYERS)")
    parser.add_argument("--index", type=int, help="its place in the pipeline, from 0 (env TOPHAT_STAGE_INDEX)")
    parser.add_argument("--listen", help="host:port to listen on (env TOPHAT_STAGE_LISTEN)")
    parser.add_argument("--dtype", help="f32 | bf16 | int8 | int4 | auto (env TOPHAT_STAGE_DTYPE)")
    parser.add_argument("--torch-threads", type=int, help="env TOPHAT_STAGE_TORCH_THREADS")
    args = vars(parser.parse_args(argv))
    return {name: value for name, value in args.items() if value is not None}


def _exit_now(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = from_env(StageSettings, ENV_PREFIX, **parse_args(argv))
    except SettingsError as exc:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        log.error("cannot start: %s", exc)
        return 2
    spec = settings.spec()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s stage-{spec.index}[%(process)d] %(name)s: %(message)s",
    )
    auth.redact_credentials(["services.verifier_cloud.stage"])
    return_freed_memory_to_os()  # a fixed mmap threshold: no heap growth from freed tensors
    host, port = parse_address(settings.listen)
    auth.warn_if_open(f"stage {spec.index}", settings.authenticated, host, "TOPHAT_STAGE_AUTH_ISSUER_URL")
    try:
        listener = bind_listener(host, port)  # before loading: a taken port fails at once, naming itself
    except OSError as exc:
        log.error("cannot listen on %s: %s", settings.listen, exc)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_now)  # unwinds a run too: its hops close, so the verifier sees the stage go
    torch.set_num_threads(settings.torch_threads)
    try:
        try:
            worker = build_worker(spec)
        except (ModelLoadError, SplitError, OSError, RuntimeError, ValueError) as exc:
            log.error("stage %d could not load layers %s: %s", spec.index, spec.layers, exc)
            return 2
        log.info("stage %d ready: layers [%d, %d) on %s", spec.index, *spec.layers, settings.listen)
        serve_stage(spec, worker, listener, CredentialCheck(settings), lambda: False, settings.handshake_timeout_s)
    except SystemExit:
        pass
    finally:
        listener.close()
    log.info("stage %d stopped", spec.index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
