"""One pipeline stage of the verifier: a worker process owning a layer range and its KV.

HAT (§4.5) runs the middle submodel as P pipeline stages so that stage 1 can
work on the next micro-batch while stage 2 finishes the previous one. Each
stage is a separate process (spawned, or on a host without CUDA forked from a
fresh fork server: see worker_context; it never inherits the parent's threads
or event loop) that loads the checkpoint itself and keeps only its own layers.
Stages form a chain of TCP connections (shared/wire/stage_link.py), each hop
optionally an emulated link (the `stage_links` setting):

    main --hop 0--> stage 0 --hop 1--> stage 1 ... stage P-1 --hop P--> main

Everything travels down the same chain, in order: micro-batches, session
open/close, probes, stop. That single FIFO is what keeps every stage's KV in
step with the others without any locking: a close that main sent after a
micro-batch reaches each stage after that micro-batch, everywhere.

Messages are the dataclasses below, and only those listed in STAGE_MESSAGES
can cross a hop (msgpack, checked against their annotations: never pickle).
Tensors travel as numpy arrays (dtype, shape, raw bytes).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.verifier_cloud.kv_plan import DYNAMIC, KVPlan
from services.verifier_cloud.runner import ModelRunner, RunItem
from services.verifier_cloud.work import EngineError, ErrorKind, WorkKind
from shared.model.split import LayerRange
from shared.net.links import UNSHAPED, LinkProfile
from shared.planning.device_speed import DeviceSpeed
from shared.wire.stage_chain import join_chain
from shared.wire.stage_codec import StageCodec, StageLinkError
from shared.wire.stage_link import LinkReceiver, LinkSender

log = logging.getLogger("services.verifier_cloud.stages")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array for the queue; numpy has no bfloat16, so it travels as (exact) float32."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.contiguous().numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


# -- messages (plain dataclasses; all pickle cheaply) -------------------------------------


@dataclass
class StageItem:
    """One session's piece of a micro-batch; `hidden` is replaced by each stage's output."""

    session_id: int
    seq_no: int
    kind: WorkKind
    position: int  # prefill: start_pos; verify: commit_len
    num_tokens: int
    hidden: np.ndarray | None  # [S, H]; None once the item failed
    error: tuple[int, str] | None = None  # (ErrorKind, message): the first stage that refused it


@dataclass
class MicroBatch:
    batch_id: int
    items: list[StageItem]
    spans: list[tuple[int, float, float]] = field(default_factory=list)  # (stage, start, end), time.monotonic()


@dataclass
class SessionsOpened:
    session_ids: list[int]


@dataclass
class SessionsClosed:
    session_ids: list[int]


@dataclass
class SessionsRolledBack:
    """(session_id, length) pairs: cut each session back to at most `length` positions.

    Sent after an item failed INTERNAL in some stage: the stages before it had appended its
    positions, the failing one had not; `length` is the item's position, the length every
    stage had before it (a prefill starts at the cached length, a verify rolls back to it)."""

    sessions: list[tuple[int, int]]


@dataclass
class SessionsForked:
    """(child, parent, length) triples: open each child as a copy of the parent's first `length` positions
    (None: all). In order with all prior traffic, so every stage copies the same prefix."""

    sessions: list[tuple[int, int, int | None]]


@dataclass
class Probe:
    """Debug/introspection: every stage appends {session_id: cached length}."""

    probe_id: int
    lengths: list[dict[int, int]] = field(default_factory=list)


@dataclass
class Hello:
    """Startup handshake: every stage appends (index, start layer, stop layer, pid) once it has loaded."""

    stages: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class Stop:
    pass


@dataclass
class StageFailed:
    stage: int
    message: str


@dataclass(frozen=True)
class StageSpec:
    """What a worker process needs to build its stage (picklable, no tensors)."""

    index: int
    model_dir: str
    split_layers: int
    layers: tuple[int, int]
    torch_threads: int = 1
    log_level: str = "info"
    poll_s: float = 1.0  # how often an idle worker checks that its parent still lives
    device: str = "cpu"  # this stage's device, planned by the parent (pipeline.plan_stages): cpu or cuda:i
    dtype: str = "auto"  # the dtype setting; resolved here, where this stage's GPU is known
    host: str = "127.0.0.1"  # where this stage listens for its upstream hop
    in_link: LinkProfile = UNSHAPED  # hop into this stage (the sender, one hop up, paces it)
    out_link: LinkProfile = UNSHAPED  # hop out of this stage, paced here
    slowdown: float = 1.0  # emulated device speed (shared/planning/device_speed.py): compute stretched this many times
    hidden_rotation: str = field(
        default="", repr=False
    )  # the verifier's secret rotation (shared/privacy/hidden_rotation.py)
    kv: KVPlan = DYNAMIC  # this stage's KV layout and CUDA graphs, decided for its device (kv_plan.py)


# Every message that may cross a hop; a new message type is one more entry here.
STAGE_MESSAGES = (
    MicroBatch,
    StageItem,
    SessionsOpened,
    SessionsClosed,
    SessionsRolledBack,
    SessionsForked,
    Probe,
    Hello,
    Stop,
    StageFailed,
)
STAGE_CODEC = StageCodec(STAGE_MESSAGES)
SESSION_CHANGES = (SessionsOpened, SessionsClosed, SessionsForked, SessionsRolledBack)  # what change_sessions applies
LINK_TIMEOUT_S = 60.0  # a worker's bound on wiring its hops at startup (the parent's start timeout is the real one)


# -- the stage itself (pure, testable in-process) ------------------------------------------


class StageWorker:
    """A stage's ModelRunner (its layer range, its sessions' KV); turns each incoming message into the one
    to forward."""

    def __init__(
        self, index: int, layers: LayerRange, context_length: int, slowdown: float = 1.0, kv: KVPlan = DYNAMIC
    ):
        self.index = index
        self.runner = ModelRunner(layers, context_length, None, *kv.runner_parts(layers, context_length))
        self.speed = DeviceSpeed(slowdown)

    def handle(self, message: Any) -> Any:
        if isinstance(message, MicroBatch):
            self.run_batch(message)
        elif isinstance(message, SESSION_CHANGES):
            self.change_sessions(message)
        elif isinstance(message, Probe):
            message.lengths.append(self.runner.lengths())
        elif isinstance(message, Hello):
            layers = self.runner.layers
            message.stages.append((self.index, layers.start, layers.stop, os.getpid()))
        return message  # Stop / StageFailed / anything else: forwarded unchanged

    def change_sessions(self, message: SessionsOpened | SessionsClosed | SessionsForked | SessionsRolledBack) -> None:
        """Apply the server's session bookkeeping to this stage's KV, as every stage does in hop order."""
        if isinstance(message, SessionsOpened):
            for sid in message.session_ids:
                self.runner.open(sid)
        elif isinstance(message, SessionsClosed):
            for sid in message.session_ids:
                self.runner.close(sid)
        elif isinstance(message, SessionsForked):
            for child, parent, length in message.sessions:
                try:
                    self.runner.fork(child, parent, length)
                except EngineError as exc:  # the server checked the parent; a stage left without it stays safe
                    log.warning("stage %d: fork of session %d refused: %s", self.index, child, exc)
        else:
            for sid, length in message.sessions:
                self.runner.roll_back(sid, length)

    def run_batch(self, batch: MicroBatch) -> None:
        """Run every item no earlier stage refused; a refused or failed item carries its error downstream."""
        started = time.monotonic()
        for item in batch.items:  # the codec allows None (a failed item's); without an error it is a bad frame
            if item.error is None and item.hidden is None:
                item.error = (int(ErrorKind.MALFORMED), f"stage {self.index}: an item without hidden states")
        live = [item for item in batch.items if item.error is None]
        dtype = self.runner.layers.dtype
        assert isinstance(dtype, torch.dtype)  # the checkpoint's dtype (LayerRange.dtype, an untyped nn.Module attr)
        run_items: list[RunItem] = []
        for item in live:
            assert item.hidden is not None  # an item without states got its error above
            run_items.append(RunItem(item.session_id, item.kind, item.position, from_numpy(item.hidden, dtype)))
        results = self.runner.run(run_items)
        for item, result in zip(live, results):
            if result.error is not None:
                item.error, item.hidden = (int(result.error.kind), f"stage {self.index}: {result.error.message}"), None
            else:
                assert isinstance(result.output, torch.Tensor)  # a hidden-state item's deep states
                item.hidden = to_numpy(result.output)
        time.sleep(self.speed.extra_s(time.monotonic() - started))  # an emulated slower device: its span grows too
        batch.spans.append((self.index, started, time.monotonic()))


# -- the process entry point -------------------------------------------------------------


def build_worker(spec: StageSpec) -> StageWorker:
    from shared.model.checkpoint import load_checkpoint
    from shared.model.placement import detect_placement
    from shared.model.split import MiddleSubmodel, warm_up_layers

    placement = detect_placement(spec.device, spec.dtype, what=f"stage {spec.index}")
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)  # anything left implicit lands on this stage's GPU, not cuda:0
    checkpoint = load_checkpoint(
        spec.model_dir, dtype=placement.dtype, with_tokenizer=False, quantize=placement.quantize
    )
    middle = MiddleSubmodel(checkpoint, spec.split_layers, stage=spec.layers)
    if spec.hidden_rotation:  # every layer of the middle is rotated the same way: a stage is a sub-range
        from shared.privacy.hidden_rotation import apply_secret_rotation

        apply_secret_rotation(middle, spec.hidden_rotation)
    middle.to(placement.device)  # only this stage's layers (and the rotary table) go to the GPU
    warm_up_layers(middle, checkpoint.hidden_size)
    # Dropping the checkpoint frees the embeddings, head and other stages' layers in this process.
    return StageWorker(spec.index, middle, checkpoint.config.max_position_embeddings, spec.slowdown, spec.kv)


# What a worker would otherwise import again, ~4-5 s of CPU each time: the fork server imports it once.
_FORK_SERVER_PRELOAD = [
    "services.verifier_cloud.stages",
    "shared.model.checkpoint",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
]


def worker_context() -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """How the pipeline starts its workers. On a host without CUDA, forked from a fork server that has imported
    torch, transformers and this module once, so a worker (and every restart) starts in a fraction of a second
    instead of importing them again; the fork server is a fresh single-threaded process, so a worker still
    inherits none of the verifier's threads or event loop. Where CUDA is available, spawned as before: a process
    forked from one that had initialised CUDA could not use it."""
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORK_SERVER_PRELOAD)
    return context


def run_stage(spec: StageSpec, startup: Any, token: bytes) -> None:
    """Worker main: wire the hops (`startup`: a pipe that carries addresses only), load, then turn
    inbox messages into outbox messages until Stop, the upstream hop closes, or the parent is gone."""
    from shared.model.checkpoint import ModelLoadError
    from shared.model.split import SplitError

    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s stage-{spec.index}[%(process)d] %(name)s: %(message)s",
    )
    torch.set_num_threads(spec.torch_threads)
    try:
        in_sock, out_sock = join_chain(spec.host, startup, token, LINK_TIMEOUT_S)
    except StageLinkError as exc:
        log.error("stage %d could not join the pipeline: %s", spec.index, exc)
        return
    inbox = LinkReceiver(in_sock, STAGE_CODEC, f"hop {spec.index} (into stage {spec.index})")
    outbox = LinkSender(out_sock, STAGE_CODEC, spec.out_link, f"hop {spec.index + 1} (from stage {spec.index})")
    try:
        try:
            worker = build_worker(spec)
        except (ModelLoadError, SplitError, OSError, RuntimeError, ValueError) as exc:
            log.error("stage %d could not load layers %s: %s", spec.index, spec.layers, exc)
            outbox.put(StageFailed(spec.index, f"{type(exc).__name__}: {exc}"))
            return
        log.info(
            "stage %d ready: layers [%d, %d), slowdown %g, out link %s",
            spec.index,
            *spec.layers,
            spec.slowdown,
            spec.out_link.describe(),
        )
        serve_messages(spec, worker, inbox, outbox)
    except StageLinkError as exc:  # the downstream hop broke: nobody can hear this stage any more
        log.warning("stage %d: %s; exiting", spec.index, exc)
    finally:
        outbox.close()
        inbox.close()


def serve_messages(spec: StageSpec, worker: StageWorker, inbox: LinkReceiver, outbox: LinkSender) -> None:
    import multiprocessing

    parent = multiprocessing.parent_process()
    while True:
        try:
            message = inbox.get(timeout=spec.poll_s)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                log.warning("stage %d: parent process gone; exiting", spec.index)
                return
            continue
        except StageLinkError as exc:
            if inbox.closed:  # upstream died or the pipeline is being torn down: nothing more will come
                log.info("stage %d: upstream hop closed (%s); exiting", spec.index, exc)
                return
            # A refused frame was dropped: this stage is now out of step with the others. Report it;
            # the main process fails the pipeline and restarts it.
            log.error("stage %d refused a frame: %s", spec.index, exc)
            outbox.put(StageFailed(spec.index, f"refused a frame: {exc}"))
            continue
        outbox.put(worker.handle(message))
        if isinstance(message, Stop):
            log.info("stage %d stopping", spec.index)
            return
