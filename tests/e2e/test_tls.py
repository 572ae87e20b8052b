"""TLS on every hop: the development CA helper's certificates, and one real mesh started with `tls=True`
whose every service answers only TLS, refuses clients that do not trust its CA, whose devices reach the
verifier over wss, and whose greedy output through the streamer is still the unsplit model's."""

from __future__ import annotations

import ipaddress
import ssl
import stat

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from websockets.exceptions import InvalidMessage, InvalidStatus
from websockets.sync.client import connect as ws_connect

from services.token_streamer.settings import load_settings as streamer_settings
from shared.auth.tls import TLSConfigError, client_context, server_context, websocket_ssl
from shared.settings import SettingsError
from shared.specdec.reference import generate_full
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.certs import make_dev_certs, parse_hosts
from tophatctl.demo_model.corpus import held_out_prompts
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

MAX_TOKENS = 16


# -- the dev-CA helper ---------------------------------------------------------------------------------


def test_dev_certs_sign_a_server_certificate_for_every_host_with_owner_only_keys(tmp_path):
    certs = make_dev_certs(tmp_path / "tls", parse_hosts("127.0.0.1, localhost,verifier,localhost"))
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())

    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "verifier"]
    server.verify_directly_issued_by(ca)  # raises unless the CA's key signed it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    for key in (certs.ca_key, certs.server_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # the pair loads as a server context, and the CA as a client's trust
    assert server_context(str(certs.server_cert), str(certs.server_key)) is not None
    assert client_context(str(certs.ca_cert)).verify_mode == ssl.CERT_REQUIRED


def test_dev_certs_replace_files_already_there_still_owner_only(tmp_path):
    first = make_dev_certs(tmp_path, ["localhost"])
    first.server_key.chmod(0o644)
    again = make_dev_certs(tmp_path, ["localhost"])
    assert stat.S_IMODE(again.server_key.stat().st_mode) == 0o600
    assert again.server_cert.read_bytes() != b""


def test_tls_settings_need_cert_and_key_together_and_plain_stays_plain(tmp_path):
    with pytest.raises(SettingsError, match="tls_cert and tls_key"):
        streamer_settings({"TOPHAT_STREAMER_TLS_CERT": str(tmp_path / "server.pem")})
    assert server_context("", "") is None
    with pytest.raises(TLSConfigError):
        server_context(str(tmp_path / "missing.pem"), str(tmp_path / "missing-key.pem"))
    with pytest.raises(TLSConfigError):
        client_context(str(tmp_path / "missing-ca.pem"))
    assert websocket_ssl("ws://127.0.0.1:1/ws") is None
    assert isinstance(websocket_ssl("wss://127.0.0.1:1/ws"), ssl.SSLContext)


# -- one real mesh with tls=True ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_mesh():
    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1), tls=True)
    with Mesh(config) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def trusting(tls_mesh):
    return client_context(str(tls_mesh.certs.ca_cert))


def _http_endpoints(mesh: Mesh) -> dict[str, str]:
    cfg = mesh.config
    return {
        "token-streamer": f"{cfg.streamer_url}/readyz",
        "chunk-planner": f"{cfg.planner_url}/readyz",
        "state-monitor": f"{cfg.monitor_url}/readyz",
        "device-agent-0": f"{cfg.device_url(0)}/readyz",
        "verifier-cloud": f"https://{cfg.host}:{cfg.verifier_port}/readyz",
    }


@pytest.mark.slow
def test_every_service_answers_tls_and_refuses_plain_http(tls_mesh, trusting):
    handed_out = {name: url for name, url in tls_mesh.urls().items() if name != "redis"}
    assert all(url.startswith(("https://", "wss://")) for url in handed_out.values()), handed_out
    endpoints = _http_endpoints(tls_mesh)
    with httpx.Client(verify=trusting, timeout=5) as client:
        for name, url in endpoints.items():
            assert client.get(url).status_code == 200, name
    with httpx.Client(timeout=5) as plain:
        for name, url in endpoints.items():
            with pytest.raises(httpx.TransportError):  # the TLS port drops a request in the clear
                plain.get("http://" + url.removeprefix("https://"))
                pytest.fail(f"{name} answered plain http")


def test_a_client_that_does_not_trust_the_mesh_ca_is_refused(tls_mesh):
    untrusting = client_context()  # the system's CAs only
    with httpx.Client(verify=untrusting, timeout=5) as client:
        for name, url in _http_endpoints(tls_mesh).items():
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                client.get(url)
                pytest.fail(f"{name} accepted a client that does not trust its CA")


def test_the_device_reaches_the_verifier_over_wss_only(tls_mesh, trusting):
    cfg = tls_mesh.config
    device = next(s for s in tls_mesh.services if s.name == "device-agent-0")
    assert device.env["TOPHAT_DEVICE_VERIFIER_URL"] == f"wss://{cfg.host}:{cfg.verifier_port}/ws"
    assert f"connected to verifier wss://{cfg.host}:{cfg.verifier_port}/ws" in device.log_path.read_text()
    # generous open timeouts: what is asserted is how each attempt ends, and under make test's load a busy
    # verifier once took over 5 s to answer a TLS handshake (CI, 2026-11-27)
    with pytest.raises((OSError, InvalidMessage)):  # ws:// in the clear: the TLS port closes on it
        with ws_connect(f"ws://{cfg.host}:{cfg.verifier_port}/ws", open_timeout=30):
            pass
    with pytest.raises(ssl.SSLCertVerificationError):
        with ws_connect(f"wss://{cfg.host}:{cfg.verifier_port}/ws", ssl=client_context(), open_timeout=30):
            pass
    # Trusting the CA, the TLS handshake and the HTTP upgrade go through: the verifier answers (it may then
    # refuse the upgrade for want of a credential, which is the mesh's authentication, not TLS).
    try:
        with ws_connect(f"wss://{cfg.host}:{cfg.verifier_port}/ws", ssl=trusting, open_timeout=30) as websocket:
            assert websocket.protocol.state.name == "OPEN"
    except InvalidStatus as exc:
        assert exc.response.status_code == 401


@pytest.mark.slow
def test_greedy_completion_over_tls_equals_the_full_model(tls_mesh, trusting, demo_checkpoint):
    tokenizer = demo_checkpoint.tokenizer
    prompt = held_out_prompts(1, seed=11)[0][:160]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = tokenizer.decode(generate_full(demo_checkpoint, ids, MAX_TOKENS).token_ids, skip_special_tokens=True)
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{tls_mesh.config.streamer_url}/v1/completions", json=body, verify=trusting, timeout=120)
    response.raise_for_status()
    assert response.json()["choices"][0]["text"] == expected
