"""A port of the mesh's layout already in use is a clear startup error, before anything starts: never a mesh
half served by someone else (as a mesh left running answered a new one's requests with its own devices)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig, MeshStartError
from tophatctl.mesh_ports import MONITOR_OFFSET, find_port_base, layout, port_in_use, reserve_ports, taken_ports


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


def test_ports_reserved_by_one_process_are_refused_to_another_until_it_exits(tmp_path):
    # Two pytest workers each found the same layout free and one mesh died of EADDRINUSE: reservations
    # make the choice exclusive across processes.
    assert reserve_ports([40001, 40002], lock_dir=tmp_path)
    claim = (
        "import sys; from pathlib import Path; from tophatctl.mesh_ports import reserve_ports; "
        "sys.exit(0 if reserve_ports([int(p) for p in sys.argv[2:]], lock_dir=Path(sys.argv[1])) else 3)"
    )
    other = [sys.executable, "-c", claim, str(tmp_path)]
    assert subprocess.run([*other, "40002", "40003"], check=False).returncode == 3  # one port of it held here
    assert subprocess.run([*other, "40003", "40004"], check=False).returncode == 0  # its own, released at exit
    assert subprocess.run([*other, "40003"], check=False).returncode == 0
    assert not reserve_ports([40005, 40001], lock_dir=tmp_path)  # flock is per open file: held here too
    assert reserve_ports([40005], lock_dir=tmp_path)  # a refused claim took none of its ports


def test_layouts_found_one_after_another_share_no_port():
    # Without reservations 20 random layouts of 4 ports overlap somewhere about three times in four.
    ports = [port for _ in range(20) for port in layout(find_port_base(1), 1)]
    assert len(set(ports)) == len(ports)
