"""`docker stack deploy` for real (`make test-swarm`; marked `deploy` and `swarm`, so `make test` leaves it out).

A single-node swarm on loopback, the node labelled with both roles, the secrets made by `tophat mesh-secrets`
(the command `make secrets` runs) and created as Swarm secrets, then swarm/stack.yml deployed unchanged with
swarm/one-host.yml on top: every service on the host's network, all traffic on 127.0.0.1, one image, one
device agent, the resource limits lowered through the stack's variables. The engine advertises 8 fake GPUs
(.ci/docker-up.sh), so the verifier's GPU reservation is satisfied as written. Then: a streamed greedy chat
answer through the official `openai` client equals the unsplit model's; `docker service scale` of the
device agents is seen by the streamer; a killed task's container is replaced and serving resumes; an update
to an image that does not exist is rolled back by `rollback_config`; `docker stack rm` and `swarm leave`
leave no service, container, secret, config or network of the project. The timings are printed.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.test_compose import MAX_TOKENS, QUESTION, expected_answer  # noqa: F401 - a shared fixture

pytestmark = [pytest.mark.deploy, pytest.mark.swarm]

REPO = Path(__file__).resolve().parents[2]
STACK = "tophat-ci"
FILES = ["-c", str(REPO / "swarm" / "stack.yml"), "-c", str(REPO / "swarm" / "one-host.yml")]
STREAMER = "https://127.0.0.1:8000"
IMAGE = os.environ.get("TOPHAT_IMAGE", "tophat:cpu")
# The stack's variables for one 2-core host (production defaults: swarm/README.md's settings table)
ONE_HOST = {
    "TOPHAT_IMAGE": IMAGE,
    "TOPHAT_DEVICE_ARCH": platform.machine(),
    "TOPHAT_SERVER_ARCH": platform.machine(),
    "TOPHAT_DEVICE_CPUS": "2",
    "TOPHAT_DEVICE_CPUS_RESERVED": "0.1",
    "TOPHAT_DEVICE_MEMORY_RESERVED": "256M",
    "TOPHAT_VERIFIER_CPUS": "2",
    "TOPHAT_VERIFIER_CPUS_RESERVED": "0.1",
    "TOPHAT_VERIFIER_MEMORY": "8G",
    "TOPHAT_VERIFIER_MEMORY_RESERVED": "512M",
    "TOPHAT_STREAMER_CPUS": "2",
}
# Swarm secret name -> the file `tophat mesh-secrets` writes for it
SECRET_FILES = {
    "tophat_mesh_secrets": "tophat-mesh.env",
    "tophat_device_secrets": "tophat-device.env",
    "tophat_signing_keys": "signing-keys.json",
    "tophat_redis_conf": "redis.conf",
    "tophat_tls_ca": "ca.pem",
    "tophat_tls_cert": "server.pem",
    "tophat_tls_key": "server-key.pem",
}
TLS_HOSTS = "state-monitor,chunk-planner,verifier-cloud,token-streamer,localhost,127.0.0.1"


def run(*args: str, timeout: float = 120, check: bool = True, env: dict | None = None) -> str:
    result = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})}
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def docker(*args: str, timeout: float = 120, check: bool = True, env: dict | None = None) -> str:
    return run("docker", *args, timeout=timeout, check=check, env=env)


def services() -> dict[str, str]:
    """{service name: "running/desired"} of the stack."""
    out = docker(
        "service", "ls", "--filter", f"label=com.docker.stack.namespace={STACK}", "--format", "{{.Name}} {{.Replicas}}"
    )
    return dict(line.split(" ", 1) for line in out.splitlines())


def containers(all_states: bool = False) -> list[str]:
    return docker(
        "ps",
        *(["-a"] if all_states else []),
        "--filter",
        f"label=com.docker.stack.namespace={STACK}",
        "--format",
        "{{.ID}}",
    ).split()


def health(container: str) -> str:
    return docker(
        "inspect", "--format", "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}", container, check=False
    ).strip()


def logs() -> str:
    out = []
    for name in services():
        out.append(
            f"--- {name}\n"
            + run("docker", "service", "logs", "--tail", "30", "--no-trunc", name, timeout=60, check=False)
        )
    return "\n".join(out)


def wait_for(what: str, ready, deadline_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = ready()
        except (httpx.HTTPError, subprocess.SubprocessError, AssertionError, ValueError) as exc:
            last = repr(exc)
        else:
            if last is True:
                return
        time.sleep(every_s)
    raise AssertionError(f"{what} not within {deadline_s:.0f} s (last: {last!r})\n{logs()}")


def all_running_and_healthy(replicas: dict[str, int]) -> bool | str:
    current = services()
    wanted = {f"{STACK}_{name}": f"{n}/{n}" for name, n in replicas.items()}
    if any(current.get(name) != state for name, state in wanted.items()):
        return f"services {current}"
    states = [health(c) for c in containers()]
    return True if states and all(s == "healthy" for s in states) else f"health {states}"


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def ready_devices(ca: Path) -> int:
    response = httpx.get(f"{STREAMER}/readyz", timeout=5, verify=trusting(ca))
    return int(response.json().get("ready_devices", 0)) if response.status_code in (200, 503) else -1


def streamed_chat_answer(ca: Path, api_key: str, timeout: float = 300) -> str:
    client = openai.OpenAI(
        base_url=f"{STREAMER}/v1",
        api_key=api_key,
        timeout=timeout,
        max_retries=0,
        http_client=httpx.Client(verify=trusting(ca), timeout=timeout),
    )
    stream = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def serving_again(ca: Path, api_key: str, expected: str, deadline_s: float) -> None:
    def answered() -> bool | str:
        try:
            got = streamed_chat_answer(ca, api_key, timeout=120)
        except openai.OpenAIError as exc:
            return repr(exc)
        assert got == expected, got
        return True

    wait_for("a streamed answer", answered, deadline_s, every_s=3)


def project_leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.stack.namespace={STACK}"
    swarm_active = docker("info", "--format", "{{.Swarm.LocalNodeState}}").strip() == "active"
    return {
        "services": docker("service", "ls", "--filter", label, "-q").split() if swarm_active else [],
        "containers": containers(all_states=True),
        "networks": docker("network", "ls", "--filter", label, "-q").split(),
        "secrets": [s for s in docker("secret", "ls", "--format", "{{.Name}}").split() if s in SECRET_FILES]
        if swarm_active
        else [],
        "configs": [c for c in docker("config", "ls", "--format", "{{.Name}}").split() if c.startswith("tophat_")]
        if swarm_active
        else [],
    }


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """A single-node swarm with the stack's secrets; (the CA file, the API key). Left, whatever happens."""
    if docker("info", "--format", "{{.Swarm.LocalNodeState}}").strip() != "active":
        docker("swarm", "init", "--advertise-addr", "127.0.0.1")
    try:
        node = json.loads(docker("node", "inspect", "self"))[0]
        gpus = [
            r
            for r in node["Description"]["Resources"].get("GenericResources") or []
            if r.get("DiscreteResourceSpec", {}).get("Kind") == "NVIDIA-GPU"
        ]
        assert gpus and gpus[0]["DiscreteResourceSpec"]["Value"] >= 8, (
            "the engine must advertise NVIDIA-GPU=8 (node-generic-resources in /etc/docker/daemon.json, as "
            f".ci/docker-up.sh writes it), got {node['Description']['Resources']}"
        )
        node_id = docker("info", "--format", "{{.Swarm.NodeID}}").strip()
        docker(
            "node",
            "update",
            "--label-add",
            "tophat.gpu-server=true",
            "--label-add",
            "tophat.device=true",
            "--label-add",
            "tophat.speed=orin",
            node_id,
        )
        secrets_dir = tmp_path_factory.mktemp("swarm-secrets")
        api_key = "swarm-ci-key"
        # one bootstrap token per agent the test runs: swarm/one-host.yml names each {{.Node.Hostname}}-{{.Task.Slot}}
        hostname = docker("info", "--format", "{{.Name}}").strip()
        devices = [arg for slot in (1, 2, 3) for arg in ("--device", f"{hostname}-{slot}")]
        run(
            str(REPO / ".venv" / "bin" / "tophat"),
            "mesh-secrets",
            "--out",
            str(secrets_dir),
            "--api-key",
            api_key,
            "--tls-hosts",
            TLS_HOSTS,
            *devices,
        )
        for name, file in SECRET_FILES.items():
            docker("secret", "rm", name, check=False)
            docker("secret", "create", name, str(secrets_dir / file))
        yield secrets_dir / "ca.pem", api_key
    finally:
        docker("stack", "rm", STACK, check=False)
        docker("swarm", "leave", "--force", check=False, timeout=120)


