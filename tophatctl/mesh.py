"""Start the whole mesh as separate processes on localhost, and stop it cleanly.

Used by `tophat serve`, `make demo`, the benchmarks and the end-to-end tests. Ports are laid out from one
base (tophatctl/mesh_ports.py); what runs is a MeshConfig (tophatctl/mesh_config.py); the processes
share one secret and, with TLS, one CA (tophatctl/mesh_credentials.py), each only its own service's credentials
(tophatctl/process_env.py); start() waits until each is ready (tophatctl/mesh_readiness.py); with `supervise` a
Supervisor (tophatctl/supervisor.py) restarts what dies. Every service is tethered to the launcher
(shared/processes/lifeline.py): a launcher killed with SIGKILL takes its services with it, ports freed; and a port
of the layout already in use is refused before anything starts, naming the port and its holder.
"""

from __future__ import annotations

import logging
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

from shared.auth import verify as auth
from shared.jupiter.plan import EdgePlan
from shared.net.links import parse_link_spec, scaled_for_hidden
from shared.processes.lifeline import Tether
from shared.processes.redis_server import EmbeddedRedis
from shared.telemetry.sink import redact_url
from tophatctl import mesh_settings
from tophatctl.certs import DevCerts
from tophatctl.edge_pipeline import configure_mesh
from tophatctl.mesh_config import WILDCARD_HOSTS, MeshConfig, MeshStartError, mesh_model_dir
from tophatctl.mesh_credentials import MeshCredentials, OperatorAuth
from tophatctl.mesh_ports import layout, taken_ports
from tophatctl.mesh_readiness import wait_announced, wait_ready
from tophatctl.netns import NetnsLink, netns_support, subnet_for_index
from tophatctl.process_env import process_env
from tophatctl.service_process import ServiceProcess, start_process, tethered_command
from tophatctl.supervisor import Supervisor, write_state_file

log = logging.getLogger(__name__)


