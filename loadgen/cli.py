"""`tophat loadgen`: drive the token streamer with an open-loop workload and write the results.

Mount with `app.command("loadgen")(loadgen_command)`. Heavy imports (transformers,
matplotlib, redis) happen inside the command, so mounting it costs nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import typer

log = logging.getLogger(__name__)

DEVICE_HINT_NOTE = ("device_hint is recorded per request but not sent: the token streamer builds the device "
                    "request from fixed fields and does not forward extra body fields (nor a device choice)")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def loadgen_command(
    url: str = typer.Option("http://127.0.0.1:8000", help="token streamer base URL"),
    workload: str = typer.Option("specbench", help="specbench, cnndm, or a JSONL file of {\"prompt\", \"max_tokens\"?}"),
    rate: float = typer.Option(math.inf, help="mean request rate (req/s); inf sends everything at t=0"),
    burstiness: float = typer.Option(1.0, help="gamma shape of inter-arrival gaps (1 = Poisson, <1 burstier)"),
    num_requests: Optional[int] = typer.Option(None, "--num-requests", "-n", min=1, help="send this many requests"),
    duration: Optional[float] = typer.Option(None, help="or: send every arrival in [0, S) s (in-flight ones finish)"),
    max_new_tokens: int = typer.Option(128, min=1, help="max_tokens per request (HAT: 128)"),
    seed: int = typer.Option(0, help="seed for arrivals and prompts"),
    out: Path = typer.Option(..., help="output directory (results.json, requests.csv, *.png)"),
    tokenizer: str = typer.Option("smollm2", help="the model whose tokenizer (and config.json) counts tokens: "
                                  "smollm2 | demo | a checkpoint directory"),
    context_limit: Optional[int] = typer.Option(None, help="model context (default: config.json max_position_embeddings)"),
    length_dist: str = typer.Option("gamma", help="prompt-length fit: gamma or lognormal"),
    max_concurrency: Optional[int] = typer.Option(None, min=1, help="cap on requests in flight (waiting counts in TTFT)"),
    request_timeout: float = typer.Option(300.0, help="per-request timeout, send to end of stream (s)"),
    temperature: float = typer.Option(0.0, help="sampling temperature sent with every request"),
    model: Optional[str] = typer.Option(None, help="model name to send (default: the server's /v1/models id)"),
    num_devices: Optional[int] = typer.Option(None, min=1, help="devices for the round-robin device_hint (default: /readyz)"),
    send_device_hint: bool = typer.Option(False, help="add device_hint to the request body (ignored by today's streamer)"),
    extra_body: Optional[str] = typer.Option(None, help="JSON object merged into every request body"),
    slo_ttft_ms: Optional[float] = typer.Option(None, help="goodput SLO on TTFT (ms)"),
    slo_tpot_ms: Optional[float] = typer.Option(None, help="goodput SLO on TPOT (ms)"),
    slo_e2el_ms: Optional[float] = typer.Option(None, help="goodput SLO on end-to-end latency (ms)"),
    prefill_sla_ms: Optional[float] = typer.Option(None, help="HAT prefill SLA: TTFT per 128 prompt tokens (ms)"),
    decode_sla_ms: Optional[float] = typer.Option(None, help="HAT decode SLA: delay per 10 output tokens (ms)"),
    redis_url: Optional[str] = typer.Option(None, help="read tophat:verifier:steps for the cloud compute-delay plot"),
    state_monitor_url: Optional[str] = typer.Option(None, help="record the state monitor's cloud state after the run"),
    progress: bool = typer.Option(True, help="show a live progress bar"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", show_envvar=True,
                                          help="sent as Authorization: Bearer (the streamer's TOPHAT_STREAMER_API_KEY)"),
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
        results = asyncio.run(_run(options))
    except ValueError as exc:
        _fail(str(exc))
    _print_summary(results)
    typer.echo(f"results in {out}")


async def _run(o: dict[str, Any], records_out: list | None = None) -> dict[str, Any]:
    """One run; its per-request records are appended to `records_out` when given (benches that need more
    than results.json holds, e.g. each request's `tophat` object)."""
    from loadgen import arrivals as arr
    from loadgen import metrics, plots, runner, workloads as wl

    times = arr.arrival_times(o["rate"], o["burstiness"], num_requests=o["num_requests"], duration=o["duration"],
                              seed=o["seed"])
    if len(times) == 0:
        raise ValueError("no arrivals in that duration; raise --rate or --duration")
    probe = await runner.probe_server(o["url"], api_key=o.get("api_key"))
    if not probe["reachable"]:
        raise ValueError(f"cannot reach {o['url']}: {probe['error']}")
    num_devices = o["num_devices"] or probe["num_devices"] or 1
    notes = [] if o["send_device_hint"] else [DEVICE_HINT_NOTE]

    from tophatctl.models import resolve_model

    tok_path = resolve_model(o["tokenizer"])
    builtin = wl.BUILTIN.get(o["workload"])
    tok = wl.load_tokenizer(tok_path) if builtin or (tok_path / "tokenizer_config.json").exists() else None
    if builtin:
        limit = o["context_limit"] or wl.context_limit_of(tok_path)
        work = wl.synthetic_workload(builtin, len(times), tokenizer=tok, max_new_tokens=o["max_new_tokens"],
                                     context_limit=limit, seed=o["seed"], num_devices=num_devices, dist=o["length_dist"])
    elif Path(o["workload"]).is_file():
        work = wl.file_workload(o["workload"], len(times), max_new_tokens=o["max_new_tokens"], tokenizer=tok,
                                num_devices=num_devices)
    else:
        raise ValueError(f"--workload must be specbench, cnndm or an existing JSONL file, got {o['workload']!r}")

    cfg = runner.RunConfig(url=o["url"], model=o["model"] or probe["model"], temperature=o["temperature"],
                           request_timeout_s=o["request_timeout"], max_concurrency=o["max_concurrency"],
                           extra_body=o["body_extra"], send_device_hint=o["send_device_hint"], progress=o["progress"],
                           api_key=o.get("api_key"))
    count = (lambda text: len(tok(text, add_special_tokens=False)["input_ids"])) if tok is not None else None
    run = await runner.run_load(work.requests, times.tolist(), cfg, count_tokens=count)
    if records_out is not None:
        records_out.extend(run.records)
    if count is None:
        notes.append("no tokenizer: tokens per chunk apportioned by characters")

    steps: list[dict[str, float]] = []
    if o["redis_url"]:
        steps, note = await runner.fetch_verifier_steps(o["redis_url"], run.started_wall, run.ended_wall)
        notes += [note] if note else []
    else:
        notes.append("no --redis-url: per-step cloud compute delay not collected")
    cloud_state = await runner.fetch_cloud_state(o["state_monitor_url"]) if o["state_monitor_url"] else None

    slos = {k: v for k, v in (("ttft", o["slo_ttft_ms"]), ("tpot", o["slo_tpot_ms"]), ("e2el", o["slo_e2el_ms"]))
            if v is not None}
    slas = {k: v for k, v in (("prefill", o["prefill_sla_ms"]), ("decode", o["decode_sla_ms"])) if v is not None}
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "url": o["url"], "model": cfg.model,
        "workload": work.name, "workload_stats": work.stats, "num_prompts": len(work.requests),
        "request_rate": "inf" if math.isinf(o["rate"]) else o["rate"], "burstiness": o["burstiness"],
        "duration_limit_s": o["duration"], "max_new_tokens": o["max_new_tokens"], "seed": o["seed"],
        "max_concurrency": o["max_concurrency"], "temperature": o["temperature"], "num_devices": num_devices,
        "extra_body": o["body_extra"] or None, "tokenizer": str(tok_path) if tok is not None else None,
        **metrics.build_results(run.records, slos_ms=slos, sla_thresholds_ms=slas),
    }
    if steps:
        delays = [s["compute_s"] * 1e3 for s in steps]
        results["cloud_compute_delay"] = {"steps": len(delays), "mean_ms": sum(delays) / len(delays),
                                          "std_ms": _std(delays)}
    results["cloud_state"] = cloud_state
    results["notes"] = notes
    out_dir: Path = o["out"]
    runner.save_outputs(out_dir, results, run.records)
    title = f"{work.name} @ {results['request_rate']} req/s, B={o['burstiness']:g}"
    plots.write_plots(run.records, results, out_dir, title, steps)
    return results


def _std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5


def _print_summary(res: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
             ("Benchmark duration (s)", res["duration"]), ("Request throughput (req/s)", res["request_throughput"]),
             ("Output token throughput (tok/s)", res["output_throughput"]),
             ("Mean accept length", res["mean_accept_length"]), ("Goodput (req/s)", res["goodput"])]
    for name in ("ttft", "tbt", "tpot", "e2el", "prefill_sla", "decode_sla", "server_queue_wait"):
        lines += [(f"{stat.upper() if stat.startswith('p') else stat.capitalize()} {name} (ms)",
                   res[f"{stat}_{name}_ms"]) for stat in ("mean", "median", "p90", "p99")]
    typer.echo("{s:{c}^60}".format(s=" tophat loadgen ", c="="))
    for label, value in lines:
        typer.echo(f"{label:<44}{fmt(value):>16}")
    for note in res.get("notes", []):
        typer.echo(f"note: {note}")
    for error, count in (res.get("errors") or {}).items():
        typer.echo(f"error x{count}: {error}")
    typer.echo("=" * 60)
