"""`docker compose up` for real (`make test-deploy`; marked `deploy`, so `make test` leaves it out).

The image `tophat:cpu` (`make image`) runs every service in its own container, each on the host's
network (docker-compose.host.yml), so all traffic stays on 127.0.0.1. Two device agents (`device-agent` and
`device-agent-2`, each with its own bootstrap token's id) announce themselves. The secrets come from
`make secrets`: every internal hop needs a token, Redis a password, and the cloud-side services speak only TLS
(a development CA's certificate, trusted here). The official `openai` client streams a greedy chat
answer that must equal the unsplit model's (computed here, on the host, from the same wheel); the
verifier container is killed and the restart policy must bring the mesh back to serving; `down -v`
must leave no container, network or volume behind.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.model.checkpoint import load_checkpoint
from shared.specdec.reference import generate_full
from tophatctl.models import resolve_model

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
PROJECT = "tophat-ci"
FILES = ["-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "docker-compose.host.yml")]
STREAMER = "https://127.0.0.1:8000"
MONITOR = "https://127.0.0.1:8020"
CA = REPO / "build" / "secrets" / "ca.pem"  # `make secrets`: the development CA the services' certificate is from


def trusted() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(CA))


MAX_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def compose(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["docker", "compose", "-p", PROJECT, *FILES, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOPHAT_IMAGE": os.environ.get("TOPHAT_IMAGE", "tophat:cpu")},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"docker compose {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def docker(*args: str, timeout: float = 60) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def project_objects() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        kind: docker(*cmd, "--filter", label, "--format", "{{.ID}}").split()
        for kind, cmd in {
            "containers": ["ps", "-a"],
            "networks": ["network", "ls"],
            "volumes": ["volume", "ls"],
        }.items()
    }


def streamed_chat_answer(timeout: float = 300) -> str:
    from openai import OpenAI

    client = OpenAI(
        base_url=f"{STREAMER}/v1",
        api_key="unused",
        timeout=timeout,
        max_retries=0,
        http_client=httpx.Client(verify=trusted(), timeout=timeout),
    )
    stream = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def wait_serving(deadline_s: float) -> None:
    """Until the streamer is ready (it routes to at least one device agent whose /readyz answers)."""
    deadline = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{STREAMER}/readyz", timeout=5, verify=trusted())
            if response.status_code == 200:
                return
            last = response.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(2)
    raise AssertionError(f"the mesh is not serving after {deadline_s} s: {last}\n{logs()}")


def logs() -> str:
    return compose("logs", "--no-color", "--tail", "40", timeout=60, check=False).stdout


@pytest.fixture(scope="module")
def expected_answer() -> str:
    checkpoint = load_checkpoint(resolve_model("smollm2"))
    ids = checkpoint.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answer = generate_full(checkpoint, ids, MAX_TOKENS).token_ids
    return checkpoint.tokenizer.decode(answer, skip_special_tokens=True)


@pytest.fixture(scope="module")
def stack():
    compose("down", "-v", "--remove-orphans", timeout=180, check=False)  # leftovers of an interrupted run
    started = time.monotonic()
    try:
        compose("up", "-d", "--wait", "--wait-timeout", "600", timeout=660)
        print(f"\ncompose up (2 device agents) healthy in {time.monotonic() - started:.1f} s")
        yield
    except AssertionError:
        print(logs())
        raise
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)


def test_compose_mesh_serves_restarts_and_leaves_nothing(stack, expected_answer):
    status = {c["Service"]: c for c in map(json.loads, compose("ps", "--format", "json").stdout.splitlines())}
    assert set(status) == {
        "redis",
        "state-monitor",
        "chunk-planner",
        "verifier-cloud",
        "device-agent",
        "device-agent-2",
        "token-streamer",
    }
    # The image built the native layers for this CPU, and the services load them: `auto` runs int4 there.
    probe = "from shared.model.native_build import native_module; print(native_module() is not None)"
    for service in ("verifier-cloud", "device-agent"):
        loaded = compose("exec", "-T", service, "python", "-c", probe, timeout=120)
        assert loaded.stdout.strip() == "True", loaded.stdout + loaded.stderr
    devices = httpx.get(f"{MONITOR}/devices", timeout=10, verify=trusted()).json()["devices"]
    assert len(devices) == 2 and len({d["device_id"] for d in devices}) == 2, devices

    # The mesh secret and Redis's password came in as Compose secrets: no credential, no entry.
    forged = {"device_id": "intruder", "url": "http://127.0.0.1:1"}
    assert httpx.post(f"{MONITOR}/devices/announce", json=forged, timeout=10, verify=trusted()).status_code == 401
    assert httpx.post(f"{devices[0]['url']}/generate", json={"prompt": "hi"}, timeout=10).status_code == 401
    # The cloud-side services speak only TLS, with a certificate from the deployment's CA.
    for port in (8000, 8010, 8020, 8100):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"https://127.0.0.1:{port}/readyz", timeout=5)  # a client that does not trust the CA
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=16379, socket_timeout=5, retry=Retry(NoBackoff(), 0)).ping()

    wait_serving(120)
    assert streamed_chat_answer() == expected_answer, logs()
    chat = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "tophat"),
            "chat",
            "--url",
            STREAMER,
            "--prompt",
            QUESTION[0]["content"],
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SSL_CERT_FILE": str(CA)},
    )
    assert chat.returncode == 0 and expected_answer in chat.stdout, chat.stdout + chat.stderr

    # The verifier's container dies as the kernel's OOM killer would end it (SIGKILL to its init, from the
    # host: `docker kill` counts as an operator's stop, which restart policies respect). Its restart policy
    # must bring it back and the device agents reconnect.
    verifier = compose("ps", "-q", "verifier-cloud").stdout.split()
    assert len(verifier) == 1
    restarts_before = int(docker("inspect", "--format", "{{.RestartCount}}", verifier[0]).strip())
    os.kill(int(docker("inspect", "--format", "{{.State.Pid}}", verifier[0]).strip()), signal.SIGKILL)
    deadline = time.monotonic() + 300
    while int(docker("inspect", "--format", "{{.RestartCount}}", verifier[0]).strip()) == restarts_before:
        assert time.monotonic() < deadline, f"the verifier was not restarted\n{logs()}"
        time.sleep(1)
    answer, deadline = None, time.monotonic() + 300
    while answer is None:
        try:
            answer = streamed_chat_answer(timeout=120)
        except openai.OpenAIError as exc:  # while the verifier reloads: retried until the deadline
            assert time.monotonic() < deadline, f"no answer after the verifier restart: {exc!r}\n{logs()}"
            time.sleep(3)
    assert answer == expected_answer

    compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300)
    assert project_objects() == {"containers": [], "networks": [], "volumes": []}