def test_the_stack_deploys_serves_scales_heals_rolls_back_and_leaves_nothing(swarm, expected_answer):  # noqa: F811
    ca, api_key = swarm
    timings = {}
    started = time.monotonic()
    docker("stack", "deploy", "--resolve-image", "never", *FILES, STACK, timeout=300, env=ONE_HOST)
    assert set(services()) == {
        f"{STACK}_{name}"
        for name in (
            "redis",
            "state-monitor",
            "chunk-planner",
            "verifier-cloud",
            "token-streamer",
            "device-agent-orin",
            "device-agent-xavier",
        )
    }
    one_each = {
        "redis": 1,
        "state-monitor": 1,
        "chunk-planner": 1,
        "verifier-cloud": 1,
        "token-streamer": 1,
        "device-agent-orin": 1,
        "device-agent-xavier": 0,
    }
    wait_for("every task running and healthy", lambda: all_running_and_healthy(one_each), 900, every_s=3)
    timings["deploy -> every task healthy"] = time.monotonic() - started
    wait_for("the streamer routing to a device", lambda: ready_devices(ca) == 1, 300)
    timings["deploy -> serving"] = time.monotonic() - started
    assert streamed_chat_answer(ca, api_key) == expected_answer, logs()

    # Scaling the device agents: the new agent announces itself and the streamer routes to both.
    scaled = time.monotonic()
    docker("service", "scale", "--detach", f"{STACK}_device-agent-orin=2")
    wait_for("the streamer seeing 2 devices", lambda: ready_devices(ca) == 2, 600)
    timings["scale to 2 agents -> both routed"] = time.monotonic() - scaled

    # A task's container dies (SIGKILL to its init, from the host, as an OOM kill would): Swarm replaces it.
    verifier = docker(
        "ps", "--filter", f"label=com.docker.swarm.service.name={STACK}_verifier-cloud", "--format", "{{.ID}}"
    ).split()
    assert len(verifier) == 1
    killed = time.monotonic()
    os.kill(int(docker("inspect", "--format", "{{.State.Pid}}", verifier[0]).strip()), signal.SIGKILL)

    def replaced() -> bool | str:
        now = docker(
            "ps", "--filter", f"label=com.docker.swarm.service.name={STACK}_verifier-cloud", "--format", "{{.ID}}"
        ).split()
        return True if now and now != verifier and health(now[0]) == "healthy" else f"verifier containers {now}"

    wait_for("Swarm replacing the killed verifier", replaced, 600)
    timings["kill -> replacement healthy"] = time.monotonic() - killed
    serving_again(ca, api_key, expected_answer, 600)
    timings["kill -> serving again"] = time.monotonic() - killed

    # An update to an image that does not exist fails its tasks; update_config's failure_action rolls it back.
    # The planner: start-first, and its new task fits beside the old on one node (the streamer's published port
    # is a node resource, so its start-first task could never be placed here, and would stay pending).
    planner = f"{STACK}_chunk-planner"
    updated = time.monotonic()
    docker("service", "update", "--detach", "--image", "tophat:does-not-exist", planner)

    def rolled_back() -> bool | str:
        state = docker(
            "service", "inspect", "--format", "{{if .UpdateStatus}}{{.UpdateStatus.State}}{{end}}", planner
        ).strip()
        image = docker("service", "inspect", "--format", "{{.Spec.TaskTemplate.ContainerSpec.Image}}", planner).strip()
        return True if state == "rollback_completed" and image.split("@")[0] == IMAGE else f"{state} {image}"

    wait_for("the bad update rolled back", rolled_back, 600, every_s=3)
    timings["bad image -> rolled back"] = time.monotonic() - updated
    serving_again(ca, api_key, expected_answer, 300)

    # Removal: the stack, then the swarm; nothing of the project stays behind.
    docker("stack", "rm", STACK)
    wait_for("the stack's containers gone", lambda: containers(all_states=True) == [], 300)
    for name in SECRET_FILES:  # external: `docker stack rm` leaves them, the operator removes them
        docker("secret", "rm", name)
    docker("swarm", "leave", "--force", timeout=120)
    assert project_leftovers() == {"services": [], "containers": [], "networks": [], "secrets": [], "configs": []}
    print("\n" + "\n".join(f"{what:36s} {seconds:6.1f} s" for what, seconds in timings.items()))
