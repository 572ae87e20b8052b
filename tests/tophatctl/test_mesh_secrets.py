"""tophatctl/mesh_secrets.py: the secret files a compose deployment mounts."""

from __future__ import annotations

import os
import stat

from shared.auth import verify as auth
from shared.auth.signing import KeyRing
from shared.settings import SETTINGS_FILE_VAR
from tophatctl.mesh_secrets import make_mesh_secrets


def test_secrets_are_private_fresh_and_load_into_every_service(tmp_path):
    from services.chunk_planner.settings import load_settings as planner
    from services.device_agent.settings import load_settings as device
    from services.state_monitor.settings import load_settings as monitor
    from services.token_streamer.settings import load_settings as streamer
    from services.verifier_cloud.settings import load_settings as verifier

    env_path, device_path, keys_path, conf_path = make_mesh_secrets(tmp_path / "s", api_key="k-123")
    for path in (env_path, device_path, keys_path, conf_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    environ = {SETTINGS_FILE_VAR: str(env_path)}
    cloud = [load(environ) for load in (planner, monitor, streamer, verifier)]
    assert all(s.authenticated for s in cloud)  # the planner, streamer, verifier by the issuer; the monitor by its key
    assert monitor(environ).auth_key_file == "/run/secrets/signing-keys.json"
    # The signing key is in its own file, for the monitor alone; the others hold public keys' users' tokens.
    ring = KeyRing.load(keys_path)
    trust = auth.TokenVerifier(auth.Trust.from_document(ring.jwks()))
    assert trust.verify(streamer(environ).auth_credential, auth.ISSUER).role == "service"
    assert trust.verify(verifier(environ).auth_credential, auth.ISSUER).subject == "verifier-cloud"
    # A device reads its own file: the issuer and its own id's bootstrap token, nothing that signs or serves.
    on_device = device({SETTINGS_FILE_VAR: str(device_path)})
    claims = trust.verify(on_device.auth_credential, auth.ISSUER)
    assert (claims.role, claims.subject) == ("bootstrap", "device-1")
    assert on_device.auth_issuer_url == "http://state-monitor:8020"
    assert "PRIVATE" not in device_path.read_text() and "service" not in device_path.read_text()
    password = monitor(environ).redis_password
    assert conf_path.read_text() == f"requirepass {password}\n" and len(password) >= 40
    assert streamer(environ).api_key == "k-123"
    assert "k-123" not in repr(streamer(environ)) and password not in repr(monitor(environ))
    assert streamer(environ).auth_credential not in repr(streamer(environ))
    again, *_ = make_mesh_secrets(tmp_path / "s")
    assert monitor({SETTINGS_FILE_VAR: str(again)}).redis_password != password  # fresh each time
    assert KeyRing.load(keys_path).active != ring.active


def test_tls_lines_point_at_the_mounted_certificates(tmp_path):
    from cryptography import x509

    from services.device_agent.settings import load_settings as device
    from services.verifier_cloud.settings import load_settings as verifier
    from tophatctl.mesh_secrets import MOUNTED

    env_path, device_path, *_ = make_mesh_secrets(tmp_path, tls_hosts=["verifier-cloud", "127.0.0.1"])
    environ = {SETTINGS_FILE_VAR: str(env_path)}
    assert verifier(environ).tls_cert == str(MOUNTED / "server.pem") and verifier(environ).tls_ca.endswith("ca.pem")
    on_device = device({SETTINGS_FILE_VAR: str(device_path)})
    assert on_device.tls_cert == "" and on_device.tls_ca == str(MOUNTED / "ca.pem")  # devices: plain
    assert on_device.auth_issuer_url == "https://state-monitor:8020"
    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "verifier-cloud" in names.get_values_for_type(x509.DNSName)
    assert stat.S_IMODE(os.stat(tmp_path / "server-key.pem").st_mode) == 0o600


def test_one_bootstrap_token_per_device_id_and_each_device_uses_its_own(tmp_path):
    import pytest

    from services.device_agent.settings import load_settings as device
    from shared.auth.client import own_bootstrap

    _, device_path, keys_path, _ = make_mesh_secrets(tmp_path, device_ids=["jetson-07", "jetson-08"])
    trust = auth.TokenVerifier(auth.Trust.from_document(KeyRing.load(keys_path).jwks()))
    credential = device({SETTINGS_FILE_VAR: str(device_path)}).auth_credential
    for device_id in ("jetson-07", "jetson-08"):
        claims = trust.verify(own_bootstrap(credential, device_id), auth.ISSUER)
        assert (claims.role, claims.subject) == ("bootstrap", device_id)
    with pytest.raises(ValueError, match="jetson-09"):
        own_bootstrap(credential, "jetson-09")
    for bad in ([], ["*"], ["a b"]):  # none, a fleet's, no id
        with pytest.raises(ValueError):
            make_mesh_secrets(tmp_path / "bad", device_ids=bad)