class Mesh:
    def __init__(self, config: MeshConfig):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url: str | None = None
        self.services: list[ServiceProcess] = []
        self.model_dir: Path | None = None  # the resolved checkpoint directory, once started
        self.edge_plan: EdgePlan | None = None  # with config.edge_pipeline, once planned
        self.netns_links: list[NetnsLink] = []
        self.discovered_urls: list[str] = []  # discover_devices: the agents' announced URLs
        self.supervisor: Supervisor | None = None  # while supervising
        self.tether: Tether | None = None  # while running: the services stop when it closes or this process dies
        self.credentials = MeshCredentials(config.auth)
        self._netns = False  # devices in network namespaces (decided at start)
        if config.log_dir is None:
            config.log_dir = Path(tempfile.mkdtemp(prefix="tophat-mesh-"))
        self.log_dir: Path = config.log_dir  # the config's, set from here on
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # -- the mesh's credentials (tophatctl/mesh_credentials.py) ---------------------------
    @property
    def auth_env(self) -> dict[str, str]:
        return self.credentials.auth_env

    @property
    def tls_env(self) -> dict[str, str]:
        return self.credentials.tls_env

    @property
    def certs(self) -> DevCerts | None:
        """The mesh's CA and server certificate with config.tls, once started; None otherwise."""
        return self.credentials.certs

    def client_verify(self) -> ssl.SSLContext | bool:
        """httpx's `verify` for this mesh (trusting its CA with TLS)."""
        return self.credentials.client_verify()

    def operator_auth(
        self, role: str = "service", subject: str = "tophat-operator", audience: str = ""
    ) -> OperatorAuth | None:
        """httpx `auth` for calling the mesh's internal endpoints directly; None when it runs open."""
        return self.credentials.operator_auth(role, subject, audience)

    def _make_keys(self) -> None:
        cfg = self.config
        audiences = {
            cfg.monitor_url: auth.ISSUER,
            cfg.planner_url: auth.PLANNER,
            **{url: auth.VERIFIER for url in cfg.verifier_urls().split(",")},
            **{cfg.device_url(i): auth.device_audience(f"device-{i}") for i in range(cfg.num_devices)},
        }
        self.credentials.make_keys(self.log_dir, cfg.monitor_url, audiences)

    def _make_certs(self) -> None:
        # With namespaces, devices are reached (and reach the cloud side) at their veth ends' addresses too.
        veth_ends = [ip for i in range(self.config.num_devices) for ip in subnet_for_index(i)] if self._netns else []
        # Bound to every interface, it is reached by this machine's name too.
        own_name = [socket.gethostname()] if self.config.bind_host in WILDCARD_HOSTS else []
        self.credentials.make_certs(self.log_dir / "tls", self.config.host, [*veth_ends, *own_name])

    # -- processes --------------------------------------------------------------------
    def _spawn(
        self, name: str, module: str, env: dict[str, str], ready_url: str, prefix: list[str] | None = None
    ) -> ServiceProcess:
        log_path = self.log_dir / f"{name}.log"
        assert self.tether is not None, "services are spawned by start()"
        full_env = process_env(
            module,
            env,
            tls_env=self.tls_env,
            extra_env=self.config.extra_env,
            tether_env=self.tether.child_env(),
            auth_env=self.auth_env,
        )
        command = tethered_command(module, prefix)
        service = ServiceProcess(
            name, start_process(command, full_env, log_path), ready_url, log_path, command, full_env
        )
        self.services.append(service)
        return service

    def process_table(self) -> list[dict]:
        """Every process of the mesh: role, name, pid and URL (Redis's redacted), for the state file."""
        urls = self.urls()
        table = [
            {"role": s.role, "name": s.name, "pid": s.process.pid, "url": urls.get(s.name, "")} for s in self.services
        ]
        if self.redis is not None and self.redis.pid is not None:
            table.append({"role": "redis", "name": "redis", "pid": self.redis.pid, "url": urls["redis"]})
        return table

    def _check_ports_free(self) -> None:
        """Refuse to start onto a port something else holds: its half of the mesh would be served by a stranger
        (a mesh left running answers the new one's requests with its own, unreachable devices)."""
        cfg = self.config
        ports = layout(cfg.port_base, 0 if cfg.discover_devices else cfg.num_devices, cfg.verifiers)
        host = "0.0.0.0" if self._netns else cfg.bind  # the cloud side binds everywhere with namespaces
        taken = taken_ports(host, ports)
        if taken:
            held = "; ".join(f"port {port} is held by {holder}" for port, holder in taken.items())
            raise MeshStartError(
                f"cannot start the mesh on {host}: {held}. Stop what holds it or choose another "
                f"--port-base (this mesh needs ports {', '.join(map(str, ports))})"
            )

    # -- the services ---------------------------------------------------------------------
    def _spawn_cloud_side(self, model_dir: str, edge_env: dict[str, str]) -> list[ServiceProcess]:
        """The state monitor, the chunk planner and every verifier replica."""
        cfg = self.config
        assert self.redis_url is not None, "start() has redis before the services"
        # Devices in namespaces reach the cloud-side services through the veth, so those bind everywhere.
        bind = "0.0.0.0" if self._netns else cfg.bind
        monitor = self._spawn(
            "state-monitor",
            "services.state_monitor",
            mesh_settings.state_monitor_env(cfg, bind, self.redis_url),
            f"{cfg.monitor_url}/readyz",
        )
        planner = self._spawn(
            "chunk-planner",
            "services.chunk_planner",
            mesh_settings.chunk_planner_env(cfg, bind),
            f"{cfg.planner_url}/readyz",
        )
        verifiers = [
            self._spawn(
                cfg.verifier_name(j),
                "services.verifier_cloud",
                mesh_settings.verifier_env(cfg, j, bind, model_dir, edge_env),
                f"{cfg.http_scheme}://{cfg.host}:{cfg.verifier_port + j}/readyz",
            )
            for j in range(cfg.verifiers)
        ]
        return [monitor, planner, *verifiers]

    def _spawn_streamer(self, device_urls: str) -> ServiceProcess:
        assert self.model_dir is not None, "start() resolves the model before the services"
        return self._spawn(
            "token-streamer",
            "services.token_streamer",
            mesh_settings.streamer_env(self.config, device_urls, self.model_dir.name),
            f"{self.config.streamer_url}/readyz",
        )

    def _use_netns(self) -> bool:
        cfg = self.config
        if cfg.link_mode == "inprocess":
            return False
        wants_shaping = any(cfg.per_device(cfg.link, i) != "none" for i in range(cfg.num_devices))
        support = netns_support()
        if cfg.link_mode == "netns" and not support.available:
            raise MeshStartError(f"--link-mode netns, but namespaces are unavailable: {support.reason}")
        return wants_shaping and support.available

    def _device_env(self, i: int, model_dir: str) -> dict[str, str]:
        """Device agent i's settings, but for where it listens and how it reaches the cloud side."""
        return mesh_settings.device_env(self.config, i, model_dir)

    def _spawn_announcing_device(self, i: int, model_dir: str) -> ServiceProcess:
        env = mesh_settings.announcing_device_env(self.config, i, model_dir)
        if self.credentials.auth_on:  # a bootstrap token names one id: the device's, not a host name's "auto"
            env["TOPHAT_DEVICE_DEVICE_ID"] = f"device-{i}"
            env.update(self.credentials.device_env(env["TOPHAT_DEVICE_STATE_MONITOR_URL"], f"device-{i}"))
        return self._spawn(f"device-agent-{i}", "services.device_agent", env, "")

    def _spawn_device(self, i: int, model_dir: str) -> ServiceProcess:
        from shared.model.checkpoint import read_config  # imports torch: only when a mesh starts a device

        cfg = self.config
        link_spec = cfg.per_device(cfg.link, i)
        host = cfg.host
        env = {
            **mesh_settings.device_env(cfg, i, model_dir),
            "TOPHAT_DEVICE_DEVICE_ID": f"device-{i}",
            "TOPHAT_DEVICE_PORT": str(cfg.device_port(i)),
        }
        prefix = None
        if self._netns and link_spec != "none":
            hidden = read_config(Path(model_dir))["hidden_size"]
            profile = scaled_for_hidden(parse_link_spec(link_spec), hidden)
            link = NetnsLink.for_index(i, profile).setup()
            self.netns_links.append(link)
            remainder = link.in_process_remainder()
            env["TOPHAT_DEVICE_LINK"] = (
                f"lat={remainder.latency_s * 1e3}ms,jitter={remainder.jitter_s * 1e3}ms" if remainder.shaped else "none"
            )
            env["TOPHAT_DEVICE_LINK_SCALED"] = "false"
            env["TOPHAT_DEVICE_HOST"] = "0.0.0.0"
            host = link.host_ip  # the root namespace's end of the veth
            cfg.device_hosts[i] = link.ns_ip
            prefix = link.exec_prefix()
        env.update(mesh_settings.cloud_urls_env(cfg, host))
        # Its own bootstrap token, and the URL it enrolls with: the one the streamer is given for it.
        env.update(self.credentials.device_env(env["TOPHAT_DEVICE_STATE_MONITOR_URL"], f"device-{i}"))
        env["TOPHAT_DEVICE_ADVERTISE_URL"] = cfg.device_url(i)
        return self._spawn(f"device-agent-{i}", "services.device_agent", env, f"{cfg.device_url(i)}/readyz", prefix)

    # -- lifecycle ---------------------------------------------------------------------
    def _edge_env(self) -> dict[str, str]:
        """The verifier's extra settings for an edge pipeline or an edge draft server (empty for neither)."""
        cfg = self.config
        edge_env = {}
        if cfg.edge_pipeline:
            assert self.model_dir is not None, "start() resolves the model before the plan"
            self.edge_plan, edge_env = configure_mesh(cfg, self.model_dir)
        if cfg.edge_draft_server:
            edge_env = {**edge_env, "TOPHAT_VERIFIER_FULL_MODEL": "true"}
            cfg.device_env = {"edge_draft_server": "true", "mode": "edge-sd", "max_sessions": "64", **cfg.device_env}
        return edge_env

    def start(self) -> Mesh:
        cfg = self.config
        cfg.check()  # again: callers change a config's fields after making it
        self._netns = self._use_netns()
        self._check_ports_free()  # before anything starts: nothing to stop when it fails
        self.tether = Tether()
        try:
            self.model_dir = mesh_model_dir(cfg)
            model_dir = str(self.model_dir)
            self.redis_url = cfg.redis_url
            if self.redis_url is None:
                self.redis = EmbeddedRedis().start()
                self.redis_url = self.redis.url
            if cfg.tls:
                self._make_certs()
            self._make_keys()
            cloud_side = self._spawn_cloud_side(model_dir, self._edge_env())
            if cfg.discover_devices:
                wait_ready(cloud_side, cfg.ready_timeout_s, self.client_verify())
                devices = [self._spawn_announcing_device(i, model_dir) for i in range(cfg.num_devices)]
                self.discovered_urls = wait_announced(
                    devices, cfg.monitor_url, cfg.ready_timeout_s, self.client_verify()
                )
                streamer = self._spawn_streamer("")
            else:
                # Agents and the streamer load while the cloud side does: an agent is ready once its verifier
                # accepts it (its readiness loop retries each second), and the streamer's /readyz, asked once
                # more after every agent is ready, probes them all again, so it starts with all of them up.
                devices = [self._spawn_device(i, model_dir) for i in range(cfg.num_devices)]
                streamer = self._spawn_streamer(",".join(cfg.device_url(i) for i in range(cfg.num_devices)))
                wait_ready(cloud_side, cfg.ready_timeout_s, self.client_verify())
                wait_ready(devices, cfg.ready_timeout_s, self.client_verify())
            wait_ready([streamer], cfg.ready_timeout_s, self.client_verify())
            if cfg.supervise:
                self.supervisor = Supervisor(self, cfg.state_file).start()
            elif cfg.state_file is not None:
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
        if self.tether is not None:  # nothing left to release; a process killed above is released anyway
            self.tether.close()
            self.tether = None
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
            **{cfg.verifier_name(j): url for j, url in enumerate(cfg.verifier_urls().split(","))},
            "redis": redact_url(self.redis_url) if self.redis_url else "",  # printed: never the password
        }
        urls.update({f"device-agent-{i}": cfg.device_url(i) for i in range(cfg.num_devices)})
        return urls

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
