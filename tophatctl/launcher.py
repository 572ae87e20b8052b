"""Start the whole mesh as separate processes on localhost, and stop it cleanly.

Used by `tophat up`, `make demo` and the end-to-end tests. Ports are laid out
from one base (default 8000):

    token-streamer  base        chunk-planner  base+10     state-monitor  base+20
    verifier-cloud  base+100    device agents  base+200+i  redis          a free port (embedded)
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.redis_server import EmbeddedRedis
from shared.telemetry import redact_url

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Every service's settings prefix: with TLS each process gets all of them (each reads only its own).
TLS_PREFIXES = ("TOPHAT_STATE_MONITOR_", "TOPHAT_CHUNK_PLANNER_", "TOPHAT_VERIFIER_", "TOPHAT_DEVICE_",
                "TOPHAT_STREAMER_")


def _ephemeral_port_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_port_base(num_devices: int, host: str = "127.0.0.1", num_verifiers: int = 1) -> int:
    """A base whose whole port layout is free right now (for tests and parallel meshes)."""
    import random
    import socket

    # Stay below the kernel's ephemeral range: services' own outgoing connections take ports
    # from it, and one of them could land in our layout between this check and the bind.
    low_ephemeral = _ephemeral_port_floor()
    for _ in range(200):
        base = random.randrange(10_000, max(10_010, low_ephemeral - 300 - num_devices), 10)
        ports = ([base, base + 10, base + 20] + [base + 100 + j for j in range(num_verifiers)]
                 + [base + 200 + i for i in range(num_devices)])
        try:
            sockets = []
            for port in ports:
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError("no free port layout found")


class MeshStartError(RuntimeError):
    """A service did not become ready in time (its log tail is in the message)."""


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
    host: str = "127.0.0.1"
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
    device_env: dict[str, str] = field(default_factory=dict)  # extra TOPHAT_DEVICE_* settings
    # As a container deployment runs: devices take any free port and a host-name id and announce themselves
    # to the state monitor; the streamer routes to whatever announced (no list of device URLs).
    discover_devices: bool = False
    api_key: str = field(default="", repr=False)  # the OpenAI endpoint's key(s), comma-separated; empty: open
    # Every hop authenticated (shared/auth.py): one mesh secret in every service's TOPHAT_*_AUTH_SECRET, each
    # minting its own short-lived tokens; auth_secret empty: a random one per Mesh. auth=False: open, as before.
    auth: bool = True
    auth_secret: str = field(default="", repr=False)
    # Secret rotation of the hidden basis (shared/model/rotation.py): the verifiers re-parameterise their middle
    # layers for it, the device agents rotate their uplink with it (TOPHAT_*_HIDDEN_ROTATION). Empty: off.
    hidden_rotation: str = field(default="", repr=False)
    # `tophat up`: restart a process that dies (tophatctl/supervisor.py) and keep a JSON list of every
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

    @property
    def http_scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def ws_scheme(self) -> str:
        return "wss" if self.tls else "ws"

    @property
    def streamer_url(self) -> str:
        return f"{self.http_scheme}://{self.host}:{self.port_base}"

    @property
    def planner_url(self) -> str:
        return f"{self.http_scheme}://{self.host}:{self.port_base + 10}"

    @property
    def monitor_url(self) -> str:
        return f"{self.http_scheme}://{self.host}:{self.port_base + 20}"

    @property
    def verifier_port(self) -> int:
        return self.port_base + 100

    def verifier_urls(self, host: str | None = None) -> str:
        """Every verifier replica's WebSocket URL, comma-separated (what a device agent is given)."""
        return ",".join(f"{self.ws_scheme}://{host or self.host}:{self.verifier_port + j}/ws"
                        for j in range(self.verifiers))

    def device_url(self, index: int) -> str:
        return f"{self.http_scheme}://{self.device_hosts.get(index, self.host)}:{self.port_base + 200 + index}"

    def per_device(self, spec: str, index: int) -> str:
        parts = [p.strip() for p in spec.split(";") if p.strip()] or ["none"]
        return parts[index % len(parts)]

    device_hosts: dict[int, str] = field(default_factory=dict)  # filled when devices live in namespaces


