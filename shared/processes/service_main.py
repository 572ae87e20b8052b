"""How every service process starts (`python -m services.<name>`): logging in one format at the settings' level,
freed tensors returned to the OS (memory.py), then what the service's `__main__` built, served.

`run_service(settings, build)` calls `build` only once logging is set up, so the checks a `__main__` makes before
its app exists (a missing adapter, an absent GPU, a port taken) are logged like everything after. `build`
returns what to serve:
- a FastAPI app: uvicorn on the settings' host and port, TLS when the settings name a certificate and key;
- `OnSocket(app, sock)`: the same on a socket the `__main__` bound itself (the device agent settles port 0
  before its app exists, to announce the port it got);
- a coroutine: run to its end on a new event loop (the verifier serves its own asyncio server).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI

from shared.processes.memory import return_freed_memory_to_os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ServedSettings(Protocol):
    """What serving reads of a service's settings (every services/*/settings.py has these fields)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def log_level(self) -> str: ...
    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...


@dataclass(frozen=True)
class OnSocket:
    """An app to serve on a socket its `__main__` bound already."""

    app: FastAPI
    sock: socket.socket


Served = FastAPI | OnSocket | Coroutine[Any, Any, None]


def uvicorn_options(settings: ServedSettings, bound: bool = False, **extra: Any) -> dict[str, Any]:
    """uvicorn's keyword arguments for these settings: where to listen (unless `bound` to a socket already), its
    log level, and TLS only with both files; `extra` (a service's own, like the streamer's `ws_max_size`) last."""
    where = {} if bound else {"host": settings.host, "port": settings.port}
    return {
        **where,
        "log_level": settings.log_level.lower(),
        "ssl_certfile": settings.tls_cert or None,
        "ssl_keyfile": settings.tls_key or None,
        **extra,
    }


def configure_process(settings: ServedSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    return_freed_memory_to_os()  # fixed mmap threshold: no heap growth from freed tensors (memory.py)


def serve(settings: ServedSettings, served: Served, **uvicorn_extra: Any) -> None:
    """Serve until the process is told to stop (uvicorn and the verifier's server each handle SIGINT/SIGTERM)."""
    if isinstance(served, OnSocket):
        # With TLS the bound socket is served wrapped (uvicorn passes ssl= to create_server(sock=...)).
        config = uvicorn.Config(served.app, **uvicorn_options(settings, bound=True, **uvicorn_extra))
        uvicorn.Server(config).run(sockets=[served.sock])
    elif isinstance(served, FastAPI):
        uvicorn.run(served, **uvicorn_options(settings, **uvicorn_extra))
    else:
        asyncio.run(served)


def run_service(settings: ServedSettings, build: Callable[[], Served], **uvicorn_extra: Any) -> None:
    """Set up the process (logging, memory), then build the service and serve it (module docstring)."""
    configure_process(settings)
    serve(settings, build(), **uvicorn_extra)
