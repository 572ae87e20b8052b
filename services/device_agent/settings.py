"""Device-agent settings, from `TOPHAT_DEVICE_*` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.model.placement import parse_device_spec, parse_dtype_spec
from shared.modes import MODES
from shared.planning.draft_budget import MAX_OPTIONS, DraftShape
from shared.service_settings import ServiceSettings, reject_first
from shared.settings import from_env
from shared.specdec.draft_config import DraftConfig
from shared.wire.schema import WireDtype

ENV_PREFIX = "TOPHAT_DEVICE_"


@dataclass(frozen=True)
class Settings(ServiceSettings):
    device_id: str = "device-0"  # "auto": <host name>-<port>, unique per replica of a scaled service
    host: str = "127.0.0.1"
    port: int = 8200  # 0: any free port (replicas sharing a host's network)
    # Where the token streamer reaches this agent; announced to the state monitor every announce_interval_s
    # (0 = never). Empty: http://<this host's address>:<port>.
    advertise_url: str = ""
    announce_interval_s: float = 5.0
    port_file: str = ""  # written with the port listened on (for a healthcheck when port is 0)
    model_dir: str = "models/demo"
    split_layers: int = 2  # m: must match the verifier's
    adapter: str = ""  # draft adapter file; "random" = untrained; empty = MODEL_DIR/draft_adapter.safetensors
    # hat: U-shaped split, hidden states only (the switches below apply). cloud: HAT's cloud baseline, the whole
    # model in the verifier (TOPHAT_VERIFIER_FULL_MODEL), token ids on the wire, no privacy, one token per round
    # trip; SD/PC/PD do not apply. token-sd / picospec / hat-async: shared/modes.py. A request's "mode" overrides this.
    mode: str = "hat"
    # Streamed drafts (token-sd, picospec, hat-async): drafts per chunk and the most unverified drafts when
    # pipelined. On a sampled rejection in token mode the cloud sends the whole target row ("full": the output
    # has exactly the target's distribution) or, as PicoSpec does, its top_k ("topk": ~80 bytes instead of
    # 4 V, but the correction is then drawn from an approximate residual). Greedy sends the correction alone.
    stream_group: int = 2
    stream_window: int = 8
    stream_eta_gate: bool = True  # pipelined runs stop drafting ahead at a draft below eta (stream_engine.py)
    downlink: str = "full"  # full | topk: on a sampled rejection the cloud sends the whole row, or its top_k
    top_k: int = 10  # K of the topk downlink
    speculative: bool = True  # False: plain U-shape, one token per cloud round trip
    eta: float = DraftConfig.eta  # HAT eq. 5 drafting threshold
    max_draft: int = DraftConfig.max_draft  # most draft tokens per round (a tree's depth); 0: no speculation
    # Draft trees (EAGLE-2, shared/specdec/tree_drafting.py): nodes per round (0: a chain stopped by eta), children
    # per expanded node and nodes expanded per level, and how unlikely a path may get before growing stops.
    tree_nodes: int = 0
    tree_width: int = DraftConfig.tree_width
    tree_min_prob: float = DraftConfig.tree_min_prob
    # The draft budget per round from the link and the verifier's load (shared/planning/draft_budget.py): the shapes the
    # chunk planner chooses among for hat requests (tried once each, then chosen); empty: always the shape above.
    # On a loaded verifier it falls to none (U-shape rounds), so HAT never costs more than U-shape. Trees need a
    # verifier with pipeline_stages 1: a staged one refuses them (`tophat serve --pipeline-stages` drops them).
    draft_budgets: str = "none,chain,tree16"
    # HAT Table 5 switches: SD = speculative (above), PC = prompt chunking, PD = parallel drafting.
    prompt_chunking: bool = True  # False: the whole prompt in one upload
    overlap_prefill: bool = True  # False: wait for each chunk's answer before the next (U-Sarathi-like)
    parallel_candidates: int = 2  # PD: top-k candidates pre-drafted during verification; 0 = off
    parallel_steps: int = 0  # PD: steps per candidate; 0 = ask the chunk planner (HAT eq. 6), fallback 2
    verifier_url: str = "ws://127.0.0.1:8100/ws"  # several replicas: comma-separated, tried in turn
    # A session whose verifier goes away mid-generation is replayed on a reachable one (a timeout is not a
    # loss: the request fails with CloudTimeout). One recovery is retried for at most failover_deadline_s; a
    # session is recovered at most failover_max_recoveries times and for failover_total_s in all; past any of
    # these the request fails with FailoverExhausted.
    failover_deadline_s: float = 30.0
    failover_max_recoveries: int = 3
    failover_total_s: float = 60.0
    # Then: "error" (the request fails as above) or "finish_on_device" (the draft model finishes the answer
    # alone; the done event's stats say degraded=true: not the target model's output).
    on_cloud_loss: str = "error"
    chunk_planner_url: str = ""  # empty: fixed default_chunk_size
    state_monitor_url: str = ""  # empty: no telemetry
    default_chunk_size: int = 128  # prefill chunk when no chunk planner answers
    # Jupiter's edge pipeline (tophatctl/edge_pipeline.py): a stored plan whose sub-sequence table cuts every
    # chunked prompt (the planner's chunk size is not asked); empty: not an edge pipeline's first stage.
    edge_plan: str = ""
    # Edge SD (services/device_agent/edge_server.py): this agent is the small base station's draft server for
    # many users; requests in mode edge-sd wait up to edge_window_s for the round they join (at most
    # edge_max_tasks), which is planned (chunk planner POST /edge-sd/plan) and run as batches pipelined against
    # the verifier. edge_memory_budget: the SBS memory for the draft model (Γ_s); edge_bandwidth_mhz: the
    # shared uplink (B_w, paper Table II: 20). A request's snr_db is its user's uplink SNR (else the planner's).
    # The policy switches are the bench's baselines: edge_bandwidth eq27 | uniform, edge_batching dp | max,
    # edge_spec_len 0 (chosen by eq. 7) or a fixed l, edge_pipeline false (draft and verify in turn).
    edge_draft_server: bool = False
    edge_window_s: float = 0.05
    edge_max_tasks: int = 32
    edge_memory_budget: str = "2GiB"
    edge_bandwidth_mhz: float = 20.0
    edge_bandwidth: str = "eq27"
    edge_batching: str = "dp"
    edge_spec_len: int = 0
    edge_pipeline: bool = True
    # Emulated testbed (HAT §4.1): link profile name or spec (see shared/net/links.py), applied
    # in-process on the WebSocket; named profiles are for a 4096-wide model and get scaled
    # to this model's hidden size when link_scaled. Speed: orin | xavier | cycle | 1,2,5@5.
    link: str = "none"
    link_scaled: bool = True
    speed: str = "orin"
    # beta_up / beta_down for the planners: bulk probes over the verifier connection at startup
    # and then at most this often, between requests (0 = never).
    bandwidth_probe_interval_s: float = 30.0
    # A one-row round trip to the verifier this often, busy or not (two tiny frames): latency
    # plus both ends' framing and event-loop time under the current load, for the simulator.
    rtt_probe_interval_s: float = 5.0
    wire_dtype: str = "f2"  # hidden states on the wire: f2 (fp16), f4 (fp32), bf (bf16)
    max_sessions: int = 4  # concurrent generations on this device; more get 503
    # Kept sessions (`"keep": true` on /generate; forked by `"fork": handle`): device and verifier KV of a
    # finished request held for reuse, each for kept_ttl_s after it was kept, at most max_kept (oldest go first).
    kept_ttl_s: float = 120.0
    max_kept: int = 16
    request_timeout_s: float = 60.0  # one cloud round trip
    # A running request's NDJSON stream gets a heartbeat line after this long without a line (waiting in the
    # verifier's queue): the streamer's line timeout then catches a dead device, not a busy one.
    heartbeat_s: float = 5.0
    planner_timeout_s: float = 1.0  # one call to the chunk planner
    # The planner's answers are cached; a request uses the cached plan and one older than this is
    # refreshed in the background for the next request (only the very first request waits for one).
    plan_refresh_s: float = 2.0
    torch_threads: int = 1
    # Where the device's layers, adapter and head compute (shared/model/placement.py): auto (CUDA when
    # present, e.g. a Jetson's GPU, else cpu) | cpu | cuda | cuda:N; dtype auto (float32 on the CPU; bfloat16
    # on Orin-class GPUs, float16 on Xavier) | float32 | float16 | bfloat16. wire_dtype is separate.
    device: str = "auto"
    dtype: str = "auto"
    # Uplink hardening (shared/privacy/uplink_hardening.py), for the hidden-state modes (hat, hat-async).
    # hidden_rotation: the verifier's secret (its middle layers are re-parameterised for it): shallow states go up as
    # shallow @ Q^T, exact; empty: off. uplink_noise: Gaussian noise of std uplink_noise x each row's RMS on every row
    # sent; NOT lossless: the output is then the split model's on the noisy states; 0: off.
    hidden_rotation: str = field(default="", repr=False)
    uplink_noise: float = 0.0

    def validate(self) -> None:
        super().validate()  # auth, logging, TLS (shared/service_settings.py)
        from shared.net.links import parse_link_spec
        from shared.planning.device_speed import speed_schedule

        WireDtype(self.wire_dtype)
        parse_device_spec(self.device)  # syntax here; the GPU itself is checked when the model loads
        parse_dtype_spec(self.dtype)
        reject_first(
            (
                self.downlink not in ("topk", "full") or not 1 <= self.top_k <= 1000,
                f"downlink must be topk or full and top_k in [1, 1000], got {self.downlink!r}, {self.top_k}",
            ),
            (self.stream_group < 1 or self.stream_window < 1, "stream_group and stream_window must be >= 1"),
            (self.mode not in MODES, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}"),
        )
        parse_link_spec(self.link)
        speed_schedule(self.speed)
        reject_first((not 0 <= self.eta <= 1 or self.max_draft < 0, "eta must be in [0, 1] and max_draft >= 0"))
        DraftConfig(self.eta, self.max_draft, self.tree_nodes, self.tree_width, self.tree_min_prob)  # checks the tree
        self.budget_shapes()  # checks the names
        self._validate_serving()
        _ = self.edge_memory_budget_bytes  # parsed, so a bad size fails at start
        reject_first(
            (
                self.edge_bandwidth not in ("eq27", "uniform") or self.edge_batching not in ("dp", "max"),
                f"edge_bandwidth must be eq27 or uniform and edge_batching dp or max, got "
                f"{self.edge_bandwidth!r}, {self.edge_batching!r}",
            ),
            (
                self.edge_window_s < 0
                or self.edge_max_tasks < 1
                or self.edge_spec_len < 0
                or not self.edge_bandwidth_mhz > 0,
                "edge_window_s >= 0, edge_max_tasks >= 1, edge_spec_len >= 0 and edge_bandwidth_mhz > 0 are required",
            ),
        )

    def _validate_serving(self) -> None:
        """Sessions, timeouts, failover and the addresses this agent serves and announces."""
        timeouts = (self.request_timeout_s, self.planner_timeout_s, self.plan_refresh_s, self.failover_deadline_s)
        reject_first(
            (
                self.parallel_candidates < 0 or self.parallel_steps < 0,
                "parallel_candidates and parallel_steps must be >= 0",
            ),
            (
                self.max_sessions < 1 or self.default_chunk_size < 1 or self.max_kept < 1,
                "max_sessions, default_chunk_size and max_kept must be >= 1",
            ),
            (not self.uplink_noise >= 0, f"uplink_noise must be >= 0 (0 = off), got {self.uplink_noise}"),
            (self.kept_ttl_s <= 0, "kept_ttl_s must be > 0"),
            (not self.heartbeat_s > 0, f"heartbeat_s must be > 0, got {self.heartbeat_s}"),
            (min(*timeouts, self.failover_total_s) <= 0, "timeouts must be > 0"),
            (
                self.failover_max_recoveries < 0,
                f"failover_max_recoveries must be >= 0 (0: no failover), got {self.failover_max_recoveries}",
            ),
            (
                self.on_cloud_loss not in ("error", "finish_on_device"),
                f"on_cloud_loss must be error or finish_on_device, got {self.on_cloud_loss!r}",
            ),
            (not 0 <= self.port <= 65535, f"port out of range: {self.port}"),
            (
                self.advertise_url and not self.advertise_url.startswith(("http://", "https://")),
                f"advertise_url must be an http(s) URL: {self.advertise_url!r}",
            ),
            (
                min(self.bandwidth_probe_interval_s, self.rtt_probe_interval_s, self.announce_interval_s) < 0,
                "probe intervals must be >= 0 (0 = never)",
            ),
        )

    @property
    def edge_memory_budget_bytes(self) -> int:
        from shared.net.links import parse_bytes

        size = parse_bytes(self.edge_memory_budget, bits=False)
        if size is None or size <= 0:
            raise ValueError(f"edge_memory_budget must be a size like 2GiB, got {self.edge_memory_budget!r}")
        return int(size)

    def default_shape(self) -> str:
        """The configured draft shape's name in shared/planning/draft_budget.py's terms."""
        if not self.speculative or self.max_draft == 0:
            return "none"
        return f"tree{self.tree_nodes}" if self.tree_nodes else "chain"

    def budget_shapes(self) -> list[DraftShape]:
        """The shapes of `draft_budgets`, the configured one included; [] when budgeting is off."""
        names = [n.strip() for n in self.draft_budgets.split(",") if n.strip()]
        if not names:
            return []
        names += [self.default_shape()] if self.default_shape() not in names else []
        names = list(dict.fromkeys(names))
        if len(names) > MAX_OPTIONS:
            raise ValueError(f"draft_budgets names {len(names)} shapes; at most {MAX_OPTIONS}")
        return [DraftShape.parse(name, self.max_draft) for name in names]


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    return from_env(Settings, ENV_PREFIX, environ, **overrides)
