"""`tophat serve | certs | mesh-secrets`: running the mesh on this machine (tophatctl/mesh.py) and
making what a deployment needs to run it securely (tophatctl/certs.py, tophatctl/mesh_secrets.py).
The library is imported inside each command, so `tophat --help` does not load it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from tophat.command_support import MODEL_HELP, SPLIT_LAYERS_HELP, fail
from tophat.config_file import config_option


def serve(
    config_file: Optional[Path] = config_option(),
    devices: int = typer.Option(
        1, "--devices", envvar="TOPHAT_DEVICES", show_envvar=True, help="number of device agents"
    ),
    verifiers: int = typer.Option(
        1, "--verifiers", help="verifier replicas; a session whose verifier dies is replayed on another"
    ),
    model: str = typer.Option("smollm2", envvar="TOPHAT_MODEL", show_envvar=True, help=MODEL_HELP),
    redis_url: Optional[str] = typer.Option(None, help="external Redis (default: embedded redis-server)"),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        envvar="TOPHAT_HOST",
        show_envvar=True,
        help="address every service binds: loopback only by default; 0.0.0.0 (or ::) exposes "
        "the mesh on every interface (keep --auth, add --api-key and --tls)",
    ),
    port_base: int = typer.Option(
        8000,
        "--port",
        "--port-base",
        envvar="TOPHAT_PORT",
        show_envvar=True,
        help="token-streamer port; the others are laid out from it",
    ),
    split_layers: int = typer.Option(2, "--split-layers", help=SPLIT_LAYERS_HELP),
    no_speculation: bool = typer.Option(False, "--no-speculation", help="plain U-shape (no draft adapter)"),
    adapter: str = typer.Option("", help="adapter file or 'random' (default: MODEL/draft_adapter.safetensors)"),
    link: str = typer.Option(
        "none",
        help="link profile per device: near|mid|far|none or 'up=5MB,down=10MB,lat=5ms'; "
        "';'-separated to vary by device",
    ),
    link_mode: str = typer.Option("auto", help="auto | netns (tc-shaped veth, root) | inprocess"),
    speed: str = typer.Option("orin", help="device speed per device: orin|xavier|cycle|'1,2,5,10@5'; ';'-separated"),
    pipeline_stages: int = typer.Option(1, help="P: verifier pipeline stages (worker processes)"),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        envvar="TOPHAT_DTYPE",
        show_envvar=True,
        help="weights in the verifier and the devices: "
        "auto (int4 on a CPU, $TOPHAT_CPU_DTYPE names another; bf16 on CUDA) | "
        "f32 | bf16 | int8 | int4 (int8/int4: the CPU's fast decode, make bench-engine)",
    ),
    prompt_chunking: bool = typer.Option(True, "--prompt-chunking/--no-prompt-chunking", help="PC switch"),
    parallel_drafting: bool = typer.Option(True, "--parallel-drafting/--no-parallel-drafting", help="PD switch"),
    state_file: Optional[Path] = typer.Option(
        None,
        "--state-file",
        help="keep a JSON list of every process (role, pid, url) here, rewritten after each restart",
    ),
    api_key: str = typer.Option(
        "",
        "--api-key",
        envvar="TOPHAT_STREAMER_API_KEY",
        show_envvar=True,
        show_default=False,
        help="require Authorization: Bearer KEY on the OpenAI endpoint (comma-separated keys)",
    ),
    auth: bool = typer.Option(
        True,
        "--auth/--no-auth",
        help="authenticate every internal hop with signed tokens: a "
        "fresh signing key for the state monitor (the issuer), service credentials, a "
        "bootstrap token per device (TOPHAT_*_AUTH_*)",
    ),
    tls: bool = typer.Option(
        False,
        "--tls",
        help="TLS on every hop (https, wss) with a development CA made in the log directory (see tophat certs)",
    ),
    edge_pipeline: str = typer.Option(
        "",
        "--edge-pipeline",
        help="Jupiter: run the model over these edge devices "
        "as pipeline stages, e.g. 'orin;xavier;xavier' (speed classes, optional "
        "':512MiB' memory budgets); one device agent (stage 0) drafts",
    ),
    lan: str = typer.Option(
        "lan",
        "--lan",
        help="with --edge-pipeline: the link between neighbouring devices "
        "(a shared/net/links.py profile or spec; 'lan' = 100 Mbit/s)",
    ),
    edge_plan: str = typer.Option(
        "",
        "--edge-plan",
        help="with --edge-pipeline: a stored plan (tophat plan --out); "
        "default: planned at start from the model's stored profile (tophat profile)",
    ),
    edge_plan_kind: str = typer.Option(
        "jupiter", "--edge-plan-kind", help="jupiter (DP partition + DP sub-sequences) | equal | serial (the baselines)"
    ),
    edge_draft_server: bool = typer.Option(
        False,
        "--edge-draft-server",
        help="Edge SD: device agent 0 drafts for "
        "every user in planned, pipelined batches (mode edge-sd); the verifier "
        "holds the whole target (TOPHAT_DEVICE_EDGE_* tune it)",
    ),
):
    """Start the whole mesh on this machine (listening on loopback unless --host); a process that dies is
    restarted (with backoff); Ctrl-C (or SIGTERM) stops every process. `tophat up` is the same command (its
    former name). Every option can come from --config FILE; the main ones from TOPHAT_* variables too."""
    import signal
    import threading

    # looked up at call time (tests replace tophatctl.mesh.Mesh)
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig, MeshStartError, serve_hosts
    from tophatctl.models import resolve_model_or_exit

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:  # a config no mesh can run is refused by MeshConfig itself, also a MeshStartError
        hosts = serve_hosts(host)
        config = MeshConfig(
            host=hosts["host"],
            bind_host=hosts["bind_host"],
            model_dir=str(resolve_model_or_exit(model)),
            num_devices=devices,
            port_base=port_base,
            redis_url=redis_url,
            split_layers=split_layers,
            speculative=not no_speculation,
            adapter=adapter,
            link=link,
            link_mode=link_mode,
            speed=speed,
            pipeline_stages=pipeline_stages,
            dtype=dtype,
            device_env={
                "prompt_chunking": str(prompt_chunking).lower(),
                **({} if parallel_drafting else {"parallel_candidates": "0"}),
            },
            supervise=True,
            state_file=state_file,
            auth=auth,
            api_key=api_key,
            verifiers=verifiers,
            tls=tls,
            edge_pipeline=edge_pipeline,
            lan=lan,
            edge_plan=edge_plan,
            edge_plan_kind=edge_plan_kind,
            edge_draft_server=edge_draft_server,
        )
        mesh = Mesh(config)
        mesh.start()
    except MeshStartError as exc:
        fail(str(exc))
    try:
        for name, url in mesh.urls().items():
            typer.echo(f"{name:16s} {url}")
        typer.echo(f"{'web console':16s} {config.streamer_url}/")
        if config.bind_host:
            typer.echo(
                f"listening on {config.bind_host} (every interface): reach the token streamer at this "
                f"machine's address, port {config.port_base}"
            )
        key_hint = " --api-key KEY" if api_key else ""
        ca_hint = f"SSL_CERT_FILE={mesh.certs.ca_cert} " if mesh.certs is not None else ""  # httpx trusts it
        typer.echo(f"logs in {config.log_dir}; chat with: {ca_hint}tophat chat --url {config.streamer_url}{key_hint}")
        typer.echo("Ctrl-C to stop")
        while not stop.wait(0.5):  # a timed wait, so Ctrl-C is handled promptly
            pass  # the mesh's supervisor restarts what dies meanwhile (and logs it)
    finally:
        mesh.stop()
        typer.echo("mesh stopped")


def certs(
    out: Path = typer.Option(..., "--out", help="directory for ca.pem, ca-key.pem, server.pem, server-key.pem"),
    hosts: str = typer.Option(
        "127.0.0.1,localhost,::1",
        help="comma-separated names and addresses the "
        "server certificate is valid for (every host a service is reached by)",
    ),
    days: int = typer.Option(365, help="validity in days"),
):
    """Make a development CA and a server certificate it signs (keys 0600), for TOPHAT_*_TLS_CERT / _TLS_KEY
    (servers) and TOPHAT_*_TLS_CA (clients). Not for production: the CA's key is written beside them."""
    from tophatctl.certs import make_dev_certs, parse_hosts

    try:
        made = make_dev_certs(out, parse_hosts(hosts), days=days)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    for what, path in (("tls_ca", made.ca_cert), ("tls_cert", made.server_cert), ("tls_key", made.server_key)):
        typer.echo(f"{what:9s} {path}")


