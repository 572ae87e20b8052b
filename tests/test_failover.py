"""Losing a verifier loses nothing (real processes): streams in flight when their verifier is
SIGKILLed are replayed on another replica, or on the same one once the supervisor has restarted it,
and finish token-identical to the unsplit model; with no verifier coming back, every client gets a
typed error within the failover deadline instead of a hang."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx

from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.launcher import Mesh, MeshConfig, find_port_base

MAX_TOKENS = 40
# A slow link keeps the generations in flight long enough to be cut in the middle.
SLOW_LINK = {"link": "lat=40ms", "link_mode": "inprocess"}


def stream_completion(mesh: Mesh, prompt: str, first_token: threading.Event) -> tuple[str, list[dict]]:
    """The streamed text and any error events."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, errors = [], []
    with httpx.stream("POST", f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
                continue
            text.append(event["choices"][0].get("text", ""))
            first_token.set()
    return "".join(text), errors


def expected_text(checkpoint, prompt: str) -> str:
    ids = checkpoint.tokenizer.encode(prompt, add_special_tokens=False)
    return checkpoint.tokenizer.decode(generate_full(checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)


def kill(mesh: Mesh, name: str) -> float:
    service = next(s for s in mesh.services if s.name == name)
    os.kill(service.process.pid, signal.SIGKILL)
    return time.monotonic()


def run_with_kill(mesh: Mesh, prompts: list[str], victim: str) -> tuple[list[tuple[str, list[dict]]], float]:
    first_token = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_completion, mesh, p, first_token) for p in prompts]
        assert first_token.wait(60), "no stream started"
        killed_at = kill(mesh, victim)
        results = [f.result(timeout=180) for f in futures]
    return results, time.monotonic() - killed_at


def device_replays(mesh: Mesh) -> int:
    logs = [s.log_path.read_text(errors="replace") for s in mesh.services if s.name.startswith("device-agent")]
    return sum(log.count("continues on verifier") for log in logs)


def test_four_streams_survive_losing_one_of_two_verifiers(demo_checkpoint):
    prompts = [p[:80] for p in held_out_prompts(4, seed=5)]
    expected = [expected_text(demo_checkpoint, p) for p in prompts]
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, verifiers=2,
                        port_base=find_port_base(1, num_verifiers=2), **SLOW_LINK)
    with Mesh(config) as mesh:
        results, _ = run_with_kill(mesh, prompts, "verifier-cloud")  # the replica the device is connected to
        assert [errors for _, errors in results] == [[]] * 4
        assert [text for text, _ in results] == expected
        assert device_replays(mesh) >= 1  # the sessions really moved


def test_streams_wait_for_a_restarted_verifier(demo_checkpoint):
    prompts = [p[:80] for p in held_out_prompts(2, seed=9)]
    expected = [expected_text(demo_checkpoint, p) for p in prompts]
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1), supervise=True,
                        **SLOW_LINK)
    with Mesh(config) as mesh:
        results, _ = run_with_kill(mesh, prompts, "verifier-cloud")
        assert [errors for _, errors in results] == [[]] * 2
        assert [text for text, _ in results] == expected


def test_no_verifier_coming_back_is_a_typed_error_within_the_deadline(demo_checkpoint):
    prompts = [p[:80] for p in held_out_prompts(2, seed=13)]
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1),
                        device_env={"failover_deadline_s": "3"}, **SLOW_LINK)
    with Mesh(config) as mesh:
        results, seconds = run_with_kill(mesh, prompts, "verifier-cloud")
        for _, errors in results:
            assert errors and errors[0]["code"] == "CloudUnavailable", errors
        assert seconds < 3 + 15  # the deadline, plus a connect timeout and the last backoff
