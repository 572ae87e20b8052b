"""What a local mesh runs: its model, devices, links, ports, security and supervision, checked when made.

`MeshConfig` is the one description `tophat serve`, `make demo`, the benchmarks and the end-to-end tests
hand to `Mesh` (tophatctl/mesh.py). `mesh_model_dir` checks its model before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shared.model.placement import PlacementError, parse_dtype_spec
from tophatctl.mesh_ports import (
    DEVICE_OFFSET,
    MAX_VERIFIERS,
    MONITOR_OFFSET,
    PLANNER_OFFSET,
    STREAMER_OFFSET,
    VERIFIER_OFFSET,
)

LINK_MODES = ("auto", "inprocess", "netns")
WILDCARD_HOSTS = ("0.0.0.0", "::")  # bind addresses meaning every interface
MAX_PORT = 65535


class MeshStartError(RuntimeError):
    """A service did not become ready in time (its log tail is in the message), or the mesh cannot start."""


class MeshConfigError(MeshStartError, ValueError):
    """A MeshConfig no mesh can run (a start error for the launcher's callers, a ValueError for the rest)."""


@dataclass
class MeshConfig:
    model_dir: str = "smollm2"  # smollm2 | demo | a checkpoint directory (tophatctl/models.py resolve_model)
    num_devices: int = 1
    port_base: int = 8000
    redis_url: str | None = None  # None: start an embedded redis-server
    split_layers: int = 2
    speculative: bool = True
    adapter: str = ""
    max_draft: int = 8
    eta: float = 0.6
    log_dir: Path | None = None  # None: a temp dir per run
    ready_timeout_s: float = 120.0
    host: str = "127.0.0.1"  # the address the mesh's processes are reached at (and bind, unless bind_host)
    # Where every service listens, when not at `host` (`tophat serve --host 0.0.0.0`: every interface, still
    # reached over loopback here); empty: `host`. See serve_hosts.
    bind_host: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    device_verifier_url: str | None = None  # where devices connect (default: the verifier); tests put a proxy here
    verifiers: int = 1  # replicas of the verifier (ports base+100+j); devices fail over between them
    # Emulated testbed: a link spec and a speed spec per device (";"-separated lists are cycled
    # over the devices), and how links are emulated: "inprocess" (shaper on the device's
    # WebSocket), "netns" (device in a network namespace behind a tc-shaped veth; root), or
    # "auto" (netns when available).
    link: str = "none"
    speed: str = "orin"
    link_mode: str = "auto"
    pipeline_stages: int = 1
    # the weights' precision in the verifier and every device agent: auto (float32 on a CPU) | f32 | bf16 | int8 |
    # int4 (shared/model/placement.py); int8/int4 are the CPU's fast decode (make bench-engine)
    dtype: str = "auto"
    device_env: dict[str, str] = field(default_factory=dict)  # extra TOPHAT_DEVICE_* settings
    # As a container deployment runs: devices take any free port and a host-name id and announce themselves
    # to the state monitor; the streamer routes to whatever announced (no list of device URLs).
    discover_devices: bool = False
    api_key: str = field(default="", repr=False)  # the OpenAI endpoint's key(s), comma-separated; empty: open
    # Every hop authenticated (shared/auth/verify.py): a fresh signing key per Mesh for the state monitor (the issuer),
    # service credentials for the cloud side, a bootstrap token per device (tophatctl/mesh_credentials.py).
    # auth=False: open, as before.
    auth: bool = True
    # Secret rotation of the hidden basis (shared/privacy/hidden_rotation.py): the verifiers re-parameterise their
    # middle layers for it, the device agents rotate their uplink with it (TOPHAT_*_HIDDEN_ROTATION). Empty: off.
    hidden_rotation: str = field(default="", repr=False)
    # `tophat serve`: restart a process that dies (tophatctl/supervisor.py) and keep a JSON list of every
    # process (role, pid, url) in state_file, rewritten after each restart.
    supervise: bool = False
    state_file: Path | None = None
    # TLS on every hop: a development CA and server certificate made in log_dir/tls (tophatctl/certs.py),
    # every service serving only https / wss with it, every client trusting that CA.
    tls: bool = False
    # Jupiter's edge pipeline (tophatctl/edge_pipeline.py): the model over these edge devices as pipeline
    # stages ("orin;xavier;xavier", speed classes with optional ':memory' budgets), neighbours linked by `lan`;
    # the layer partition and sub-sequence table from `edge_plan` (a stored plan) or planned at start
    # (`edge_plan_kind`: jupiter | equal | serial) from the model's stored profile. One device agent: stage 0.
    edge_pipeline: str = ""
    # Edge SD (services/device_agent/edge_server.py): device agent 0 is the small base station's draft server for
    # many users (mode edge-sd, its draft model), the verifier holds the whole target and verifies token ids.
    edge_draft_server: bool = False
    edge_plan: str = ""
    edge_plan_kind: str = "jupiter"
    lan: str = "lan"
    device_hosts: dict[int, str] = field(default_factory=dict)  # filled when devices live in namespaces

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise MeshConfigError for a mesh that cannot run. Called when made and again at start, because
        callers (and the launcher itself) change fields of a config after making it."""
        if not 1 <= self.verifiers <= MAX_VERIFIERS:
            raise MeshConfigError(
                f"verifiers must be 1..{MAX_VERIFIERS} (ports base+{VERIFIER_OFFSET} .. "
                f"base+{DEVICE_OFFSET - 1}), got {self.verifiers}"
            )
        if self.num_devices < 1:
            raise MeshConfigError(f"a mesh needs at least one device agent, got num_devices={self.num_devices}")
        if not 0 < self.port_base <= MAX_PORT - DEVICE_OFFSET - self.num_devices + 1:
            raise MeshConfigError(f"port_base {self.port_base} puts the mesh's ports outside 1..{MAX_PORT}")
        if self.link_mode not in LINK_MODES:
            raise MeshConfigError(f"link_mode must be one of {', '.join(LINK_MODES)}, got {self.link_mode!r}")
        if self.ready_timeout_s <= 0:
            raise MeshConfigError(f"ready_timeout_s must be positive, got {self.ready_timeout_s}")
        try:
            parse_dtype_spec(self.dtype)
        except PlacementError as exc:
            raise MeshConfigError(str(exc)) from exc

    @property
    def bind(self) -> str:
        """The address the mesh's services listen on."""
        return self.bind_host or self.host

    @property
    def http_scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def ws_scheme(self) -> str:
        return "wss" if self.tls else "ws"

    @property
    def streamer_url(self) -> str:
        return f"{self.http_scheme}://{self.host}:{self.port_base + STREAMER_OFFSET}"

    @property
    def planner_url(self) -> str:
        return f"{self.http_scheme}://{self.host}:{self.port_base + PLANNER_OFFSET}"

    @property
    def monitor_url(self) -> str:
        return f"{self.http_scheme}://{self.host}:{self.port_base + MONITOR_OFFSET}"

    @property
    def verifier_port(self) -> int:
        return self.port_base + VERIFIER_OFFSET

    def verifier_name(self, replica: int) -> str:
        """Replica 0 is plain `verifier-cloud` (what logs, state files and tests name it)."""
        return "verifier-cloud" if replica == 0 else f"verifier-cloud-{replica}"

    def verifier_urls(self, host: str | None = None) -> str:
        """Every verifier replica's WebSocket URL, comma-separated (what a device agent is given)."""
        return ",".join(
            f"{self.ws_scheme}://{host or self.host}:{self.verifier_port + j}/ws" for j in range(self.verifiers)
        )

    def device_port(self, index: int) -> int:
        return self.port_base + DEVICE_OFFSET + index

    def device_url(self, index: int) -> str:
        return f"{self.http_scheme}://{self.device_hosts.get(index, self.host)}:{self.device_port(index)}"

    def per_device(self, spec: str, index: int) -> str:
        parts = [p.strip() for p in spec.split(";") if p.strip()] or ["none"]
        return parts[index % len(parts)]


def serve_hosts(address: str) -> dict[str, str]:
    """`tophat serve --host ADDRESS` as MeshConfig's host and bind_host: a wildcard (0.0.0.0, ::) binds every
    interface and the processes reach each other over loopback; any other address is bound and reached both.
    A literal IPv6 address other than :: is refused (the mesh's URLs are built from it unbracketed)."""
    if address in WILDCARD_HOSTS:
        return {"host": "127.0.0.1", "bind_host": address}
    if ":" in address:
        raise MeshConfigError(
            f"--host {address}: an IPv6 address other than :: is not supported; "
            "use a host name, an IPv4 address, 0.0.0.0 or ::"
        )
    return {"host": address, "bind_host": ""}


def mesh_model_dir(config: MeshConfig) -> Path:
    """The mesh's checkpoint directory, checked before any process starts: a speculative mesh needs a
    draft adapter, and a missing one is a choice for the operator to make, not a device crash."""
    # Both pull in torch: imported here, so making a MeshConfig stays cheap.
    from shared.model.adapter import ADAPTER_FILENAME
    from tophatctl.models import resolve_model

    path = resolve_model(config.model_dir).resolve()
    if not (path / "config.json").is_file():
        raise MeshStartError(
            f"{path} is not a checkpoint directory (no config.json); a model is smollm2, demo or a checkpoint directory"
        )
    if config.speculative and not config.adapter and not (path / ADAPTER_FILENAME).is_file():
        raise MeshStartError(
            f"{path} has no draft adapter ({ADAPTER_FILENAME}). Train one (`tophat train-adapter --model "
            f"{path}`), or choose: --adapter random (untrained: still lossless, but it accepts "
            "almost nothing, so speculation gains nothing) or --no-speculation (plain U-shape)"
        )
    return path
