"""`tophat`: the command line. The typer app, the commands that only run a model here (`generate`,
`chat`), and every other command mounted from the module that holds it (model_commands and
mesh_commands here, the `bench` subcommands from bench_app; `loadgen`, `simulate`, `profile`, `plan` and
`privacy` from the library packages). Commands import what they run inside their body, so `tophat --help` stays fast."""

from __future__ import annotations

import argparse
import asyncio
import json
from enum import Enum
from typing import Optional

import typer

from loadgen.cli import loadgen_command
from loadgen.simulate.cli import simulate_command
from tophat.bench_app import bench_app
from tophat.command_support import MODEL_HELP, SPLIT_LAYERS_HELP, fail, setup_torch, user_errors
from tophat.mesh_commands import certs, mesh_secrets, serve, stage
from tophat.model_commands import (
    adapter_sweep_cmd,
    build_demo_model_cmd,
    evaluate_adapter_cmd,
    import_gguf_cmd,
    train_adapter_cmd,
)
from tophatctl.credentials_command import app as credentials_app
from tophatctl.privacy.command import privacy_command
from tophatctl.profile import plan_command, profile_command

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tophat: device-cloud collaborative LLM inference.")
DISTRIBUTION = "tophat"  # pyproject.toml's [project] name


def show_version(value: bool) -> None:
    """--version: the installed distribution's version, then exit."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        typer.echo(f"tophat {version(DISTRIBUTION)}")
    except PackageNotFoundError:
        fail(f"the {DISTRIBUTION} distribution is not installed (make install), so it has no version")
    raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=show_version, help="print the version and exit"
    ),
) -> None:
    pass


class LocalDecoding(str, Enum):
    """How `tophat generate` decodes in this one process (not a mesh mode: those are shared/modes.py's table)."""

    full = "full"  # the unsplit model, one token per pass
    ushape = "ushape"  # split, one token per cloud pass
    hat = "hat"  # split + speculative decoding with the draft adapter


def parse_ids(text: str | None) -> list[int] | None:
    """--prompt-ids as token ids (a usage error for anything but comma-separated integers)."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"--prompt-ids must be comma-separated integers, got {text!r}")


def generate(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, help="prompt text"),
    prompt_ids: Optional[str] = typer.Option(None, help="comma-separated token ids"),
    max_new_tokens: int = typer.Option(64),
    mode: LocalDecoding = typer.Option(LocalDecoding.hat),
    split_layers: int = typer.Option(2, "--split-layers", help=SPLIT_LAYERS_HELP),
    eta: float = typer.Option(0.6, help="drafting threshold (HAT eq. 5)"),
    max_draft: int = typer.Option(8, help="max draft tokens per round"),
    adapter: Optional[str] = typer.Option(
        None, help="adapter file, or 'random'; default MODEL/draft_adapter.safetensors"
    ),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    chunk_size: Optional[int] = typer.Option(None, help="prefill chunk size (default: whole prompt)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    threads: Optional[int] = typer.Option(None, help="torch threads"),
):
    """Generate text with the full model, the U-shaped split, or HAT."""
    from shared.model.checkpoint import load_checkpoint
    from shared.model.split import MiddleSubmodel
    from shared.runtime import build_device_model, decode_tokens, encode_prompt
    from shared.specdec.decode_loop import LocalCloud
    from shared.specdec.decode_loop import generate as run_generate
    from shared.specdec.device_session import DeviceSession, DraftConfig
    from shared.specdec.reference import generate_full
    from shared.specdec.sampling import SamplingParams
    from tophatctl.models import resolve_model_or_exit

    setup_torch(threads)
    try:
        checkpoint = load_checkpoint(resolve_model_or_exit(model))
        ids = encode_prompt(checkpoint, prompt, parse_ids(prompt_ids))
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        if mode is LocalDecoding.full:
            result = generate_full(checkpoint, ids, max_new_tokens, params)
        else:
            device = build_device_model(checkpoint, split_layers, adapter, speculative=mode is LocalDecoding.hat)
            session = DeviceSession(device, ids, params, DraftConfig(eta=eta, max_draft=max_draft), max_new_tokens)
            cloud = LocalCloud(MiddleSubmodel(checkpoint, split_layers))
            result = asyncio.run(run_generate(session, cloud, chunk_size=chunk_size))
    except user_errors() as exc:
        fail(str(exc))
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


def chat(
    url: str = typer.Option("http://127.0.0.1:8000", help="token-streamer base URL"),
    prompt: Optional[str] = typer.Option(None, help="one-shot prompt (default: interactive)"),
    max_new_tokens: int = typer.Option(64, help="tokens to generate per answer"),
    temperature: float = typer.Option(0.0),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="OPENAI_API_KEY",
        show_envvar=True,
        help="sent as Authorization: Bearer (the key `tophat serve --api-key` set)",
    ),
):
    """Chat with the mesh, streaming tokens; prints TTFT, TBT and accept length after each answer."""
    from tophatctl.chat_client import run_chat

    raise typer.Exit(asyncio.run(run_chat(url, prompt, max_new_tokens, temperature, api_key=api_key)))


def demo(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    adapter: str = typer.Option(
        "", help="draft adapter file or 'random' (default: the model's draft_adapter.safetensors)"
    ),
    devices: int = typer.Option(2, help="device agents"),
    max_new_tokens: int = typer.Option(96, help="tokens to generate per answer"),
    dtype: str = typer.Option(
        "auto",
        help="weights in the verifier and the devices: auto (the default of `tophat serve`: int4 on a CPU) | int4 | "
        "int8 | bf16 | f32",
    ),
):
    """Start the mesh, stream its answers to a few prompts through the chat client, stop."""
    args = argparse.Namespace(**locals())
    from tophatctl.demo import main as run_demo

    raise typer.Exit(run_demo(args))


# Registered in one place, in the order `tophat --help` lists them.
app.command("build-demo-model")(build_demo_model_cmd)
app.command("import-gguf")(import_gguf_cmd)
app.command("train-adapter")(train_adapter_cmd)
app.command("evaluate-adapter")(evaluate_adapter_cmd)
app.command("adapter-sweep")(adapter_sweep_cmd)
app.command()(generate)
app.command()(serve)
app.command("up", hidden=True)(serve)  # serve's former name, kept for scripts
app.command()(certs)
app.command("mesh-secrets")(mesh_secrets)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})(stage)
app.add_typer(credentials_app, name="credentials")
app.command()(chat)
app.command()(demo)
app.add_typer(bench_app, name="bench")
app.command("loadgen", help="Poisson load generator against the token-streamer (results.json, requests.csv, plots).")(
    loadgen_command
)
app.command("simulate", help="Discrete-event simulation of the serving modes at HAT scale (30 devices).")(
    simulate_command
)
app.command("profile", help="Profile per-layer time t(S, c) and memory for Jupiter's planner.")(profile_command)
app.command("plan", help="Plan an edge pipeline (Jupiter): DP layer partition + sub-sequence table.")(plan_command)
app.command(
    "privacy",
    help="What the cloud can recover from the hidden states it is sent, per split depth, "
    "attack and defence (tophatctl/privacy/).",
)(privacy_command)


if __name__ == "__main__":
    app()
