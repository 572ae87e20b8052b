"""EmbeddedRedis runs the real redis-server binary; these tests keep it honest."""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.processes.redis_server import EmbeddedRedis, EmbeddedRedisError, redis_server_executable, resolve_redis_url
from shared.telemetry import sink as tk


def test_executable_is_bundled_binary() -> None:
    assert redis_server_executable().endswith("redis-server")


def test_start_ping_and_no_persistence() -> None:
    with EmbeddedRedis() as server:
        assert server.running
        assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            assert client.ping()
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
        finally:
            client.close()
    assert not server.running


def test_restart_reuses_port_and_starts_empty() -> None:
    server = EmbeddedRedis().start()
    try:
        port = server.port
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        client.close()
        server.stop()
        assert not server.running
        server.start()
        assert server.port == port
        client = redis.Redis.from_url(server.url)
        assert client.get("k") is None
        client.close()
    finally:
        server.stop()


def test_port_in_use_fails_clearly() -> None:
    with EmbeddedRedis() as first:
        with pytest.raises(EmbeddedRedisError):
            EmbeddedRedis(first.port, startup_timeout=5).start()
        assert redis.Redis.from_url(first.url).ping()


def test_url_before_start_raises() -> None:
    with pytest.raises(EmbeddedRedisError):
        _ = EmbeddedRedis().url


def test_resolve_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert resolve_redis_url(None) is None
    assert resolve_redis_url("") is None
    monkeypatch.setenv("REDIS_URL", "redis://env:6379/0")
    assert resolve_redis_url(None) == "redis://env:6379/0"
    assert resolve_redis_url("redis://explicit:1/0") == "redis://explicit:1/0"


# --- Redis refuses an unauthenticated client (issue 12: "let no one in") ---


@pytest.fixture(scope="module")
def locked() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def test_client_without_password_is_refused(locked: EmbeddedRedis) -> None:
    # No retries: redis-py counts AuthenticationError as a ConnectionError and would back off and retry it.
    client = redis.Redis(host=locked.host, port=locked.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        # The server answers NOAUTH (to HELLO or to the command), which redis-py raises as AuthenticationError.
        with pytest.raises(redis.AuthenticationError, match="authenticated|Authentication required"):
            client.set("k", "v")
    finally:
        client.close()


def test_client_with_wrong_password_is_refused(locked: EmbeddedRedis) -> None:
    client = redis.Redis(
        host=locked.host,
        port=locked.port,
        password="not-" + locked.password,
        socket_timeout=5,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        with pytest.raises(redis.AuthenticationError, match="WRONGPASS|invalid"):
            client.ping()
    finally:
        client.close()


def test_url_carries_the_credentials_and_the_server_is_locked_down(locked: EmbeddedRedis) -> None:
    assert len(locked.password) >= 32
    assert locked.url == f"redis://:{locked.password}@127.0.0.1:{locked.port}/0"
    client = redis.Redis.from_url(locked.url, decode_responses=True, socket_timeout=5)
    try:
        assert client.ping()
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
    finally:
        client.close()


def test_password_stays_out_of_the_command_line_and_logs(locked: EmbeddedRedis) -> None:
    cmdline = Path(f"/proc/{locked.pid}/cmdline").read_bytes()
    assert b"redis-server" in cmdline
    assert locked.password.encode() not in cmdline
    assert locked.password not in tk.redact_url(locked.url)
    assert tk.redact_url(locked.url) == f"redis://***@127.0.0.1:{locked.port}/0"


def test_config_file_is_private(locked: EmbeddedRedis) -> None:
    conf = locked.config_path
    assert locked.password in conf.read_text()  # it is where the secret lives...
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # ...so only our user may read it
    assert stat.S_IMODE(conf.parent.stat().st_mode) == 0o700


def test_each_server_gets_its_own_password_and_keeps_it_across_restarts() -> None:
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.password != b.password
        url = a.url
        a.stop()
        a.start()  # clients holding the old URL must reconnect after an outage
        assert a.url == url
        client = redis.Redis.from_url(url, socket_timeout=5)
        try:
            assert client.ping()
        finally:
            client.close()


def test_start_logs_no_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="shared.processes.redis_server")
    with EmbeddedRedis() as server:
        password = server.password
    assert caplog.records and not any(password in r.getMessage() for r in caplog.records)


def test_mesh_listing_hides_the_redis_password() -> None:
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig

    mesh = Mesh(MeshConfig(model_dir="demo"))
    mesh.redis_url = "redis://:s3cret-pw@127.0.0.1:6390/0"  # what start() takes from EmbeddedRedis.url
    listing = mesh.urls()  # `tophat up` and the demo print this
    assert listing["redis"] == "redis://***@127.0.0.1:6390/0"
    assert not any("s3cret-pw" in url for url in listing.values())


def test_state_monitor_embeds_a_locked_redis_and_logs_no_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import services.state_monitor.__main__ as monitor_main
    import shared.processes.service_main as service_main

    for name in ("REDIS_URL", "TOPHAT_STATE_MONITOR_REDIS_URL", "TOPHAT_STATE_MONITOR_EMBEDDED_REDIS"):
        monkeypatch.delenv(name, raising=False)
    given_urls: list[str] = []
    real_create_app = monitor_main.create_app
    monkeypatch.setattr(monitor_main, "create_app", lambda s: given_urls.append(s.redis_url) or real_create_app(s))
    served: list[str] = []

    def fake_run(app: object, **_: object) -> None:  # stands in for uvicorn: the embedded server is up now
        client = redis.Redis.from_url(given_urls[0], socket_timeout=5)
        try:
            assert client.ping()  # the URL the app was given authenticates
        finally:
            client.close()
        served.append(given_urls[0])

    monkeypatch.setattr(service_main.uvicorn, "run", fake_run)
    caplog.set_level(logging.INFO)
    monitor_main.main()
    assert len(served) == 1
    password = redis.connection.parse_url(served[0])["password"]
    assert password and len(password) >= 32
    assert not any(password in r.getMessage() for r in caplog.records)
    assert any("***@127.0.0.1" in r.getMessage() for r in caplog.records)


def test_only_loopback_addresses_are_accepted() -> None:
    with pytest.raises(EmbeddedRedisError, match="loopback"):
        EmbeddedRedis(host="0.0.0.0")
    assert EmbeddedRedis(host="::1").host == "::1"


def test_with_password_adds_credentials_only_where_none_are_given():
    from shared.processes.redis_server import with_password

    assert with_password("redis://redis:6379/0", "p@ss/w") == "redis://:p%40ss%2Fw@redis:6379/0"
    assert with_password("redis://:given@redis:6379/0", "other") == "redis://:given@redis:6379/0"
    assert with_password("redis://user:given@redis:6379/0", "other") == "redis://user:given@redis:6379/0"
    assert with_password("redis://redis:6379/0", "") == "redis://redis:6379/0"
