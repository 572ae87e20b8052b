"""Waiting for a starting mesh's services: until each one's readiness URL answers 200, or (device discovery)
until the state monitor lists every device agent. A service that exits meanwhile fails the start with the
tail of its log; every wait is bounded by the mesh's `ready_timeout_s`.
"""

from __future__ import annotations

import ssl
import time

import httpx

from tophatctl.mesh_config import MeshStartError
from tophatctl.service_process import ServiceProcess

POLL_S = 0.2  # how often readiness is asked while waiting for a service


def check_alive(service: ServiceProcess) -> None:
    if service.process.poll() is not None:
        raise MeshStartError(f"{service.name} exited with {service.process.returncode}:\n{service.log_tail()}")


def wait_ready(services: list[ServiceProcess], timeout_s: float, verify: ssl.SSLContext | bool) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    with httpx.Client(timeout=2.0, verify=verify) as client:
        while pending:
            for service in list(pending):
                check_alive(service)
                try:
                    if client.get(service.ready_url).status_code == 200:
                        pending.remove(service)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise MeshStartError(f"not ready after {timeout_s}s: {names}\n{pending[0].log_tail()}")
            if pending:
                time.sleep(POLL_S)


def wait_announced(
    devices: list[ServiceProcess], monitor_url: str, timeout_s: float, verify: ssl.SSLContext | bool
) -> list[str]:
    """Discovery mode: the agents' announced URLs, once the state monitor lists every device agent."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, verify=verify) as client:
        while True:
            for service in devices:
                check_alive(service)
            try:
                listed = client.get(f"{monitor_url}/devices").json()["devices"]
            except (httpx.HTTPError, ValueError, KeyError):
                listed = []
            if len(listed) >= len(devices):
                return [d["url"] for d in listed]
            if time.monotonic() > deadline:
                raise MeshStartError(
                    f"{len(listed)} of {len(devices)} device agents announced after "
                    f"{timeout_s}s\n{devices[0].log_tail()}"
                )
            time.sleep(POLL_S)
