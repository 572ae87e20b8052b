"""A mesh process's environment (tophatctl/process_env.py): layered in order, and of the credentials only its own
service's, whether they come from the launcher's environment or the mesh."""

from __future__ import annotations

import pytest

from tophatctl.process_env import process_env

MESH_AUTH = {
    "TOPHAT_VERIFIER_AUTH_CREDENTIAL": "verifier-token",
    "TOPHAT_DEVICE_AUTH_CREDENTIAL": "device-token",
    "TOPHAT_STATE_MONITOR_AUTH_KEY_FILE": "/keys.json",
}


def env_for(module: str, own: dict[str, str], extra: dict[str, str] | None = None) -> dict[str, str]:
    return process_env(
        module,
        own,
        tls_env={"TOPHAT_TLS_CA": "/ca.pem", "LAYER": "tls"},
        extra_env=extra or {},
        tether_env={"TOPHAT_TETHER_FD": "7"},
        auth_env=MESH_AUTH,
    )


def test_a_device_agent_gets_its_own_credential_and_no_service_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOPHAT_STREAMER_AUTH_CREDENTIAL", "inherited")  # the launcher's own environment
    env = env_for("services.device_agent", {"TOPHAT_DEVICE_PORT": "9001"})
    secrets = sorted(k for k in env if k.endswith(("_AUTH_CREDENTIAL", "_AUTH_KEY_FILE")))
    assert secrets == ["TOPHAT_DEVICE_AUTH_CREDENTIAL"]
    assert env["TOPHAT_DEVICE_AUTH_CREDENTIAL"] == "device-token"
    assert env["TOPHAT_DEVICE_PORT"] == "9001" and env["TOPHAT_TETHER_FD"] == "7"
    assert env["PYTHONUNBUFFERED"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_the_issuer_alone_gets_the_key_file() -> None:
    assert env_for("services.state_monitor", {})["TOPHAT_STATE_MONITOR_AUTH_KEY_FILE"] == "/keys.json"
    assert "TOPHAT_STATE_MONITOR_AUTH_KEY_FILE" not in env_for("services.verifier_cloud", {})


def test_layers_override_in_order_and_a_set_credential_beats_the_meshs() -> None:
    env = env_for(
        "services.verifier_cloud",
        {"LAYER": "own", "TOPHAT_VERIFIER_AUTH_CREDENTIAL": "given"},
        extra={"LAYER": "extra", "OMP_NUM_THREADS": "4"},
    )
    assert env["LAYER"] == "own"  # the service's own env over the mesh's extra_env over TLS
    assert env["OMP_NUM_THREADS"] == "4"  # extra_env over the defaults
    assert env["TOPHAT_VERIFIER_AUTH_CREDENTIAL"] == "given"
    from_extra = env_for("services.verifier_cloud", {}, extra={"TOPHAT_VERIFIER_AUTH_CREDENTIAL": "extra"})
    assert from_extra["TOPHAT_VERIFIER_AUTH_CREDENTIAL"] == "extra"
