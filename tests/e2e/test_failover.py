"""Losing a verifier loses nothing (real processes): streams in flight when their verifier is
SIGKILLed are replayed on another replica, or on the same one once the supervisor has restarted it,
and finish token-identical to the unsplit model; with no verifier coming back, every client gets a
typed error within the failover deadline instead of a hang.

The gap each user saw is printed (run with -s), not asserted: speed is not a test."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

MAX_TOKENS = 40
# A slow link keeps the generations in flight long enough to be cut in the middle.
SLOW_LINK = {"link": "lat=40ms", "link_mode": "inprocess"}


@dataclass
class Streamed:
    text: str
    errors: list[dict]
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each SSE chunk


def stream_completion(mesh: Mesh, prompt: str, first_token: threading.Event) -> Streamed:
    """The streamed text, any error events, and when each chunk arrived."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, errors, chunk_times = [], [], []
    with httpx.stream("POST", f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            chunk_times.append(time.monotonic())
            if "error" in event:
                errors.append(event["error"])
                continue
            text.append(event["choices"][0].get("text", ""))
            first_token.set()
    return Streamed("".join(text), errors, chunk_times)


def expected_text(checkpoint, prompt: str) -> str:
    ids = checkpoint.tokenizer.encode(prompt, add_special_tokens=False)
    return checkpoint.tokenizer.decode(generate_full(checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)


def kill(mesh: Mesh, name: str) -> float:
    service = next(s for s in mesh.services if s.name == name)
    os.kill(service.process.pid, signal.SIGKILL)
    return time.monotonic()


def run_with_kill(mesh: Mesh, prompts: list[str], victim: str) -> tuple[list[Streamed], float]:
    """Each stream's result, and the seconds from the kill to the last stream's end; prints the gaps."""
    # Killed once every stream has its first chunk: each is then mid-generation, and its gap is the kill's
    # alone, not its time to first token.
    first_tokens = [threading.Event() for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_completion, mesh, p, started) for p, started in zip(prompts, first_tokens)]
        deadline = time.monotonic() + 60
        assert all(started.wait(max(0.0, deadline - time.monotonic())) for started in first_tokens), (
            "not every stream started"
        )
        killed_at = kill(mesh, victim)
        results = [f.result(timeout=180) for f in futures]
    report_gaps(victim, results, killed_at)
    return results, time.monotonic() - killed_at


def report_gaps(victim: str, results: list[Streamed], killed_at: float) -> None:
    """Print the gap the kill made in each stream: the interval between the chunks either side of the kill,
    the time from the kill to the stream's next chunk, and the stream's longest interval between chunks."""
    across, after_kill = [], []
    for index, result in enumerate(results):
        times = result.chunk_times
        before = [t for t in times if t <= killed_at]
        after = [t for t in times if t > killed_at]
        longest = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        if not after:
            print(f"stream {index}: finished before the kill of {victim} ({len(times)} chunks)")
            continue
        after_kill.append(after[0] - killed_at)
        gap = after[0] - before[-1] if before else float("nan")  # nan: the stream's first chunk came after the kill
        if before:
            across.append(gap)
        error = f", error {result.errors[0].get('code')}" if result.errors else ""
        print(
            f"stream {index}: {len(before)} chunks before the kill, {len(after)} after; kill to next chunk "
            f"{after[0] - killed_at:.3f} s, gap across the kill {gap:.3f} s, longest interval {longest:.3f} s{error}"
        )
    for label, gaps in (("failover gap", across), ("kill to next chunk", after_kill)):
        if gaps:
            print(
                f"{label} ({victim} killed, {len(gaps)} stream(s)): max {max(gaps):.3f} s, "
                f"median {statistics.median(gaps):.3f} s"
            )


def device_replays(mesh: Mesh) -> int:
    logs = [s.log_path.read_text(errors="replace") for s in mesh.services if s.name.startswith("device-agent")]
    return sum(log.count("continues on verifier") for log in logs)


def connected_verifier(mesh: Mesh) -> str:
    """The name of the verifier replica the device agent is connected to now. It dials the first replica first,
    but a replica that was not listening yet is skipped, so under load it can be the second."""
    log = next(s for s in mesh.services if s.name == "device-agent-0").log_path.read_text(errors="replace")
    port = re.findall(r"connected to verifier \S+:(\d+)/", log)[-1]  # its host depends on the link's namespace
    return next(name for name, url in mesh.urls().items() if name.startswith("verifier") and f":{port}/" in url)


def test_four_streams_survive_losing_one_of_two_verifiers(demo_checkpoint):
    prompts = [p[:80] for p in held_out_prompts(4, seed=5)]
    expected = [expected_text(demo_checkpoint, p) for p in prompts]
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        num_devices=1,
        verifiers=2,
        port_base=find_port_base(1, num_verifiers=2),
        **SLOW_LINK,
    )
    with Mesh(config) as mesh:
        results, _ = run_with_kill(mesh, prompts, connected_verifier(mesh))
        assert [r.errors for r in results] == [[]] * 4
        assert [r.text for r in results] == expected
        assert device_replays(mesh) >= 1  # the sessions really moved


def test_streams_wait_for_a_restarted_verifier(demo_checkpoint):
    prompts = [p[:80] for p in held_out_prompts(2, seed=9)]
    expected = [expected_text(demo_checkpoint, p) for p in prompts]
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1), supervise=True, **SLOW_LINK
    )
    with Mesh(config) as mesh:
        results, _ = run_with_kill(mesh, prompts, "verifier-cloud")
        assert [r.errors for r in results] == [[]] * 2
        assert [r.text for r in results] == expected


def test_no_verifier_coming_back_is_a_typed_error_within_the_deadline(demo_checkpoint):
    prompts = [p[:80] for p in held_out_prompts(2, seed=13)]
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        num_devices=1,
        port_base=find_port_base(1),
        device_env={"failover_deadline_s": "3"},
        **SLOW_LINK,
    )
    with Mesh(config) as mesh:
        results, seconds = run_with_kill(mesh, prompts, "verifier-cloud")
        for result in results:
            assert result.errors and result.errors[0]["code"] == "FailoverExhausted", result.errors
        assert seconds < 3 + 15  # the deadline, plus a connect timeout and the last backoff