def mesh_model_dir(config: MeshConfig) -> Path:
    """The mesh's checkpoint directory, checked before any process starts: a speculative mesh needs a
    draft adapter, and a missing one is a choice for the operator to make, not a device crash."""
    from shared.model.adapter import ADAPTER_FILENAME
    from tophatctl.models import resolve_model

    path = resolve_model(config.model_dir).resolve()
    if not (path / "config.json").is_file():
        raise MeshStartError(f"{path} is not a checkpoint directory (no config.json); "
                             "a model is smollm2, demo or a checkpoint directory")
    if config.speculative and not config.adapter and not (path / ADAPTER_FILENAME).is_file():
        raise MeshStartError(
            f"{path} has no draft adapter ({ADAPTER_FILENAME}). Train one (`tophat train-adapter --model "
            f"{path}`), or choose: --adapter random (untrained: still lossless, but it accepts "
            "almost nothing, so speculation gains nothing) or --no-speculation (plain U-shape)")
    return path


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    ready_url: str
    log_path: Path
    # How it was started, so the supervisor restarts it the same way (netns prefix, env, ports).
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def role(self) -> str:
        """The service kind: device-agent-3 -> device-agent, verifier-cloud-1 -> verifier-cloud."""
        replica = self.name.startswith(("device-agent-", "verifier-cloud-"))
        return self.name.rsplit("-", 1)[0] if replica else self.name

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Mesh:
    def __init__(self, config: MeshConfig):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url: str | None = None
        self.services: list[ServiceProcess] = []
        self.model_dir: Path | None = None  # the resolved checkpoint directory, once started
        self.edge_plan = None  # shared.jupiter.plan.EdgePlan with config.edge_pipeline, once planned
        self.netns_links: list = []
        self.discovered_urls: list[str] = []  # discover_devices: the agents' announced URLs
        self.supervisor = None  # a tophatctl.supervisor.Supervisor while supervising
        self._auth_secret = (config.auth_secret or secrets.token_urlsafe(32)) if config.auth else ""
        self.auth_env = {f"TOPHAT_{service}_AUTH_SECRET": self._auth_secret for service in
                         ("STATE_MONITOR", "CHUNK_PLANNER", "VERIFIER", "DEVICE", "STREAMER")} if config.auth else {}
        self.certs = None  # tophatctl.certs.DevCerts with config.tls, once started
        self.tls_env: dict[str, str] = {}  # every service's TOPHAT_*_TLS_* settings (empty: plain)
        if config.log_dir is None:
            import tempfile

            config.log_dir = Path(tempfile.mkdtemp(prefix="tophat-mesh-"))
        config.log_dir.mkdir(parents=True, exist_ok=True)

    # -- TLS -----------------------------------------------------------------------------
    def _make_certs(self) -> None:
        """A dev CA + one server certificate for every address a service is reached by (the host, loopback
        and, with namespaces, each device's veth ends), and every service's tls_* settings pointing at them."""
        from tophatctl.certs import DEFAULT_HOSTS, make_dev_certs
        from tophatctl.netns import subnet_for_index

        hosts = [self.config.host, *DEFAULT_HOSTS]
        if self._netns:
            hosts += [ip for i in range(self.config.num_devices) for ip in subnet_for_index(i)]
        self.certs = make_dev_certs(self.config.log_dir / "tls", list(dict.fromkeys(hosts)))
        files = {"TLS_CERT": self.certs.server_cert, "TLS_KEY": self.certs.server_key, "TLS_CA": self.certs.ca_cert}
        self.tls_env = {f"{prefix}{name}": str(path) for prefix in TLS_PREFIXES for name, path in files.items()}

    def client_verify(self):
        """httpx's `verify` for talking to this mesh: a context trusting its CA with TLS, the default without."""
        from shared.tls import client_context

        return client_context(str(self.certs.ca_cert)) if self.certs is not None else True

    def operator_auth(self, role: str = "service", subject: str = "tophat-operator"):
        """httpx `auth` for calling this mesh's internal endpoints directly (a device's /generate, the planner):
        a token minted from the mesh secret; None when the mesh runs open."""
        from shared.auth import client_auth

        return client_auth(self._auth_secret, subject, role)

    # -- lifecycle ---------------------------------------------------------------------
    def _spawn(self, name: str, module: str, env: dict[str, str], ready_url: str,
               prefix: list[str] | None = None) -> ServiceProcess:
        log_path = self.config.log_dir / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.tls_env,
                    **self.config.extra_env, **env}
        # The mesh's secret over the caller's environment (one secret for the whole mesh), under what this
        # mesh's extra_env or this service's own env sets.
        full_env.update({k: v for k, v in self.auth_env.items() if k not in self.config.extra_env and k not in env})
        command = [*(prefix or []), sys.executable, "-m", module]
        service = ServiceProcess(name, self._popen(command, full_env, log_path), ready_url, log_path, command, full_env)
        self.services.append(service)
        return service

    @staticmethod
    def _popen(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as handle:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def respawn(self, service: ServiceProcess) -> None:
        """Start a dead service again, as it was started (same command, environment and ports)."""
        service.process = self._popen(service.command, service.env, service.log_path)
        service.started_at = time.monotonic()

    def process_table(self) -> list[dict]:
        """Every process of the mesh: role, name, pid and URL (Redis's redacted), for the state file."""
        urls = self.urls()
        table = [{"role": s.role, "name": s.name, "pid": s.process.pid, "url": urls.get(s.name, "")}
                 for s in self.services]
        if self.redis is not None and self.redis.pid is not None:
            table.append({"role": "redis", "name": "redis", "pid": self.redis.pid, "url": urls["redis"]})
        return table

    def _wait_ready(self, services: list[ServiceProcess]) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = list(services)
        with httpx.Client(timeout=2.0, verify=self.client_verify()) as client:
            while pending:
                for service in list(pending):
                    if service.process.poll() is not None:
                        raise MeshStartError(f"{service.name} exited with {service.process.returncode}:\n{service.log_tail()}")
                    try:
                        if client.get(service.ready_url).status_code == 200:
                            pending.remove(service)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    raise MeshStartError(f"not ready after {self.config.ready_timeout_s}s: {names}\n{pending[0].log_tail()}")
                if pending:
                    time.sleep(0.2)

    def _spawn_streamer(self, device_urls: str) -> ServiceProcess:
        cfg = self.config
        return self._spawn("token-streamer", "services.token_streamer", {
            "TOPHAT_STREAMER_PORT": str(cfg.port_base),
            "TOPHAT_STREAMER_DEVICE_URLS": device_urls,
            "TOPHAT_STREAMER_STATE_MONITOR_URL": cfg.monitor_url,
            "TOPHAT_STREAMER_MODEL_NAME": self.model_dir.name,  # what /v1/models lists: smollm2, demo, ...
            **({"TOPHAT_STREAMER_API_KEY": cfg.api_key} if cfg.api_key else {}),
        }, f"{cfg.streamer_url}/readyz")

    def _plan_edge_pipeline(self) -> dict[str, str]:
        """Plan (or load) the edge pipeline, point the device agent at stage 0's share and return the
        verifier's stage settings (tophatctl/edge_pipeline.py)."""
        from tophatctl.edge_pipeline import edge_plan, stage_wiring

        cfg = self.config
        if cfg.num_devices != 1 or cfg.verifiers != 1:
            raise MeshStartError("an edge pipeline serves from one device agent (its first stage) and one verifier")
        try:
            plan = edge_plan(self.model_dir, cfg.edge_pipeline, cfg.lan, cfg.edge_plan_kind, cfg.split_layers,
                             cfg.edge_plan or None)
            wiring = stage_wiring(plan.stage_layers, [d.slowdown for d in plan.devices], plan.draft_layers, plan.lan)
        except ValueError as exc:
            raise MeshStartError(f"edge pipeline {cfg.edge_pipeline!r}: {exc}") from exc
        self.edge_plan = plan
        plan_path = plan.save(cfg.log_dir / "edge-plan.json")
        log.info("edge pipeline %s: layers %s (%s plan), verifier stages %s, hops %s", cfg.edge_pipeline,
                 list(plan.stage_layers), plan.kind, wiring.stage_layers, wiring.hop_links)
        cfg.pipeline_stages = len(wiring.stage_layers)
        cfg.speed = f"{plan.devices[0].slowdown:g}"
        cfg.link = "none"  # the agent and the verifier's main both live on device 0
        cfg.device_env = {**cfg.device_env, "edge_plan": str(plan_path)}
        return wiring.verifier_env()

    def _use_netns(self) -> bool:
        from tophatctl.netns import netns_support

        if self.config.link_mode == "inprocess":
            return False
        wants_shaping = any(self.config.per_device(self.config.link, i) != "none" for i in range(self.config.num_devices))
        support = netns_support()
        if self.config.link_mode == "netns" and not support.available:
            raise MeshStartError(f"--link-mode netns, but namespaces are unavailable: {support.reason}")
        return wants_shaping and support.available

    def _device_env(self, i: int, model_dir: str) -> dict[str, str]:
        """Device agent i's settings, but for where it listens and how it reaches the cloud side."""
        cfg = self.config
        return {
            "TOPHAT_DEVICE_MODEL_DIR": model_dir,
            "TOPHAT_DEVICE_SPLIT_LAYERS": str(cfg.split_layers),
            "TOPHAT_DEVICE_ADAPTER": cfg.adapter,
            "TOPHAT_DEVICE_SPECULATIVE": str(cfg.speculative).lower(),
            "TOPHAT_DEVICE_MAX_DRAFT": str(cfg.max_draft),
            "TOPHAT_DEVICE_ETA": str(cfg.eta),
            "TOPHAT_DEVICE_LINK": cfg.per_device(cfg.link, i),
            "TOPHAT_DEVICE_SPEED": cfg.per_device(cfg.speed, i),
            **({"TOPHAT_DEVICE_HIDDEN_ROTATION": cfg.hidden_rotation} if cfg.hidden_rotation else {}),
            **{f"TOPHAT_DEVICE_{k.upper()}": v for k, v in cfg.device_env.items()},
        }

    def _cloud_urls_env(self, host: str) -> dict[str, str]:
        cfg = self.config
        return {
            "TOPHAT_DEVICE_VERIFIER_URL": cfg.device_verifier_url or cfg.verifier_urls(host),
            "TOPHAT_DEVICE_CHUNK_PLANNER_URL": f"{cfg.http_scheme}://{host}:{cfg.port_base + 10}",
            "TOPHAT_DEVICE_STATE_MONITOR_URL": f"{cfg.http_scheme}://{host}:{cfg.port_base + 20}",
        }

    def _spawn_announcing_device(self, i: int, model_dir: str) -> ServiceProcess:
        env = {**self._device_env(i, model_dir), **self._cloud_urls_env(self.config.host),
               "TOPHAT_DEVICE_DEVICE_ID": "auto", "TOPHAT_DEVICE_PORT": "0", "TOPHAT_DEVICE_ANNOUNCE_INTERVAL_S": "0.5"}
        return self._spawn(f"device-agent-{i}", "services.device_agent", env, "")

    def _wait_announced(self, devices: list[ServiceProcess]) -> None:
        """Discovery mode: ready when the state monitor lists every device agent."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        with httpx.Client(timeout=2.0, verify=self.client_verify()) as client:
            while True:
                for service in devices:
                    if service.process.poll() is not None:
                        raise MeshStartError(f"{service.name} exited with {service.process.returncode}:\n"
                                             f"{service.log_tail()}")
                try:
                    listed = client.get(f"{self.config.monitor_url}/devices").json()["devices"]
                except (httpx.HTTPError, ValueError, KeyError):
                    listed = []
                if len(listed) >= len(devices):
                    self.discovered_urls = [d["url"] for d in listed]
                    return
                if time.monotonic() > deadline:
                    raise MeshStartError(f"{len(listed)} of {len(devices)} device agents announced after "
                                         f"{self.config.ready_timeout_s}s\n{devices[0].log_tail()}")
                time.sleep(0.2)

    def _spawn_device(self, i: int, model_dir: str) -> ServiceProcess:
        from shared.links import parse_link_spec, scaled_for_hidden
        from shared.model.checkpoint import read_config
        from tophatctl.netns import NetnsLink

        cfg = self.config
        link_spec = cfg.per_device(cfg.link, i)
        host = cfg.host
        env = {**self._device_env(i, model_dir), "TOPHAT_DEVICE_DEVICE_ID": f"device-{i}",
               "TOPHAT_DEVICE_PORT": str(cfg.port_base + 200 + i)}
        prefix = None
        if self._netns and link_spec != "none":
            hidden = read_config(Path(model_dir))["hidden_size"]
            profile = scaled_for_hidden(parse_link_spec(link_spec), hidden)
            link = NetnsLink.for_index(i, profile).setup()
            self.netns_links.append(link)
            remainder = link.in_process_remainder()
            env["TOPHAT_DEVICE_LINK"] = (f"lat={remainder.latency_s * 1e3}ms,jitter={remainder.jitter_s * 1e3}ms"
                                         if remainder.shaped else "none")
            env["TOPHAT_DEVICE_LINK_SCALED"] = "false"
            env["TOPHAT_DEVICE_HOST"] = "0.0.0.0"
            host = link.host_ip  # the root namespace's end of the veth
            cfg.device_hosts[i] = link.ns_ip
            prefix = link.exec_prefix()
        env.update(self._cloud_urls_env(host))
        return self._spawn(f"device-agent-{i}", "services.device_agent", env, f"{cfg.device_url(i)}/readyz", prefix)

    def start(self) -> "Mesh":
        cfg = self.config
        if not 1 <= cfg.verifiers <= 99:
            raise MeshStartError(f"verifiers must be 1..99 (ports base+100 .. base+199), got {cfg.verifiers}")
        try:
            self.model_dir = mesh_model_dir(cfg)
            model_dir = str(self.model_dir)
            self.redis_url = cfg.redis_url
            if self.redis_url is None:
                self.redis = EmbeddedRedis().start()
                self.redis_url = self.redis.url
            self._netns = self._use_netns()
            if cfg.tls:
                self._make_certs()
            edge_env = self._plan_edge_pipeline() if cfg.edge_pipeline else {}
            if cfg.edge_draft_server:
                edge_env = {**edge_env, "TOPHAT_VERIFIER_FULL_MODEL": "true"}
                cfg.device_env = {"edge_draft_server": "true", "mode": "edge-sd", "max_sessions": "64",
                                  **cfg.device_env}
            # Devices in namespaces reach the cloud-side services through the veth, so those bind everywhere.
            bind = "0.0.0.0" if self._netns else cfg.host
            monitor = self._spawn("state-monitor", "services.state_monitor", {
                "TOPHAT_STATE_MONITOR_PORT": str(cfg.port_base + 20),
                "TOPHAT_STATE_MONITOR_HOST": bind,
                "TOPHAT_STATE_MONITOR_REDIS_URL": self.redis_url,
            }, f"{cfg.monitor_url}/readyz")
            planner = self._spawn("chunk-planner", "services.chunk_planner", {
                "TOPHAT_CHUNK_PLANNER_PORT": str(cfg.port_base + 10),
                "TOPHAT_CHUNK_PLANNER_HOST": bind,
                "TOPHAT_CHUNK_PLANNER_PIPELINE_STAGES": str(cfg.pipeline_stages),
                "TOPHAT_CHUNK_PLANNER_STATE_MONITOR_URL": cfg.monitor_url,
            }, f"{cfg.planner_url}/readyz")
            verifiers = [self._spawn("verifier-cloud" if j == 0 else f"verifier-cloud-{j}", "services.verifier_cloud", {
                "TOPHAT_VERIFIER_PORT": str(cfg.verifier_port + j),
                "TOPHAT_VERIFIER_HOST": bind,
                "TOPHAT_VERIFIER_PIPELINE_STAGES": str(cfg.pipeline_stages),
                "TOPHAT_VERIFIER_MODEL_DIR": model_dir,
                "TOPHAT_VERIFIER_SPLIT_LAYERS": str(cfg.split_layers),
                "TOPHAT_VERIFIER_STATE_MONITOR_URL": cfg.monitor_url,
                **({"TOPHAT_VERIFIER_HIDDEN_ROTATION": cfg.hidden_rotation} if cfg.hidden_rotation else {}),
                **edge_env,
            }, f"{cfg.http_scheme}://{cfg.host}:{cfg.verifier_port + j}/readyz") for j in range(cfg.verifiers)]
            if cfg.discover_devices:
                self._wait_ready([monitor, planner, *verifiers])
                devices = [self._spawn_announcing_device(i, model_dir) for i in range(cfg.num_devices)]
                self._wait_announced(devices)
                streamer = self._spawn_streamer("")
            else:
                # Agents and the streamer load while the cloud side does: an agent is ready once its verifier
                # accepts it (its readiness loop retries each second), and the streamer's /readyz, asked once
                # more after every agent is ready, probes them all again, so it starts with all of them up.
                devices = [self._spawn_device(i, model_dir) for i in range(cfg.num_devices)]
                streamer = self._spawn_streamer(",".join(cfg.device_url(i) for i in range(cfg.num_devices)))
                self._wait_ready([monitor, planner, *verifiers])
                self._wait_ready(devices)
            self._wait_ready([streamer])
            if cfg.supervise:
                from tophatctl.supervisor import Supervisor

                self.supervisor = Supervisor(self, cfg.state_file).start()
            elif cfg.state_file is not None:
                from tophatctl.supervisor import write_state_file

                write_state_file(cfg.state_file, self.process_table())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.supervisor is not None:  # first: a process stopped below must not be restarted
            self.supervisor.stop()
            self.supervisor = None
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.terminate()
        deadline = time.monotonic() + timeout_s
        for service in reversed(self.services):
            try:
                service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", service.name)
                service.process.kill()
                service.process.wait(timeout=5)
        self.services.clear()
        for link in self.netns_links:
            link.teardown()
        self.netns_links.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def urls(self) -> dict[str, str]:
        cfg = self.config
        urls = {
            "token-streamer": cfg.streamer_url,
            "chunk-planner": cfg.planner_url,
            "state-monitor": cfg.monitor_url,
            **{"verifier-cloud" if j == 0 else f"verifier-cloud-{j}": url
               for j, url in enumerate(cfg.verifier_urls().split(","))},
            "redis": redact_url(self.redis_url) if self.redis_url else "",  # printed: never the password
        }
        urls.update({f"device-agent-{i}": cfg.device_url(i) for i in range(cfg.num_devices)})
        return urls

    def __enter__(self) -> "Mesh":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
