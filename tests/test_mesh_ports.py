"""A port of the mesh's layout already in use is a clear startup error, before anything starts: never a mesh
half served by someone else (as a mesh left running answered a new one's requests with its own devices)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig, MeshStartError
from tophatctl.mesh_ports import MONITOR_OFFSET, find_port_base, port_in_use, taken_ports


def listening(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_listener_is_found_with_its_pid_and_a_closed_one_frees_the_port():
    base = find_port_base(1)
    with listening(base) as sock:
        assert port_in_use("127.0.0.1", base)
        assert port_in_use("0.0.0.0", base)  # a wildcard bind meets the loopback listener too
        taken = taken_ports("127.0.0.1", [base, base + 1])
        assert list(taken) == [base] and taken[base].startswith(f"pid {os.getpid()} (")
        sock.close()
        assert not port_in_use("127.0.0.1", base)


def test_starting_onto_a_taken_port_fails_at_once_naming_the_port_and_its_holder():
    base = find_port_base(1)
    taken = base + MONITOR_OFFSET
    mesh = Mesh(MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=base))
    with listening(taken):
        started = time.monotonic()
        with pytest.raises(MeshStartError, match=f"port {taken} is held by pid {os.getpid()} ") as refused:
            mesh.start()
        assert time.monotonic() - started < 5.0, "refused only after starting services"
    assert "--port-base" in str(refused.value)
    assert mesh.services == [] and mesh.redis is None  # nothing was started, nothing left to stop
