"""`tophat loadgen`: drive the token streamer with an open-loop workload and write the results.

Mount with `app.command("loadgen")(loadgen_command)`. The run itself is loadgen/load_run.py; this
module parses the options and prints the summary. Heavy imports (transformers, matplotlib, redis)
happen inside the run, so mounting the command costs nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

import typer

from loadgen.load_run import run_load_test


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def loadgen_command(
    url: str = typer.Option("http://127.0.0.1:8000", help="token streamer base URL"),
    workload: str = typer.Option("specbench", help='specbench, cnndm, or a JSONL file of {"prompt", "max_tokens"?}'),
    rate: float = typer.Option(math.inf, help="mean request rate (req/s); inf sends everything at t=0"),
    burstiness: float = typer.Option(1.0, help="gamma shape of inter-arrival gaps (1 = Poisson, <1 burstier)"),
    num_requests: Optional[int] = typer.Option(None, "--num-requests", "-n", min=1, help="send this many requests"),
    duration: Optional[float] = typer.Option(None, help="or: send every arrival in [0, S) s (in-flight ones finish)"),
    max_new_tokens: int = typer.Option(128, min=1, help="max_tokens per request (HAT: 128)"),
    seed: int = typer.Option(0, help="seed for arrivals and prompts"),
    out: Path = typer.Option(..., help="output directory (results.json, requests.csv, *.png)"),
    tokenizer: str = typer.Option(
        "smollm2",
        help="the model whose tokenizer (and config.json) counts tokens: smollm2 | demo | a checkpoint directory",
    ),
    context_limit: Optional[int] = typer.Option(
        None, help="model context (default: config.json max_position_embeddings)"
    ),
    length_dist: str = typer.Option("gamma", help="prompt-length fit: gamma or lognormal"),
    max_concurrency: Optional[int] = typer.Option(
        None, min=1, help="cap on requests in flight (waiting counts in TTFT)"
    ),
    request_timeout: float = typer.Option(300.0, help="per-request timeout, send to end of stream (s)"),
    temperature: float = typer.Option(0.0, help="sampling temperature sent with every request"),
    model: Optional[str] = typer.Option(None, help="model name to send (default: the server's /v1/models id)"),
    num_devices: Optional[int] = typer.Option(
        None, min=1, help="devices for the round-robin device_hint (default: /readyz)"
    ),
    send_device_hint: bool = typer.Option(
        False, help="add device_hint to the request body (ignored by today's streamer)"
    ),
    extra_body: Optional[str] = typer.Option(None, help="JSON object merged into every request body"),
    slo_ttft_ms: Optional[float] = typer.Option(None, help="goodput SLO on TTFT (ms)"),
    slo_tpot_ms: Optional[float] = typer.Option(None, help="goodput SLO on TPOT (ms)"),
    slo_e2el_ms: Optional[float] = typer.Option(None, help="goodput SLO on end-to-end latency (ms)"),
    prefill_sla_ms: Optional[float] = typer.Option(None, help="HAT prefill SLA: TTFT per 128 prompt tokens (ms)"),
    decode_sla_ms: Optional[float] = typer.Option(None, help="HAT decode SLA: delay per 10 output tokens (ms)"),
    redis_url: Optional[str] = typer.Option(None, help="read tophat:verifier:steps for the cloud compute-delay plot"),
    state_monitor_url: Optional[str] = typer.Option(None, help="record the state monitor's cloud state after the run"),
    progress: bool = typer.Option(True, help="show a live progress bar"),
    api_key: Optional[str] = typer.Option(
        None,
        envvar="OPENAI_API_KEY",
        show_envvar=True,
        help="sent as Authorization: Bearer (the streamer's TOPHAT_STREAMER_API_KEY)",
    ),
) -> None:
    """Open-loop benchmark of the OpenAI API, like `vllm bench serve`, with HAT's metrics."""
    if (num_requests is None) == (duration is None):
        _fail("give exactly one of --num-requests or --duration")
    try:
        body_extra = json.loads(extra_body) if extra_body else {}
    except ValueError as exc:
        _fail(f"--extra-body is not JSON: {exc}")
    if not isinstance(body_extra, dict):
        _fail("--extra-body must be a JSON object")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("loadgen").setLevel(logging.INFO)
    options = dict(locals())  # every option by name, plus the parsed body_extra
    try:
        results = asyncio.run(run_load_test(options))
    except ValueError as exc:
        _fail(str(exc))
    _print_summary(results)
    typer.echo(f"results in {out}")


def _print_summary(res: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [
        ("Successful requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Benchmark duration (s)", res["duration"]),
        ("Request throughput (req/s)", res["request_throughput"]),
        ("Output token throughput (tok/s)", res["output_throughput"]),
        ("Mean accept length", res["mean_accept_length"]),
        ("Goodput (req/s)", res["goodput"]),
    ]
    for name in ("ttft", "tbt", "tpot", "e2el", "prefill_sla", "decode_sla", "server_queue_wait"):
        lines += [
            (f"{stat.upper() if stat.startswith('p') else stat.capitalize()} {name} (ms)", res[f"{stat}_{name}_ms"])
            for stat in ("mean", "median", "p90", "p99")
        ]
    typer.echo("{s:{c}^60}".format(s=" tophat loadgen ", c="="))
    for label, value in lines:
        typer.echo(f"{label:<44}{fmt(value):>16}")
    for note in res.get("notes", []):
        typer.echo(f"note: {note}")
    for error, count in (res.get("errors") or {}).items():
        typer.echo(f"error x{count}: {error}")
    typer.echo("=" * 60)
