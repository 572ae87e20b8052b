"""`make test-aiperf`: NVIDIA's aiperf, an outside load tool, against a real mesh's OpenAI endpoint.

A mesh is started with `tophat serve` on loopback (free ports), and once its streamer is ready aiperf
runs its streaming chat profile against it: synthetic prompts, `max_completion_tokens`,
`stream_options.include_usage`, and vLLM's `ignore_eos` (so every answer is exactly the asked
length). The check passes when every request succeeded, TTFT and inter-token latency are reported,
and the server-counted output length is the one asked for. aiperf runs from its own virtual
environment (it pins its own transformers and pydantic); its tokenizer is the model's directory,
so nothing is fetched from the Hugging Face hub.

aiperf 0.13 and offline mode: with HF_HUB_OFFLINE=1 it loads even a local tokenizer path through
`snapshot_download(local_files_only=True)`, which refuses a path ("Repo id must be in the form
'repo_name'..."), so that variable is removed from aiperf's environment; with a local directory it
then calls `AutoTokenizer.from_pretrained(path)` and makes no hub request.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tophatctl.mesh_ports import find_port_base
from tophatctl.models import resolve_model

log = logging.getLogger(__name__)


def start_mesh(model: str, port_base: int, log_path: Path) -> subprocess.Popen[bytes]:
    """`tophat serve` in its own process group (stopped with SIGTERM, as Ctrl-C would)."""
    command = [sys.executable, "-m", "tophat", "serve", "--model", model, "--port", str(port_base)]
    log.info("starting the mesh: %s (log: %s)", " ".join(command), log_path)
    with log_path.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_mesh(mesh: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if mesh.poll() is None:
        mesh.send_signal(signal.SIGTERM)
        try:
            mesh.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the mesh did not stop in %.0f s; killing its process group", timeout_s)
            os.killpg(mesh.pid, signal.SIGKILL)
            mesh.wait(timeout_s)


def wait_ready(url: str, mesh: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mesh.poll() is not None:
            raise RuntimeError(f"the mesh exited with status {mesh.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(1.0)
    raise RuntimeError(f"the mesh was not ready within {timeout_s:.0f} s")


def aiperf_command(args: argparse.Namespace, url: str, tokenizer: Path, out: Path) -> list[str]:
    return [
        args.aiperf, "profile",
        "--model", args.model_name,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--use-server-token-count",  # the server's usage counts (include_usage), not a re-tokenization
        "--request-count", str(args.requests),
        "--warmup-request-count", "1",
        "--concurrency", str(args.concurrency),
        "--prompt-input-tokens-mean", str(args.input_tokens),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.output_tokens),
        "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--request-timeout-seconds", str(args.request_timeout_s),
        "--random-seed", "1",
        "--output-artifact-dir", str(out),
        "--ui-type", "simple",
        "--no-auto-plot",
    ]  # fmt: skip


def metric(report: dict[str, Any], name: str, stat: str = "avg") -> float | None:
    value = report.get(name)
    return value.get(stat) if isinstance(value, dict) else None


def check(report: dict[str, Any], requests: int, output_tokens: int) -> list[str]:
    """What is wrong with aiperf's summary (profile_export_aiperf.json); empty when the run passed."""
    problems = []
    errors = metric(report, "error_request_count") or 0
    if errors:
        problems.append(f"{errors:.0f} failed requests: {report.get('error_summary')}")
    if metric(report, "request_count") != requests:
        problems.append(f"{metric(report, 'request_count')} requests completed, {requests} sent")
    for name in ("time_to_first_token", "inter_token_latency"):
        if not (metric(report, name) or 0) > 0:
            problems.append(f"no {name} reported")
    if metric(report, "output_sequence_length", "min") != output_tokens:
        problems.append(f"output lengths {report.get('output_sequence_length')}, {output_tokens} asked (ignore_eos)")
    return problems


def summary(report: dict[str, Any]) -> str:
    rows = [
        ("requests", metric(report, "request_count"), ""),
        ("failed", metric(report, "error_request_count") or 0, ""),
        ("TTFT mean / p90", f"{metric(report, 'time_to_first_token'):.1f} / "
         f"{metric(report, 'time_to_first_token', 'p90'):.1f}", "ms"),
        ("ITL mean / p90", f"{metric(report, 'inter_token_latency'):.1f} / "
         f"{metric(report, 'inter_token_latency', 'p90'):.1f}", "ms"),
        ("output tokens / request", metric(report, "output_sequence_length"), ""),
        ("output throughput", f"{metric(report, 'output_token_throughput'):.1f}", "tok/s"),
        ("request throughput", f"{metric(report, 'request_throughput'):.2f}", "req/s"),
    ]  # fmt: skip
    return "\n".join(f"{name:<26}{value} {unit}".rstrip() for name, value, unit in rows)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness probe

    tokenizer = resolve_model(args.model).resolve()  # the model's own tokenizer files (smollm2: imported here)
    args.out.mkdir(parents=True, exist_ok=True)
    port_base = find_port_base(1)
    url = f"http://127.0.0.1:{port_base}"
    mesh = start_mesh(args.model, port_base, args.out / "mesh.log")
    try:
        wait_ready(url, mesh, args.ready_timeout_s)
        args.model_name = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"][0]["id"]
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # see the module docstring
        command = aiperf_command(args, url, tokenizer, args.out)
        log.info("running: %s", " ".join(command))
        started = time.monotonic()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.aiperf_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"aiperf did not finish within {args.aiperf_timeout_s:.0f} s", file=sys.stderr)
            return 1
        (args.out / "aiperf.log").write_text(done.stdout + done.stderr)
        log.info("aiperf took %.1f s (exit status %d)", time.monotonic() - started, done.returncode)
    finally:
        stop_mesh(mesh)
    export = args.out / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.is_file():
        print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
        print(f"aiperf failed (exit status {done.returncode}); its output: {args.out / 'aiperf.log'}", file=sys.stderr)
        return 1
    report = json.loads(export.read_text())
    print(summary(report))
    problems = check(report, args.requests, args.output_tokens)
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("aiperf check:", "FAILED" if problems else "passed", f"(artifacts in {args.out})")
    return 1 if problems else 0
