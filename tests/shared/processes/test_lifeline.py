"""Services die with their launcher, however it dies: a launcher process SIGKILLed (no cleanup of its own)
leaves no child running and no port held, within a few seconds.

The fast test runs a small launcher in a subprocess: two tethered stdlib HTTP servers started as the mesh
starts its services (tophatctl/service_process.py, one behind an exec'ing wrapper as `ip netns exec` is),
and a plain program started as the embedded Redis is (shared/processes/lifeline.py die_with_parent). The slow one
does the same to a real `tophat up` with the demo model and reads its pids from its state file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shared.processes.lifeline import GRACE_S, TETHER_FD_ENV, Tether, watch_tether
from shared.processes.redis_server import free_port
from tests.conftest import DEMO_MODEL_DIR
from tophatctl.mesh_ports import find_port_base, layout, port_in_use
from tophatctl.service_process import REPO_ROOT

GONE_WITHIN_S = GRACE_S + 3.0  # SIGTERM at once, SIGKILL after the grace at the latest

LAUNCHER = textwrap.dedent("""
    import json, subprocess, sys, time
    from pathlib import Path
    from shared.processes.lifeline import Tether, die_with_parent
    from tophatctl.service_process import start_process, tethered_command

    log, ports = Path(sys.argv[1]), sys.argv[2:]
    tether = Tether()
    env = {**__import__("os").environ, **tether.child_env()}
    servers = [start_process([*prefix, *tethered_command("http.server"), port, "--bind", "127.0.0.1"], env, log)
               for prefix, port in zip(([], ["env"]), ports)]
    plain = subprocess.Popen(["sleep", "300"], preexec_fn=die_with_parent())
    print(json.dumps([p.pid for p in (*servers, plain)]), flush=True)
    time.sleep(300)
""")


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie lingers where the container's init does not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_sigkilled_launcher_takes_its_children_and_their_ports_with_it(tmp_path):
    ports = [free_port(), free_port()]
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "children.log"), *map(str, ports)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    try:
        children = json.loads(launcher.stdout.readline())
        assert wait_until(lambda: all(port_in_use("127.0.0.1", p) for p in ports), 20), "servers never listened"
        launcher.kill()  # SIGKILL: the launcher runs nothing more
        launcher.wait(timeout=5)
        assert wait_until(lambda: not any(alive(pid) for pid in children), GONE_WITHIN_S), (
            f"left running: {[pid for pid in children if alive(pid)]}\n{(tmp_path / 'children.log').read_text()}"
        )
        assert not any(port_in_use("127.0.0.1", p) for p in ports)
    finally:
        launcher.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_closed_tether_stops_its_watcher_and_an_open_one_does_not(tmp_path):
    child = textwrap.dedent("""
        import time
        from shared.processes.lifeline import watch_tether
        watch_tether(grace_s=1.0)
        time.sleep(60)
    """)
    tether = Tether()
    env = {**os.environ, **tether.child_env()}
    process = subprocess.Popen(
        [sys.executable, "-c", child], cwd=REPO_ROOT, env=env, pass_fds=(int(env[TETHER_FD_ENV]),)
    )
    try:
        time.sleep(1.0)
        assert process.poll() is None  # the launcher is here: the child stays
        tether.close()
        assert process.wait(timeout=5) == -signal.SIGTERM
        with pytest.raises(RuntimeError, match="closed"):
            tether.child_env()
    finally:
        process.kill()
        tether.close()


def test_no_tether_means_no_watcher():
    assert watch_tether({}) is None


@pytest.mark.slow
def test_sigkilled_tophat_up_leaves_no_service_and_no_port_behind(tmp_path):
    base = find_port_base(1)
    state_file = tmp_path / "state.json"
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from tophat.cli import app; app()",
                "up",
                "--model",
                str(DEMO_MODEL_DIR),
                "--port-base",
                str(base),
                "--state-file",
                str(state_file),
            ],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    pids: list[int] = []
    try:
        assert wait_until(lambda: state_file.exists() or up.poll() is not None, 120) and up.poll() is None, (
            tmp_path / "up.log"
        ).read_text()[-3000:]
        pids = [entry["pid"] for entry in json.loads(state_file.read_text())]
        assert len(pids) == 6 and all(map(alive, pids))  # five services and the embedded Redis
        up.kill()
        up.wait(timeout=5)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), GONE_WITHIN_S), (
            f"left running: {[pid for pid in pids if alive(pid)]}"
        )
        assert not [port for port in layout(base, 1) if port_in_use("127.0.0.1", port)]
    finally:
        up.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
