"""shared/processes/service_main.py: the uvicorn arguments every service's settings become, and what
run_service does with each kind of thing a `__main__` builds (uvicorn itself stands in by a recorder)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi import FastAPI

import shared.processes.service_main as service_main
from shared.processes.service_main import OnSocket, run_service, uvicorn_options


@dataclass(frozen=True)
class Served:
    host: str = "0.0.0.0"
    port: int = 8123
    log_level: str = "WARNING"
    tls_cert: str = ""
    tls_key: str = ""


def test_plain_settings_listen_on_their_host_and_port_without_tls() -> None:
    assert uvicorn_options(Served()) == {
        "host": "0.0.0.0",
        "port": 8123,
        "log_level": "warning",
        "ssl_certfile": None,
        "ssl_keyfile": None,
    }


def test_a_certificate_and_key_serve_tls_and_a_services_own_option_is_passed_on() -> None:
    options = uvicorn_options(Served(tls_cert="/c.pem", tls_key="/k.pem"), ws_max_size=1 << 20)
    assert (options["ssl_certfile"], options["ssl_keyfile"]) == ("/c.pem", "/k.pem")
    assert options["ws_max_size"] == 1 << 20


def test_a_bound_socket_leaves_host_and_port_out() -> None:
    options = uvicorn_options(Served(port=0), bound=True)
    assert "host" not in options and "port" not in options
    assert options["log_level"] == "warning"


def test_the_build_runs_after_logging_is_set_and_its_app_goes_to_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(service_main.uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    configured: list[str] = []
    monkeypatch.setattr(service_main, "configure_process", lambda s: configured.append(s.log_level))
    app = FastAPI()

    def build() -> FastAPI:
        assert configured == ["WARNING"]  # its checks log in the service's format
        return app

    run_service(Served(), build, ws_max_size=7)
    assert calls == [(app, uvicorn_options(Served(), ws_max_size=7))]


def test_an_app_on_its_own_socket_is_served_there(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[tuple[Any, list[socket.socket]]] = []

    class Server:
        def __init__(self, config: Any) -> None:
            self.config = config

        def run(self, sockets: list[socket.socket]) -> None:
            served.append((self.config, sockets))

    monkeypatch.setattr(service_main.uvicorn, "Config", lambda app, **kwargs: (app, kwargs))
    monkeypatch.setattr(service_main.uvicorn, "Server", Server)
    monkeypatch.setattr(service_main, "configure_process", lambda s: None)
    app = FastAPI()
    with socket.socket() as sock:
        run_service(Served(), lambda: OnSocket(app, sock))
        assert served == [((app, uvicorn_options(Served(), bound=True)), [sock])]


def test_a_coroutine_runs_to_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_main, "configure_process", lambda s: None)
    ran: list[str] = []

    async def serve() -> None:
        ran.append("served")

    run_service(Served(), serve)
    assert ran == ["served"]


def test_configuring_a_process_sets_the_root_level(monkeypatch: pytest.MonkeyPatch) -> None:
    given: dict[str, Any] = {}
    monkeypatch.setattr(service_main.logging, "basicConfig", lambda **kwargs: given.update(kwargs))
    service_main.configure_process(Served(log_level="debug"))
    assert given == {"level": "DEBUG", "format": service_main.LOG_FORMAT}
