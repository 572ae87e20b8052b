"""The load generator's runner and CLI against a scripted SSE server on real uvicorn.

The server below stands in for the token streamer: it speaks the same OpenAI
completions SSE shape (content chunks, a final chunk with the `tophat` stats, a
usage chunk, `[DONE]`) with scripted delays, so recorded TTFT/TBT can be checked
against known values. The real mesh is exercised by the mesh tests elsewhere.
"""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from loadgen import metrics
from loadgen.cli import loadgen_command
from loadgen.runner import RunConfig, run_load
from loadgen.workloads import WorkloadRequest

# The "ok" script: text per chunk ("ab" = one token) and the delay before it.
TTFT_S = 0.20
SCRIPT = [(TTFT_S, "ab"), (0.10, "abab"), (0.10, "ab")]  # 1, 2, 1 tokens
TOKENS = 4
SLACK_S = 0.25  # a loaded CI box can be late, never early


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(text: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if text is None and finish is None else [{"index": 0, "text": text or "", "finish_reason": finish}]
    return {"id": "cmpl-x", "object": "text_completion", "choices": choices, **extra}


async def _script(prompt: str) -> AsyncIterator[str]:
    if prompt == "hang":
        await asyncio.sleep(30)
    for delay, text in SCRIPT:
        await asyncio.sleep(delay)
        yield _sse(_chunk(text))
        if prompt == "errchunk":
            yield _sse({"error": {"message": "device died", "type": "server_error", "code": "device_error"}})
            yield "data: [DONE]\n\n"
            return
    tophat = {
        "device_id": "dev-7",
        "ttft_s": TTFT_S,
        "tbt_s": 0.066,
        "mean_accept_length": 1.5,
        "num_rounds": 2,
        "prompt_tokens": 64,
        "completion_tokens": TOKENS,
    }
    yield _sse(_chunk(None, "length", tophat=tophat))
    yield _sse(_chunk(usage={"prompt_tokens": 64, "completion_tokens": TOKENS, "total_tokens": 64 + TOKENS}))
    if prompt != "nodone":
        yield "data: [DONE]\n\n"


def scripted_app(bodies: list[dict[str, Any]]) -> Starlette:
    async def completions(request: Request) -> Any:
        body = await request.json()
        bodies.append(body)
        if body["prompt"] == "busy":
            return JSONResponse({"error": {"message": "all devices busy", "code": "busy"}}, status_code=503)
        return StreamingResponse(_script(body["prompt"]), media_type="text/event-stream")

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def readyz(_: Request) -> JSONResponse:
        return JSONResponse({"ready": True, "ready_devices": 3})  # the streamer's public /readyz: a count only

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/readyz", readyz),
        ]
    )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Real uvicorn in its own thread (own event loop), on a kernel-chosen loopback port."""
    bodies: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(
        uvicorn.Config(scripted_app(bodies), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", bodies
    srv.should_exit = True
    thread.join(5)
    sock.close()


def req(i: int, prompt: str = "ok") -> WorkloadRequest:
    return WorkloadRequest(index=i, prompt=prompt, prompt_tokens=60, max_tokens=16, device_hint=i % 2)


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
@pytest.mark.slow
async def test_timings_match_the_script_and_failures_are_counted(server) -> None:
    url, _ = server
    prompts = ["ok", "ok", "ok", "busy", "errchunk", "hang", "nodone"]
    arrivals = [0.0, 0.15, 0.3, 0.0, 0.0, 0.0, 0.0]
    cfg = RunConfig(url=url, request_timeout_s=1.0, progress=False)
    run = await run_load([req(i, p) for i, p in enumerate(prompts)], arrivals, cfg)
    recs = run.records
    for rec in recs[:3]:
        assert rec.ok, rec.error
        assert rec.arrival_s <= rec.send_s <= rec.arrival_s + SLACK_S  # sent on schedule
        assert TTFT_S - 0.01 <= metrics.ttft_s(rec) <= TTFT_S + SLACK_S
        assert rec.chunk_tokens == [1, 2, 1] and metrics.output_tokens(rec) == TOKENS
        gaps = metrics.tbt_samples_s(rec)  # 2 tokens after 0.1 s -> two gaps of 0.05, then one of 0.1
        assert len(gaps) == TOKENS - 1
        for got, want in zip(gaps, [0.05, 0.05, 0.10]):
            assert want - 0.01 <= got <= want + SLACK_S
        assert rec.accept_length == 1.5 and rec.num_rounds == 2 and rec.device_id == "dev-7"
        assert rec.prompt_tokens == 64  # the server's usage count replaces the workload's estimate
        assert rec.finish_reason == "length"
    errors = {p: r.error for p, r in zip(prompts[3:], recs[3:])}
    assert errors["busy"].startswith("HTTP 503: all devices busy")
    assert "device died" in errors["errchunk"]
    assert errors["hang"] == "timeout after 1 s"
    assert "without [DONE]" in errors["nodone"]
    res = metrics.build_results(recs)
    assert res["completed"] == 3 and res["failed"] == 4
    assert res["mean_accept_length"] == pytest.approx(1.5)
    assert TTFT_S <= res["mean_ttft_ms"] / 1e3 <= TTFT_S + SLACK_S


async def test_concurrency_cap_queueing_counts_in_ttft(server) -> None:
    url, _ = server
    cfg = RunConfig(url=url, max_concurrency=1, progress=False)
    first, second = (await run_load([req(0), req(1)], [0.0, 0.0], cfg)).records
    assert first.ok and second.ok
    assert second.send_s >= first.end_s - 0.01  # waited for the only slot
    assert metrics.ttft_s(second) >= metrics.e2e_s(first) + TTFT_S - 0.02


def test_cli_writes_results_csv_and_plots(server, tmp_path: Path) -> None:
    url, bodies = server
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt": p}) for p in ["ok", "ok", "busy"]) + "\n")
    app = typer.Typer()
    app.command("loadgen")(loadgen_command)
    app.command("other")(lambda: None)  # a group, as when mounted in tophat/cli.py
    out = tmp_path / "out"
    bodies.clear()
    result = CliRunner().invoke(
        app,
        [
            "loadgen",
            "--url",
            url,
            "--workload",
            str(workload),
            "--rate",
            "40",
            "--num-requests",
            "4",
            "--max-new-tokens",
            "16",
            "--seed",
            "3",
            "--out",
            str(out),
            "--tokenizer",
            str(tmp_path / "none"),
            "--slo-ttft-ms",
            "5000",
            "--prefill-sla-ms",
            "1000",
            "--no-progress",
            "--extra-body",
            '{"speculative": false}',
        ],
    )
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert res["completed"] == 3 and res["failed"] == 1 and res["request_rate"] == 40.0
    for key in (
        "burstiness",
        "duration",
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p99_tbt_ms",
        "mean_tpot_ms",
        "p90_e2el_ms",
        "mean_accept_length",
        "goodput",
        "sla_compliance",
    ):
        assert key in res, key
    assert res["model"] == "scripted" and res["num_devices"] == 3
    assert res["sla_compliance"]["prefill"]["compliance"] == pytest.approx(0.75)
    assert any("device_hint" in note for note in res["notes"])
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 4 and [r["device_hint"] for r in rows] == ["0", "1", "2", "0"]
    assert sum(r["ok"] == "False" for r in rows) == 1
    for name in ("ttft_cdf.png", "tbt_cdf.png", "sla_compliance.png"):
        assert (out / name).stat().st_size > 1000
    assert len(bodies) == 4
    assert all(
        b["stream_options"] == {"include_usage": True}
        and b["speculative"] is False
        and b["model"] == "scripted"
        and "device_hint" not in b
        for b in bodies
    )
    assert "Successful requests" in result.output


def test_verifier_steps_are_read_from_redis_for_the_run_window() -> None:
    import redis

    from loadgen.runner import fetch_verifier_steps
    from shared.processes.redis_server import EmbeddedRedis, EmbeddedRedisError

    try:
        srv = EmbeddedRedis().start()
    except EmbeddedRedisError as exc:
        pytest.skip(f"no redis-server: {exc}")
    try:
        client = redis.Redis.from_url(srv.url, decode_responses=True)
        started = time.time()
        for i in range(5):
            client.xadd("tophat:verifier:steps", {"batched_tokens": "4", "compute_s": repr(0.01 * (i + 1)), "ts": "0"})
        ended = time.time()
        steps, note = asyncio.run(fetch_verifier_steps(srv.url, started, ended))
        assert note is None and [s["compute_s"] for s in steps] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
        steps, note = asyncio.run(fetch_verifier_steps(srv.url, ended + 60, ended + 120))
        assert steps == [] and "no entries" in note
    finally:
        srv.stop()
