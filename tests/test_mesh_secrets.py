"""tophatctl/mesh_secrets.py: the secret files a compose deployment mounts."""

from __future__ import annotations

import os
import stat

from shared.settings import SETTINGS_FILE_VAR
from tophatctl.mesh_secrets import make_mesh_secrets


def test_secrets_are_private_fresh_and_load_into_every_service(tmp_path):
    from services.chunk_planner.settings import load_settings as planner
    from services.device_agent.settings import load_settings as device
    from services.state_monitor.settings import load_settings as monitor
    from services.token_streamer.settings import load_settings as streamer
    from services.verifier_cloud.settings import load_settings as verifier

    env_path, conf_path = make_mesh_secrets(tmp_path / "s", api_key="k-123")
    for path in (env_path, conf_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    environ = {SETTINGS_FILE_VAR: str(env_path)}
    loaded = [load(environ) for load in (planner, device, monitor, streamer, verifier)]
    secrets = {s.auth_secret for s in loaded}
    assert len(secrets) == 1 and len(secrets.pop()) >= 40  # one mesh secret, for every service
    password = monitor(environ).redis_password
    assert conf_path.read_text() == f"requirepass {password}\n" and len(password) >= 40
    assert streamer(environ).api_key == "k-123"
    assert "k-123" not in repr(streamer(environ)) and password not in repr(monitor(environ))
    again, _ = make_mesh_secrets(tmp_path / "s")
    assert monitor({SETTINGS_FILE_VAR: str(again)}).redis_password != password  # fresh each time


def test_tls_lines_point_at_the_mounted_certificates(tmp_path):
    from cryptography import x509

    from services.device_agent.settings import load_settings as device
    from services.verifier_cloud.settings import load_settings as verifier
    from tophatctl.mesh_secrets import MOUNTED

    env_path, _ = make_mesh_secrets(tmp_path, tls_hosts=["verifier-cloud", "127.0.0.1"])
    environ = {SETTINGS_FILE_VAR: str(env_path)}
    assert verifier(environ).tls_cert == str(MOUNTED / "server.pem") and verifier(environ).tls_ca.endswith("ca.pem")
    assert device(environ).tls_cert == "" and device(environ).tls_ca == str(MOUNTED / "ca.pem")  # devices: plain
    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "verifier-cloud" in names.get_values_for_type(x509.DNSName)
    assert stat.S_IMODE(os.stat(tmp_path / "server-key.pem").st_mode) == 0o600
