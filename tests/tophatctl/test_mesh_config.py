"""The local mesh's parts that start no process: its checked config, port layout, per-service settings,
credentials and restart policy (tophatctl/mesh_config.py, mesh_ports.py, mesh_settings.py,
mesh_credentials.py, supervisor.py)."""

from __future__ import annotations

import socket

import pytest
from cryptography import x509

from tophatctl.mesh_config import MeshConfig, MeshConfigError, MeshStartError
from tophatctl.mesh_credentials import CLOUD_SERVICES, MeshCredentials
from tophatctl.mesh_ports import find_port_base, layout
from tophatctl.mesh_secrets import SERVICE_PREFIXES
from tophatctl.mesh_settings import announcing_device_env, cloud_urls_env, device_env, verifier_env
from tophatctl.supervisor import RestartPolicy


@pytest.mark.parametrize(
    "fields",
    [
        {"verifiers": 0},
        {"verifiers": 100},
        {"num_devices": 0},
        {"link_mode": "tc"},
        {"port_base": 65_400},
        {"ready_timeout_s": 0},
        {"dtype": "int3"},
    ],
)
def test_a_config_no_mesh_can_run_is_refused_when_made(fields):
    with pytest.raises(MeshConfigError) as refused:
        MeshConfig(**fields)
    assert isinstance(refused.value, MeshStartError) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize("dtype", ["int4", "bf16", "auto"])
def test_the_weights_dtype_reaches_the_verifier_and_every_device(dtype):
    config = MeshConfig(dtype=dtype, num_devices=2)
    named = None if dtype == "auto" else dtype  # auto: each service's own environment decides, else its default
    assert verifier_env(config, 0, "127.0.0.1", "models/demo", {}).get("TOPHAT_VERIFIER_DTYPE") == named
    assert {device_env(config, i, "models/demo").get("TOPHAT_DEVICE_DTYPE") for i in range(2)} == {named}


def test_a_config_changed_after_it_was_made_is_checked_again():
    config = MeshConfig()
    config.verifiers = 0
    with pytest.raises(MeshConfigError, match="verifiers must be 1..99"):
        config.check()


def test_urls_follow_the_port_layout_and_secrets_stay_out_of_repr():
    config = MeshConfig(port_base=9000, verifiers=2, tls=True, api_key="key-1", hidden_rotation="rotation-1")
    assert config.streamer_url == "https://127.0.0.1:9000" and config.planner_url.endswith(":9010")
    assert config.monitor_url.endswith(":9020") and config.device_url(3) == "https://127.0.0.1:9203"
    assert config.verifier_urls("10.0.0.1") == "wss://10.0.0.1:9100/ws,wss://10.0.0.1:9101/ws"
    assert [config.verifier_name(j) for j in range(2)] == ["verifier-cloud", "verifier-cloud-1"]
    assert not [secret for secret in ("key-1", "rotation-1") if secret in repr(config)]
    assert layout(9000, num_devices=2, num_verifiers=2) == [9000, 9010, 9020, 9100, 9101, 9200, 9201]


def test_find_port_base_finds_a_free_layout():
    base = find_port_base(2, num_verifiers=2)
    for port in layout(base, 2, 2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_each_service_is_told_its_own_settings():
    config = MeshConfig(link="lat=5ms;none", speed="3", device_env={"max_sessions": "4"}, hidden_rotation="rot")
    first, second = device_env(config, 0, "/m"), device_env(config, 1, "/m")
    assert (first["TOPHAT_DEVICE_LINK"], second["TOPHAT_DEVICE_LINK"]) == ("lat=5ms", "none")
    assert first["TOPHAT_DEVICE_MAX_SESSIONS"] == "4" and first["TOPHAT_DEVICE_HIDDEN_ROTATION"] == "rot"
    assert cloud_urls_env(config, "10.0.0.1")["TOPHAT_DEVICE_CHUNK_PLANNER_URL"] == "http://10.0.0.1:8010"
    assert announcing_device_env(config, 0, "/m")["TOPHAT_DEVICE_PORT"] == "0"
    verifier = verifier_env(config, 1, "0.0.0.0", "/m", {"TOPHAT_VERIFIER_FULL_MODEL": "true"})
    assert verifier["TOPHAT_VERIFIER_PORT"] == "8101" and verifier["TOPHAT_VERIFIER_FULL_MODEL"] == "true"


def test_devices_budget_over_trees_only_where_the_verifier_takes_them():
    from services.device_agent.settings import load_settings

    single, staged = MeshConfig(), MeshConfig(pipeline_stages=2)
    shapes = {
        stages: [s.name for s in load_settings(device_env(config, 0, "/m")).budget_shapes()]
        for stages, config in ((1, single), (2, staged))
    }
    assert shapes[1] == ["none", "chain", "tree16"]  # the budget is on by default, trees included
    assert shapes[2] == ["none", "chain"]  # a staged verifier refuses trees


def test_credentials_give_the_monitor_the_key_and_each_service_its_own_credential(tmp_path):
    assert MeshCredentials(auth_on=False).auth_env == {} and MeshCredentials(auth_on=False).operator_auth() is None
    credentials = MeshCredentials(auth_on=False)
    credentials.make_keys(tmp_path, "http://m", {})
    assert credentials.auth_env == {} and credentials.device_env("http://m", "d") == {}
    credentials = MeshCredentials(auth_on=True)
    credentials.make_keys(tmp_path, "http://127.0.0.1:8765", {"http://127.0.0.1:8200": "device:device-0"})
    env = credentials.auth_env
    assert env["TOPHAT_STATE_MONITOR_AUTH_KEY_FILE"] == str(credentials.key_file)
    assert {k for k in env if k.endswith("_AUTH_CREDENTIAL")} == {f"{p}AUTH_CREDENTIAL" for p in CLOUD_SERVICES}
    assert len({env[f"{p}AUTH_CREDENTIAL"] for p in CLOUD_SERVICES}) == len(CLOUD_SERVICES)  # one each
    device = credentials.device_env("http://127.0.0.1:8765", "device-0")
    assert set(device) == {"TOPHAT_DEVICE_AUTH_ISSUER_URL", "TOPHAT_DEVICE_AUTH_CREDENTIAL"}
    assert credentials.operator_auth() is not None and credentials.client_verify() is True
    certs = credentials.make_certs(tmp_path, "10.1.2.3", ["10.9.0.1", "127.0.0.1"])
    assert {credentials.tls_env[f"{prefix}TLS_CA"] for prefix in SERVICE_PREFIXES} == {str(certs.ca_cert)}
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "127.0.0.1", "::1", "10.9.0.1"]


def test_restart_policy_is_checked_when_made():
    with pytest.raises(ValueError):
        RestartPolicy(initial_s=5.0, max_s=1.0)
    with pytest.raises(ValueError):
        RestartPolicy(reset_after_s=0)
