"""docker-compose*.yml, tophat.env and the Dockerfile, checked offline (the containers themselves run in
tests/deploy, `make test-deploy`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_manifests import check_settings, read_env_file

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
COMPOSE = REPO / "docker-compose.yml"
OVERRIDES = [REPO / "docker-compose.host.yml", REPO / "docker-compose.gpu.yml"]
MESH = {"redis", "state-monitor", "chunk-planner", "verifier-cloud", "device-agent", "device-agent-2", "token-streamer"}


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


def rendered(*overrides: Path) -> dict:
    files = [arg for path in (COMPOSE, *overrides) for arg in ("-f", str(path))]
    result = run(str(VENV_BIN / "docker-compose"), *files, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_files_match_the_compose_spec():
    result = run(
        str(VENV_BIN / "check-jsonschema"),
        "--builtin-schema",
        "vendor.compose-spec",
        str(COMPOSE),
        *map(str, OVERRIDES),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overrides", [(), (OVERRIDES[0],), (OVERRIDES[1],)], ids=["base", "host", "gpu"])
def test_every_service_is_healthchecked_restarted_and_ordered(overrides):
    services = rendered(*overrides)["services"]
    assert set(services) == MESH
    for name, svc in services.items():
        assert svc["healthcheck"]["test"][0] == "CMD", name
        assert svc["restart"] == "unless-stopped" and svc["init"] is True and svc["pull_policy"] == "never", name
        for dependency in svc.get("depends_on", {}).values():
            assert dependency["condition"] == "service_healthy", name
    order = {
        "state-monitor": "redis",
        "chunk-planner": "state-monitor",
        "verifier-cloud": "state-monitor",
        "device-agent": "verifier-cloud",
        "device-agent-2": "verifier-cloud",
        "token-streamer": "device-agent",
    }
    for name, first in order.items():
        assert first in services[name]["depends_on"], name
    device = services["device-agent"]["environment"]
    assert device["TOPHAT_DEVICE_DEVICE_ID"] == "device-1"  # its own bootstrap token's id (mesh-secrets --device)
    assert services["device-agent-2"]["environment"]["TOPHAT_DEVICE_DEVICE_ID"] == "device-2"
    assert "TOPHAT_STREAMER_DEVICE_URLS" not in services["token-streamer"]["environment"]  # discovered
    (volume,) = services["redis"]["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == ("volume", "redis-data", "/opt/tophat/redis")


def test_host_networking_keeps_everything_on_loopback():
    services = rendered(OVERRIDES[0])["services"]
    for name, svc in services.items():
        assert svc["network_mode"] == "host", name
        for key, value in svc.get("environment", {}).items():
            if key.endswith("_HOST"):
                assert value == "127.0.0.1", (name, key)
            if "://" in str(value):
                assert "127.0.0.1" in value, (name, key, value)
    assert services["device-agent"]["environment"]["TOPHAT_DEVICE_PORT"] == "0"
    assert services["device-agent-2"]["environment"]["TOPHAT_DEVICE_PORT"] == "0"


def test_compose_settings_are_real_and_load():
    env_file = read_env_file(REPO / "tophat.env")
    for overrides in [(), (OVERRIDES[0],), (OVERRIDES[1],)]:
        for name, svc in rendered(*overrides)["services"].items():
            module = next((part for part in svc["command"] if part.startswith("services.")), None)
            if module is not None:
                check_settings(module, {**env_file, **svc["environment"]}, f"compose {name}")


def test_a_misspelt_setting_is_caught():
    with pytest.raises(AssertionError, match="TOPHAT_DEVICE_MAX_DRAFTS is not a setting"):
        check_settings("services.device_agent", {"TOPHAT_DEVICE_MAX_DRAFTS": "8"}, "probe")


def test_dockerfile_is_hadolint_clean_and_has_the_three_targets(tmp_path):
    result = run(str(VENV_BIN / "hadolint"), "Dockerfile")
    assert result.returncode == 0, result.stdout
    text = (REPO / "Dockerfile").read_text()
    assert {"cpu", "cuda", "jetson"} <= {line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")}
    assert text.count("USER 10001") == 3 and text.count('ENTRYPOINT ["tini"') == 3 and text.count("\nHEALTHCHECK ") == 3
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM debian\nRUN apt-get install -y curl\n")  # unpinned, no update, no cleanup
    assert run(str(VENV_BIN / "hadolint"), str(broken)).returncode != 0


def test_only_the_monitor_mounts_the_signing_key_and_devices_only_their_bootstrap_file():
    services = rendered()["services"]
    mounts = {name: {s["source"] for s in svc.get("secrets", [])} for name, svc in services.items()}
    assert [name for name, sources in mounts.items() if "signing-keys.json" in sources] == ["state-monitor"]
    assert mounts["device-agent"] == {"tophat-device", "ca.pem"}
    assert services["device-agent"]["environment"]["TOPHAT_SETTINGS_FILE"] == "/run/secrets/tophat-device.env"
    assert mounts["device-agent-2"] == {"tophat-device", "ca.pem"}
    assert not [
        name for name, sources in mounts.items() if "tophat-device" in sources and not name.startswith("device-")
    ]