def mesh_secrets(
    out: Path = typer.Option(Path("build/secrets"), "--out", help="directory for tophat-mesh.env and redis.conf"),
    api_key: str = typer.Option("", "--api-key", help="also require this key on the OpenAI endpoint"),
    tls_hosts: str = typer.Option(
        "token-streamer,verifier-cloud,chunk-planner,state-monitor,localhost,127.0.0.1",
        "--tls-hosts",
        help="names the services' certificate is valid for; empty: no TLS",
    ),
    issuer_url: str = typer.Option(
        "",
        "--issuer-url",
        help="where services and devices reach the state monitor (the issuer); default http(s)://state-monitor:8020",
    ),
    device: list[str] = typer.Option(
        ["device-1", "device-2"],
        "--device",
        help="a device agent's id, one bootstrap token each (repeat it; Swarm and k8s: the nodes' host names)",
    ),
):
    """Fresh secrets for `docker compose up` (mounted as Compose secrets): the issuer's signing key (the state
    monitor's alone), the services' credentials, one bootstrap token per device id (their file alone), Redis's
    password, an optional API key, and a development CA + server certificate with the settings that turn
    TLS on; files 0600, owned by the images' user when run as root."""
    from tophatctl.certs import parse_hosts
    from tophatctl.mesh_secrets import make_mesh_secrets

    try:
        made = make_mesh_secrets(out, api_key, parse_hosts(tls_hosts) if tls_hosts else None, issuer_url, device)
    except ValueError as exc:
        fail(str(exc))
    for path in made:
        typer.echo(path)


def stage(ctx: typer.Context):
    """Serve one pipeline stage on its own (a layer range of the middle, listening on host:port) for a verifier
    whose TOPHAT_VERIFIER_STAGE_ADDRESSES names it. Flags and TOPHAT_STAGE_* settings as
    `python -m services.verifier_cloud.stage --help`."""
    from services.verifier_cloud.stage import main

    raise typer.Exit(main(ctx.args))
