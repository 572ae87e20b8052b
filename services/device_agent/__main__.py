"""`python -m services.device_agent`: one device's agent."""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
from pathlib import Path

from services.device_agent.app import create_app
from services.device_agent.settings import Settings, load_settings
from shared.device_registry import auto_device_id
from shared.model.placement import PlacementError, cuda_facts, resolve_device
from shared.processes.service_main import OnSocket, run_service

log = logging.getLogger("services.device_agent")


def missing_adapter(settings: Settings) -> str | None:
    """Why a speculative agent cannot start for want of a draft adapter (None: it can). Said before the
    model loads, as one line, instead of a traceback from the app's startup."""
    from shared.model.adapter import ADAPTER_FILENAME

    if not settings.speculative or settings.adapter:
        return None  # no adapter needed, or an explicit one ('random' or a file the loader checks)
    path = Path(settings.model_dir) / ADAPTER_FILENAME
    if path.is_file():
        return None
    return (
        f"no draft adapter at {path}: set TOPHAT_DEVICE_ADAPTER=random (untrained: lossless, accepts "
        "little) or to an adapter file, or TOPHAT_DEVICE_SPECULATIVE=false (plain U-shape)"
    )


def refuse_unplaceable(settings: Settings) -> None:
    """Exit 2, said in one line, when the agent cannot run here: no draft adapter, or a device this machine
    lacks (cuda without a GPU, cuda:3 with 2), refused before the app starts."""
    problem = missing_adapter(settings)
    if problem:
        log.error("%s", problem)
        sys.exit(2)
    available, count = cuda_facts()
    try:
        resolve_device(settings.device, available, count)
    except PlacementError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)


def listen(settings: Settings) -> socket.socket:
    """The agent's socket, bound here, before the app exists, so that port 0 (any free port) and device id
    "auto" are settled into the settings the agent announces; exit 2 when the address is taken."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        sys.exit(2)
    return sock


def start_agent(settings: Settings) -> OnSocket:
    refuse_unplaceable(settings)
    sock = listen(settings)
    port = sock.getsockname()[1]
    if settings.port_file:
        Path(settings.port_file).write_text(f"{port}\n", encoding="ascii")
    device_id = auto_device_id(port) if settings.device_id == "auto" else settings.device_id
    settled = dataclasses.replace(settings, port=port, device_id=device_id)
    return OnSocket(create_app(settled), sock)


def main() -> None:
    settings = load_settings()
    run_service(settings, lambda: start_agent(settings))


if __name__ == "__main__":
    main()
