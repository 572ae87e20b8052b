"""Kernel link emulation: namespaces, veth, tc. The live tests need root, iproute2
and a kernel with veth + tbf; they are skipped (with the probe's reason) otherwise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from shared.net.links import UNSHAPED, LinkProfile
from tophatctl import netns
from tophatctl.netns import NetnsLink, subnet_for_index, tc_commands

SUPPORT = netns.netns_support()
needs_netns = pytest.mark.skipif(not SUPPORT.available, reason=f"network namespaces unavailable: {SUPPORT.reason}")

RATE_UP, RATE_DOWN = 2_000_000.0, 3_000_000.0
PROFILE = LinkProfile(RATE_UP, RATE_DOWN, latency_s=0.005, jitter_s=0.0)
MEASURE_S = 1.2
WARMUP_S = 0.25  # skip the tbf burst and TCP slow start
INDEX = 200 + os.getpid() % 50  # distinct subnet per test process

# Child programs run inside the namespace (they report on stdout to this test).
SENDER = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf, end = b"x" * 65536, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(buf)
s.close()
"""
RECEIVER = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
marks, total = [], 0
while (d := s.recv(65536)):
    total += len(d); marks.append((time.monotonic(), total))
t0 = marks[0][0] + float(sys.argv[3])
tw, bw = next((t, b) for t, b in marks if t >= t0)
print((marks[-1][1] - bw) / (marks[-1][0] - tw))
"""
PINGER = r"""
import socket, statistics, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(15):
    t = time.monotonic(); s.sendall(b"p"); s.recv(1); rtts.append(time.monotonic() - t)
print(statistics.median(rtts))
"""


def _listen(host: str) -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.settimeout(10)
    srv.bind((host, 0))
    srv.listen(1)
    return srv, srv.getsockname()[1]


def _in_ns(link: NetnsLink, program: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*link.exec_prefix(), sys.executable, "-c", program, *args], stdout=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, f"child in namespace failed (rc={proc.returncode})"
    return out


def measure_uplink(link: NetnsLink) -> float:
    srv, port = _listen(link.host_ip)
    proc = _in_ns(link, SENDER, link.host_ip, str(port), str(MEASURE_S))
    conn, _ = srv.accept()
    marks, total = [], 0
    while data := conn.recv(65536):
        total += len(data)
        marks.append((time.monotonic(), total))
    conn.close()
    srv.close()
    _finish(proc)
    t_warm, b_warm = next((t, b) for t, b in marks if t >= marks[0][0] + WARMUP_S)
    return (marks[-1][1] - b_warm) / (marks[-1][0] - t_warm)


def measure_downlink(link: NetnsLink) -> float:
    srv, port = _listen(link.host_ip)
    proc = _in_ns(link, RECEIVER, link.host_ip, str(port), str(WARMUP_S))
    conn, _ = srv.accept()
    buf, end = b"y" * 65536, time.monotonic() + MEASURE_S
    while time.monotonic() < end:
        conn.sendall(buf)
    conn.close()
    srv.close()
    return float(_finish(proc))


def measure_rtt(link: NetnsLink) -> float:
    srv, port = _listen(link.host_ip)
    proc = _in_ns(link, PINGER, link.host_ip, str(port))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(1):
        conn.sendall(data)
    conn.close()
    srv.close()
    return float(_finish(proc))


# --- pure parts (no root needed) ---------------------------------------------


def test_subnets_and_exec_prefix() -> None:
    assert subnet_for_index(7) == ("10.77.7.1", "10.77.7.2")
    with pytest.raises(ValueError):
        subnet_for_index(256)
    link = NetnsLink.for_index(3, UNSHAPED)
    assert link.name == "tophat-dev3" and link.exec_prefix() == ["ip", "netns", "exec", "tophat-dev3"]
    assert len(link.veth_host) <= 15 and link.veth_host != link.veth_ns
    with pytest.raises(ValueError):
        NetnsLink("a/b", "10.0.0.1", "10.0.0.2", UNSHAPED)


def test_tc_commands_layout() -> None:
    cmds = tc_commands("eth9", 2e6, 0.005, 0.001, netem=True)
    assert cmds[0][:8] == ["qdisc", "replace", "dev", "eth9", "root", "handle", "1:", "tbf"]
    rate_bits = int(cmds[0][cmds[0].index("rate") + 1].removesuffix("bit"))
    assert rate_bits == pytest.approx(2e6 * 8 * netns.WIRE_OVERHEAD, abs=1)
    assert cmds[1][:6] == ["qdisc", "add", "dev", "eth9", "parent", "1:1"]
    assert cmds[1][cmds[1].index("delay") + 1 :][:2] == ["5000us", "1000us"]
    assert len(tc_commands("eth9", 2e6, 0.005, 0.001, netem=False)) == 1  # rate only
    assert tc_commands("eth9", float("inf"), 0.0, 0.0, netem=True) == []
    only_delay = tc_commands("eth9", float("inf"), 0.005, 0.0, netem=True)
    assert len(only_delay) == 1 and "netem" in only_delay[0] and "tbf" not in only_delay[0]


def test_remainder_when_kernel_has_no_netem() -> None:
    link = NetnsLink("x", "10.0.0.1", "10.0.0.2", PROFILE)
    link.kernel_latency = False
    rest = link.in_process_remainder()
    assert rest.latency_s == PROFILE.latency_s and rest.uplink_bytes_s == float("inf")
    link.kernel_latency = True
    assert link.in_process_remainder() == UNSHAPED


# --- live (root + iproute2 + veth/tbf) --------------------------------------------


@pytest.fixture
def link() -> NetnsLink:
    with NetnsLink(f"tophat-test{os.getpid()}", *subnet_for_index(INDEX), PROFILE) as live:
        yield live


@needs_netns
@pytest.mark.slow
def test_uplink_rate_within_15_percent(link: NetnsLink) -> None:
    assert measure_uplink(link) == pytest.approx(RATE_UP, rel=0.15)


@needs_netns
@pytest.mark.slow
def test_downlink_rate_within_15_percent(link: NetnsLink) -> None:
    assert measure_downlink(link) == pytest.approx(RATE_DOWN, rel=0.15)


@needs_netns
def test_latency_in_kernel_or_handed_to_the_in_process_shaper(link: NetnsLink) -> None:
    rtt = measure_rtt(link)
    if SUPPORT.netem:
        assert link.kernel_latency
        assert rtt >= 2 * PROFILE.latency_s * 0.95
        assert link.in_process_remainder() == UNSHAPED
    else:
        # No sch_netem in this kernel: the namespace adds no delay, and says so.
        assert not link.kernel_latency
        assert rtt < PROFILE.latency_s
        rest = link.in_process_remainder()
        assert (rest.latency_s, rest.jitter_s) == (PROFILE.latency_s, PROFILE.jitter_s)


@needs_netns
def test_teardown_is_idempotent_and_stale_namespaces_are_replaced() -> None:
    name = f"tophat-stale{os.getpid()}"
    host_ip, ns_ip = subnet_for_index((INDEX + 1) % 256)
    first = NetnsLink(name, host_ip, ns_ip, UNSHAPED).setup()  # "crashed run": never torn down
    with NetnsLink(name, host_ip, ns_ip, PROFILE) as second:
        assert name in netns._namespaces()
        out = subprocess.run(
            ["tc", "-n", name, "qdisc", "show", "dev", second.veth_ns],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        assert "tbf" in out
    assert name not in netns._namespaces()
    assert not netns._link_exists(second.veth_host)
    first.teardown()
    second.teardown()
