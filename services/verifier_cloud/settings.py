"""Verifier settings, from `TOPHAT_VERIFIER_*` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.verifier_cloud.kv_plan import check_kv_settings
from services.verifier_cloud.stage_plan import (
    parse_address,
    parse_stage_layers,
    parse_stage_links,
    parse_stage_slowdowns,
)
from shared.model.placement import parse_device_spec, parse_dtype_spec
from shared.planning.prefill_pieces import DEFAULT_MAX_PREFILL_STEP_MS
from shared.service_settings import ServiceSettings, reject_first
from shared.settings import from_env
from shared.wire.schema import MAX_FRAME_BYTES

ENV_PREFIX = "TOPHAT_VERIFIER_"


@dataclass(frozen=True)
class Settings(ServiceSettings):
    host: str = "127.0.0.1"
    port: int = 8100
    model_dir: str = "models/demo"
    split_layers: int = 2  # m: the device keeps layers [0, m); the cloud runs [m, n)
    max_frame_bytes: int = MAX_FRAME_BYTES  # also the transport limit: a larger frame closes the connection (1009)
    max_batch_tokens: int = 4096  # packed tokens per batched forward pass
    max_sessions: int = 256  # sessions open at once over every connection (one more: OVERLOADED)
    # Per-device bounds: one connection (a device agent) holds at most this many sessions, so it cannot lock
    # other devices out; a session queues at most this many items (more: OVERLOADED for the item); a session
    # without requests or replies for the TTL is closed and its KV freed (the device then gets UNKNOWN_SESSION).
    max_sessions_per_connection: int = 64
    # ... and one device credential (the token's subject) at most this many over all its connections, so opening
    # more connections buys nothing; 0: the same as max_sessions_per_connection. With auth off there is no
    # identity to count by: the bound is then per connection.
    max_sessions_per_device: int = 0
    max_queue_per_session: int = 256  # items one session may queue (more: OVERLOADED for the item)
    # Memory budgets in bytes (budgets.py), checked where memory is taken: opening or forking a session, and
    # admitting a frame whose rows would grow its KV or wait in its queue. Over one: a typed refusal (KV_BUDGET,
    # QUEUE_BUDGET) naming the budget and the numbers, and nothing taken. KV is charged at the capacity a session's
    # caches may reach (an upper bound of what they allocate; token sessions with their layers [0, m) too; with
    # stage workers at 4 bytes an element). A device is a token subject, or a connection with auth off.
    # This one: the KV of every session together (32 GiB).
    kv_bytes_total: int = 32 * 2**30
    # One device's sessions; 0: its fair share, kv_bytes_total * (its session limit / max_sessions): 8 GiB by
    # default, so the device with the most sessions it may hold fills no more of the KV than of the sessions.
    kv_bytes_per_device: int = 0
    queued_bytes_total: int = 2**30  # rows of queued frames (prefill chunks, verifies) of every session (1 GiB)
    queued_bytes_per_device: int = 0  # ... of one device's sessions; 0: the same fair share (256 MiB by default)
    # A device that does not read its replies: once the bytes written to its connection and not yet taken by the
    # socket pass this (64 MiB), the connection is closed (and its sessions freed), whatever send_timeout_s says.
    send_buffer_bytes: int = 4 * MAX_FRAME_BYTES
    session_idle_ttl_s: float = 300.0  # a session without requests or replies this long is closed, its KV freed
    idle_timeout_s: float = 600.0  # a device silent this long is disconnected and its KV freed
    send_timeout_s: float = 10.0  # one WebSocket send to a device agent
    state_monitor_url: str = ""  # empty: no telemetry
    torch_threads: int = 1  # per process: the server with P = 1, each stage worker with P > 1
    # Where and how the middle layers compute (shared/model/placement.py). device: auto (CUDA when present,
    # else cpu) | cpu | cuda | cuda:N; with P > 1 an unindexed spec runs stage i on cuda:(i mod GPUs), cuda:N
    # pins every stage. dtype: auto (float32 on the CPU; bfloat16 on a GPU that has it, else float16) |
    # float32 | float16 | bfloat16. Hidden states on the wire keep the sessions' wire dtype either way.
    device: str = "auto"
    dtype: str = "auto"
    # The KV layout (docs/design/verifier-static-kv.md). dynamic: a session's caches grow by doubling and are
    # charged as far as they may grow; static: each session holds a preallocated slot of the whole context
    # (never reallocated, so verify passes can replay from CUDA graphs), charged whole from its open; the
    # pool has min(max_sessions, kv_bytes_total / one slot) slots. auto: static where CUDA graphs run, else dynamic.
    kv_layout: str = "auto"
    # Verify and decode passes of at most cuda_graph_rows' largest bucket, in the static layout, padded to a
    # bucket and replayed from a CUDA graph captured per (rows, cache rows) bucket; larger passes run eagerly.
    # auto: where the middle layers run on CUDA; on: elsewhere too, the same static-shape pass run eagerly
    # (what the CPU tests check); off: never.
    cuda_graphs: str = "auto"
    cuda_graph_rows: str = "1,2,4,8,16,32"
    # Secret rotation of the hidden basis (shared/privacy/hidden_rotation.py): the middle layers are re-parameterised at
    # load for this secret, the devices (same secret) rotate what they send; exact. Empty: off. A cloud that
    # holds these weights and the public checkpoint can solve for the rotation (tophatctl/privacy/).
    hidden_rotation: str = field(default="", repr=False)
    # P: the middle layers run as P contiguous layer ranges, each in its own worker process, with up to
    # P micro-batches in flight (HAT §4.5). 1 = in-process, no workers.
    pipeline_stages: int = 1
    # With P > 1: a session's next prefill chunk may enter stage 0 while its previous chunk is still in a
    # later stage (HAT eq. 3's pipelined chunk rate). Off: one item per session in flight, chunks pay a whole pass.
    prefill_pipelining: bool = True
    stage_start_timeout_s: float = 120.0  # spawn + import torch + load weights, per pipeline start
    stage_timeout_s: float = 60.0  # a micro-batch in flight longer than this marks the pipeline failed
    # Token mode (HAT's "cloud" baseline): also hold the embeddings, layers [0, m), norm and head, and serve
    # sessions that send token ids (no privacy). Off by default: a privacy-mode verifier must not hold them.
    full_model: bool = False
    # U-Sarathi (HAT's baseline): compute prefill items longer than this in pieces of this many tokens, one piece
    # per scheduler step, interleaved with other sessions' work. 0 = off (an item runs whole).
    server_chunk_tokens: int = 0
    # Without fixed pieces: while another session is decoding, a prefill is computed in pieces whose pass the
    # verifier's measured g(mu) predicts within this many ms, so decoding rounds wait for a piece, not a prompt.
    # A GPU's flat curve fits a whole prompt in one pass; a CPU's takes pieces. 0 = off (prompts run whole).
    max_prefill_step_ms: float = DEFAULT_MAX_PREFILL_STEP_MS
    # Prefills of how many sessions one step may hold, oldest session first (0: no bound). On a verifier whose
    # pass costs grow with its rows (a CPU), two prompts sharing every pass both finish late; taking them in
    # arrival order finishes the first at its own pace and the second no later. A GPU below saturation may batch more.
    prefill_sessions_per_step: int = 1
    # The stages' own plan (services/verifier_cloud/stage_plan.py), each optional. stage_layers: explicit contiguous
    # [start, stop) ranges of the middle layers, "2-5,5-12,12-30", replacing the equal split; P is their count
    # (pipeline_stages left at 1 follows it, any other value must agree). stage_slowdowns: each stage's emulated
    # slowdown, "1,3,3" (shared/planning/device_speed.py). stage_links: the P+1 hops' link specs separated by ';'
    # (shared/net/links.py, e.g. "lan"; hop 0 = main -> stage 0, hop P = last stage -> main; one spec = every hop; empty
    # = unshaped). Any of them set runs the middle layers in stage workers even with P = 1 (a stage across a link).
    # stage_host: the address stages (and the return hop) listen on.
    stage_layers: str = ""
    stage_slowdowns: str = ""
    stage_links: str = ""
    stage_host: str = "127.0.0.1"
    # Stages started on their own (`tophat stage`, services/verifier_cloud/remote_stages.py), on this host or
    # others: their host:port addresses in pipeline order, "jetson-1:7200,jetson-2:7200"; P is their count and
    # nothing is spawned. stage_return_address: host:port where the last stage reaches this verifier again (the
    # return hop listens on stage_host at that port; empty: stage_host, a port the kernel picks: one host only).
    stage_addresses: str = ""
    stage_return_address: str = ""
    # What each connection to the return hop's listener has to present its run token in (a stage's own
    # listener: TOPHAT_STAGE_HANDSHAKE_TIMEOUT_S); connections are read concurrently, so a silent one costs
    # only itself, never the wiring.
    stage_handshake_timeout_s: float = 5.0
    # An audit tool (measured privacy, shared/capture.py): append every hidden-state frame this verifier accepts
    # (PrefillChunk, VerifyRequest; as received, in the wire dtype) to this file, so what a cloud could keep can
    # be attacked offline. Empty: off. When on, the verifier logs a WARNING at start: it stores users' states.
    capture_path: str = ""

    def __post_init__(self) -> None:
        if self.pipeline_stages == 1 and (self.stage_layers.strip() or self.stage_addresses.strip()):
            spec, parse = (
                (self.stage_layers, parse_stage_layers)
                if self.stage_layers.strip()
                else (self.stage_addresses, lambda text: text.split(","))
            )
            try:
                count = len(parse(spec))
            except ValueError:
                return  # validate() reports the spec
            object.__setattr__(self, "pipeline_stages", count)  # P follows the explicit ranges or addresses

    @property
    def stage_workers(self) -> bool:
        """Whether the middle layers run in stage worker processes (else in-process)."""
        return self.pipeline_stages > 1 or any(
            s.strip() for s in (self.stage_layers, self.stage_slowdowns, self.stage_links, self.stage_addresses)
        )

    def remote_stage_addresses(self) -> list[tuple[str, int]]:
        """The stage_addresses setting as (host, port) pairs; [] when the stages are spawned here."""
        return [parse_address(a) for a in self.stage_addresses.split(",") if a.strip()]

    @property
    def device_session_limit(self) -> int:
        return self.max_sessions_per_device or self.max_sessions_per_connection

    def _fair_share(self, total: int) -> int:
        return max(1, total * min(self.device_session_limit, self.max_sessions) // self.max_sessions)

    @property
    def device_kv_bytes(self) -> int:
        """One device's KV budget: kv_bytes_per_device, or (0) its fair share of kv_bytes_total."""
        return self.kv_bytes_per_device or self._fair_share(self.kv_bytes_total)

    @property
    def device_queued_bytes(self) -> int:
        """One device's budget of queued bytes: queued_bytes_per_device, or (0) its share of the total."""
        return self.queued_bytes_per_device or self._fair_share(self.queued_bytes_total)

    def validate(self) -> None:
        super().validate()  # auth, logging, TLS (shared/service_settings.py)
        reject_first(
            (not 0 <= self.port <= 65535, f"port out of range: {self.port}"),
            (self.split_layers < 1, "split_layers must be >= 1"),
            (
                self.max_frame_bytes < 1024 or self.max_batch_tokens < 1 or self.max_sessions < 1,
                "max_frame_bytes, max_batch_tokens and max_sessions are too small",
            ),
            (
                self.max_sessions_per_connection < 1 or self.max_queue_per_session < 1,
                "max_sessions_per_connection and max_queue_per_session must be >= 1",
            ),
            (
                min(self.kv_bytes_total, self.queued_bytes_total) < 1,
                "kv_bytes_total and queued_bytes_total must be >= 1",
            ),
            (
                min(self.kv_bytes_per_device, self.queued_bytes_per_device) < 0,
                "kv_bytes_per_device and queued_bytes_per_device must be >= 0 (0 = a fair share)",
            ),
            (self.send_buffer_bytes < 1024, "send_buffer_bytes must be >= 1024"),
            (
                self.max_sessions_per_device < 0,
                "max_sessions_per_device must be >= 0 (0 = max_sessions_per_connection)",
            ),
            (
                min(
                    self.idle_timeout_s,
                    self.send_timeout_s,
                    self.stage_start_timeout_s,
                    self.stage_timeout_s,
                    self.session_idle_ttl_s,
                    self.stage_handshake_timeout_s,
                )
                <= 0,
                "timeouts must be > 0",
            ),
            (self.pipeline_stages < 1, "pipeline_stages must be >= 1"),
            (self.torch_threads < 1, "torch_threads must be >= 1"),
        )
        parse_device_spec(self.device)  # syntax here; the GPUs themselves are checked when the model loads
        parse_dtype_spec(self.dtype)
        check_kv_settings(self.kv_layout, self.cuda_graphs, self.cuda_graph_rows)
        reject_first(
            (self.server_chunk_tokens < 0, "server_chunk_tokens must be >= 0 (0 = off)"),
            (not self.max_prefill_step_ms >= 0, "max_prefill_step_ms must be >= 0 (0 = off)"),
            (self.prefill_sessions_per_step < 0, "prefill_sessions_per_step must be >= 0 (0 = no bound)"),
        )
        self._validate_stages()
        reject_first(
            (
                self.full_model and self.hidden_rotation,
                "full_model (token mode) runs layers [0, m) and the head beside the middle layers: it "
                "cannot serve a rotated middle (hidden_rotation); token mode has no privacy anyway",
            ),
            (
                self.full_model and self.stage_workers,
                "full_model (token mode) runs in-process: it needs pipeline_stages = 1 and no stage_* "
                f"settings, got {self.pipeline_stages} stage(s)",
            ),
        )

    def _validate_stages(self) -> None:
        """The stage_* specs: each parses, and the explicit ranges or addresses give pipeline_stages stages."""
        if self.stage_layers.strip():
            ranges = parse_stage_layers(self.stage_layers, self.split_layers)
            if len(ranges) != self.pipeline_stages:
                raise ValueError(
                    f"stage_layers gives {len(ranges)} stages but pipeline_stages is {self.pipeline_stages}"
                )
        parse_stage_slowdowns(self.stage_slowdowns, self.pipeline_stages)
        parse_stage_links(self.stage_links, self.pipeline_stages)
        if self.stage_addresses.strip():
            addresses = self.remote_stage_addresses()
            if len(addresses) != self.pipeline_stages:
                raise ValueError(
                    f"stage_addresses gives {len(addresses)} stages but pipeline_stages is {self.pipeline_stages}"
                )
            if self.stage_slowdowns.strip() or self.stage_links.strip():
                raise ValueError(
                    "stage_slowdowns and stage_links emulate spawned stages; stages started on their own run "
                    "at their own speed over real links (give a stage its --slowdown instead)"
                )
        if self.stage_return_address.strip():
            parse_address(self.stage_return_address)


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    return from_env(Settings, ENV_PREFIX, environ, **overrides)
