"""Where a local mesh's services listen: one base port and fixed offsets from it.

    token-streamer  base        chunk-planner  base+10     state-monitor  base+20
    verifier-cloud  base+100+j  device agents  base+200+i  redis          a free port (embedded)

Verifier replicas take base+100 .. base+199, so at most 99 of them fit before the devices' range.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

STREAMER_OFFSET = 0
PLANNER_OFFSET = 10
MONITOR_OFFSET = 20
VERIFIER_OFFSET = 100
DEVICE_OFFSET = 200
MAX_VERIFIERS = DEVICE_OFFSET - VERIFIER_OFFSET - 1
# Linux's default when /proc does not say (the first port the kernel hands out for outgoing connections).
DEFAULT_EPHEMERAL_FLOOR = 32768


def ephemeral_port_floor() -> int:
    """The lowest port the kernel picks for an outgoing connection's local end."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_FLOOR


def layout(base: int, num_devices: int, num_verifiers: int = 1) -> list[int]:
    """Every port a mesh with this base binds (the embedded Redis aside: it takes any free port)."""
    return (
        [base + STREAMER_OFFSET, base + PLANNER_OFFSET, base + MONITOR_OFFSET]
        + [base + VERIFIER_OFFSET + j for j in range(num_verifiers)]
        + [base + DEVICE_OFFSET + i for i in range(num_devices)]
    )


# Ports find_port_base handed out, held by this process until it exits (see reserve_ports).
_RESERVED_PORT_LOCKS: list[int] = []


def reserve_ports(ports: list[int], lock_dir: Path | None = None) -> bool:
    """Claim `ports` for this process's lifetime with one flock each, or claim none and return False.
    A free port is only free until someone binds it: two test workers that each found the same ports free
    would start their meshes on them and one would die of EADDRINUSE. The locks make the choice exclusive
    among the processes that pick ports here, whatever their order."""
    folder = lock_dir or Path(tempfile.gettempdir()) / "tophat-port-locks"
    folder.mkdir(parents=True, exist_ok=True)
    taken: list[int] = []
    for port in ports:
        fd = os.open(folder / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            for held in taken:
                os.close(held)
            return False
        taken.append(fd)
    _RESERVED_PORT_LOCKS.extend(taken)
    return True


def find_port_base(num_devices: int, host: str = "127.0.0.1", num_verifiers: int = 1) -> int:
    """A base whose whole port layout is free right now and reserved for this process (for tests and
    parallel meshes): another process that picks its ports here gets another layout."""
    # Stay below the kernel's ephemeral range: services' own outgoing connections take ports
    # from it, and one of them could land in our layout between this check and the bind.
    low_ephemeral = ephemeral_port_floor()
    for _ in range(200):
        base = random.randrange(10_000, max(10_010, low_ephemeral - 300 - num_devices), 10)
        ports = layout(base, num_devices, num_verifiers)
        if not any(port_in_use(host, port) for port in ports) and reserve_ports(ports):
            return base
    raise RuntimeError("no free port layout found")


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind `port` on `host` now. SO_REUSEADDR as uvicorn binds: connections a
    mesh stopped a moment ago left in TIME_WAIT do not hold the port, a listener does."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, the inode in the tenth column
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def port_holder(port: int) -> str:
    """Who listens on `port`, for an error message: "pid N (its command line)" where /proc shows it."""
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {proc.name} ({command[:160]})"
        except OSError:  # gone meanwhile, or another user's: not ours to read
            continue
    return "a process this user cannot see"


def taken_ports(host: str, ports: list[int]) -> dict[int, str]:
    """Of `ports`, those already in use on `host`, each with who holds it."""
    return {port: port_holder(port) for port in ports if port_in_use(host, port)}
