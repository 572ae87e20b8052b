"""EmbeddedRedis runs the real redis-server binary; these tests keep it honest."""

from __future__ import annotations

import redis
import pytest

from shared.redis_server import EmbeddedRedis, EmbeddedRedisError, redis_server_executable, resolve_redis_url


def test_executable_is_bundled_binary() -> None:
    assert redis_server_executable().endswith("redis-server")


def test_start_ping_and_no_persistence() -> None:
    with EmbeddedRedis() as server:
        assert server.running
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
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
