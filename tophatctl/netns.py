"""Kernel link emulation: one network namespace + shaped veth pair per device.

Why: an in-process shaper only delays whole frames at the application layer;
running the device agent inside its own namespace, behind a veth whose two
ends are shaped by `tc`, puts the real TCP stack (windows, ACK clocking,
queueing of back-to-back frames) on an emulated WiFi link, and needs no
cooperation from the code under test beyond connecting to ``host_ip``.

Layout for a link named N (needs root, `ip` and `tc` from iproute2)::

    root ns                               netns N
    veth_host  host_ip/30  <==========>  veth_ns  ns_ip/30   (+ lo up,
      egress: downlink shaping             egress: uplink shaping   default via host_ip)

Shaping per direction: ``tbf`` at the root for the rate; when the kernel has
``sch_netem``, a ``netem delay`` qdisc as tbf's child adds latency/jitter.
Some kernels (e.g. minimal VM kernels with CONFIG_NET_SCH_NETEM unset) have
tbf but no netem: then the namespace shapes bandwidth only and
`NetnsLink.in_process_remainder()` returns the latency/jitter the caller must
still add with `shared.net.shaper.LinkShaper` (infinite rate). See docs/links.md.

Services in the root namespace must listen on ``0.0.0.0`` or on ``host_ip``;
the root namespace's 127.0.0.1 is not reachable from inside.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType

from shared.net.links import UNSHAPED, LinkProfile

log = logging.getLogger(__name__)

CMD_TIMEOUT_S = 10.0
SUBNET_PREFIX = "10.77"  # 10.77.<index>.0/30 per device; private, unlikely to clash

# tbf tuning (see docs/links.md for the measurements behind these).
TBF_BURST_S = 0.004  # bucket depth in seconds of rate: small, so bursts stay short
TBF_MIN_BURST_BYTES = 2 * 1514  # must hold at least one full frame; GSO skbs are re-segmented
TBF_QUEUE_S = 0.5  # queue before tail drop; a WiFi AP/driver buffers generously too
TBF_MIN_QUEUE_BYTES = 64 * 1024
NETEM_LIMIT_PACKETS = 10_000
# tbf meters L2 bytes (Ethernet + IP + TCP headers); a profile's bandwidth is
# goodput (what the application sees, like the in-process shaper's frame
# bytes). A full TCP segment on a 1500-MTU veth is 1514 wire bytes for 1448
# payload bytes (timestamps on), so the meter runs this much faster.
WIRE_OVERHEAD = 1514 / 1448


class NetnsError(RuntimeError):
    """A namespace/veth/tc command failed or timed out."""


def _run(cmd: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(cmd)}` timed out after {timeout}s") from exc
    except OSError as exc:
        raise NetnsError(f"`{' '.join(cmd)}` could not be started: {exc}") from exc
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (rc={result.returncode}): {result.stderr.strip()}")
    return result


def subnet_for_index(index: int) -> tuple[str, str]:
    """(host_ip, ns_ip) of device ``index``: 10.77.<index>.1 / .2 (a /30)."""
    if not 0 <= index <= 255:
        raise ValueError(f"netns index must be in 0..255, got {index}")
    return f"{SUBNET_PREFIX}.{index}.1", f"{SUBNET_PREFIX}.{index}.2"


def _veth_names(name: str) -> tuple[str, str]:
    # Interface names are limited to 15 chars; hash the namespace name so any
    # length works and two links never collide on a truncated prefix.
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"th{digest}h", f"th{digest}n"


def tc_commands(dev: str, rate_bytes_s: float, latency_s: float, jitter_s: float, *, netem: bool) -> list[list[str]]:
    """`tc` argument lists (without the leading ``tc [-n ns]``) shaping ``dev`` egress.

    ``rate_bytes_s`` is goodput; the tbf meter is set WIRE_OVERHEAD higher.

    tbf at the root for the rate, netem as its child for delay (only if
    ``netem``); either part is omitted when it has nothing to do.
    """
    cmds: list[list[str]] = []
    want_delay = netem and latency_s > 0
    netem_args = ["netem", "delay", f"{round(latency_s * 1e6)}us"]
    if jitter_s > 0:
        netem_args.append(f"{round(jitter_s * 1e6)}us")
    netem_args += ["limit", str(NETEM_LIMIT_PACKETS)]
    if math.isfinite(rate_bytes_s):
        wire_rate = rate_bytes_s * WIRE_OVERHEAD
        burst = max(round(wire_rate * TBF_BURST_S), TBF_MIN_BURST_BYTES)
        limit = max(round(wire_rate * TBF_QUEUE_S), TBF_MIN_QUEUE_BYTES)
        cmds.append(
            ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
             "rate", f"{round(wire_rate * 8)}bit", "burst", str(burst), "limit", str(limit)]
        )  # fmt: skip
        if want_delay:
            cmds.append(["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *netem_args])
    elif want_delay:
        cmds.append(["qdisc", "replace", "dev", dev, "root", "handle", "1:", *netem_args])
    return cmds


@dataclass(frozen=True)
class NetnsSupport:
    """Result of probing this host once: can we build namespaces, and is netem there?"""

    available: bool
    netem: bool
    reason: str  # why unavailable ("" when available)


def _namespaces() -> set[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _link_exists(dev: str) -> bool:
    return _run(["ip", "link", "show", "dev", dev], check=False).returncode == 0


@functools.lru_cache(maxsize=1)
def netns_support() -> NetnsSupport:
    """Probe (once per process) by building and deleting a scratch namespace."""
    if os.geteuid() != 0:
        return NetnsSupport(False, False, "not running as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return NetnsSupport(False, False, f"missing {' and '.join(missing)} (install iproute2)")
    probe = f"tophat-probe-{os.getpid()}"
    host_dev, ns_dev = _veth_names(probe)
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "link", "add", host_dev, "type", "veth", "peer", "name", ns_dev, "netns", probe])
            _run(["tc", "-n", probe, "qdisc", "add", "dev", ns_dev, "root", "tbf",
                  "rate", "8mbit", "burst", "4096", "limit", "65536"])  # fmt: skip
            netem_probe = ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
            netem = _run(netem_probe, check=False).returncode == 0
        finally:
            if _link_exists(host_dev):
                _run(["ip", "link", "del", host_dev], check=False)
            _run(["ip", "netns", "del", probe], check=False)
    except NetnsError as exc:
        return NetnsSupport(False, False, f"probe failed: {exc}")
    if not netem:
        log.info("tc netem is not available in this kernel: netns links shape bandwidth only")
    return NetnsSupport(True, netem, "")


def netns_available() -> bool:
    """True if this process can create shaped namespaces (root, iproute2, veth, tbf)."""
    return netns_support().available


def netem_available() -> bool:
    """True if the kernel can also add latency/jitter (sch_netem)."""
    return netns_support().netem


class NetnsLink:
    """A device's namespace behind a shaped veth. Use as a context manager.

    ``with NetnsLink("tophat3", *subnet_for_index(3), profile) as link:``
    start the device with ``link.exec_prefix() + [python, ...]`` and point it
    at ``link.host_ip``. Uplink (device -> cloud) is shaped on the namespace
    side, downlink on the host side.
    """

    def __init__(self, name: str, host_ip: str, ns_ip: str, profile: LinkProfile, prefix_len: int = 30) -> None:
        if not name or len(name) > 64 or "/" in name or name.startswith("."):
            raise ValueError(f"bad namespace name {name!r}")
        self.name = name
        self.host_ip = host_ip
        self.ns_ip = ns_ip
        self.prefix_len = prefix_len
        self.profile = profile
        self.veth_host, self.veth_ns = _veth_names(name)
        self.kernel_latency = False
        self._up = False

    @classmethod
    def for_index(cls, index: int, profile: LinkProfile, prefix: str = "tophat-dev") -> NetnsLink:
        """Link ``<prefix><index>`` on subnet 10.77.<index>.0/30."""
        return cls(f"{prefix}{index}", *subnet_for_index(index), profile)

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def in_process_remainder(self) -> LinkProfile:
        """What the caller must still emulate in-process (unlimited bandwidth).

        UNSHAPED when the kernel does everything; otherwise the latency/jitter
        netem would have added.
        """
        if self.kernel_latency or self.profile.latency_s == 0:
            return UNSHAPED
        return LinkProfile(math.inf, math.inf, self.profile.latency_s, self.profile.jitter_s)

    def setup(self) -> NetnsLink:
        support = netns_support()
        if not support.available:
            raise NetnsError(f"network namespaces unavailable: {support.reason}")
        self.teardown()  # stale leftovers of a crashed run with the same name
        try:
            self._create(support.netem)
        except BaseException:
            self.teardown()
            raise
        self._up = True
        log.info(
            "netns %s: %s <-> %s, %s (latency %s)",
            self.name, self.ns_ip, self.host_ip, self.profile.describe(),
            "in kernel (netem)" if self.kernel_latency else "left to the in-process shaper",
        )  # fmt: skip
        return self

    def _create(self, netem: bool) -> None:
        ns, cidr = self.name, f"/{self.prefix_len}"
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns, "netns", ns])
        _run(["ip", "addr", "add", self.host_ip + cidr, "dev", self.veth_host])
        _run(["ip", "link", "set", self.veth_host, "up"])
        _run(["ip", "-n", ns, "addr", "add", self.ns_ip + cidr, "dev", self.veth_ns])
        _run(["ip", "-n", ns, "link", "set", self.veth_ns, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", self.host_ip])
        p = self.profile
        for args in tc_commands(self.veth_ns, p.uplink_bytes_s, p.latency_s, p.jitter_s, netem=netem):
            _run(["tc", "-n", ns, *args])
        for args in tc_commands(self.veth_host, p.downlink_bytes_s, p.latency_s, p.jitter_s, netem=netem):
            _run(["tc", *args])
        self.kernel_latency = netem and p.latency_s > 0

    def teardown(self) -> None:
        """Remove the veth pair and the namespace; safe to call repeatedly."""
        if _link_exists(self.veth_host):
            _run(["ip", "link", "del", self.veth_host])
        if self.name in _namespaces():
            pids = _run(["ip", "netns", "pids", self.name], check=False).stdout.split()
            if pids:
                log.warning("netns %s still has processes %s; they keep running without a link", self.name, pids)
            _run(["ip", "netns", "del", self.name])
        if self._up:
            log.info("netns %s removed", self.name)
        self._up = False

    def __enter__(self) -> NetnsLink:
        return self.setup()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()
