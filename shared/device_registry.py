"""Which device agents are alive and where: announcements with a time to live.

A deployment does not know its device agents' addresses in advance (`docker compose
up --scale device-agent=N`, a Swarm service in `mode: global` over 30 Jetsons, a
Kubernetes DaemonSet), so each agent announces `(device_id, url)` to the state
monitor every few seconds, and the token streamer asks the monitor which agents
announced recently. An agent that stops announcing (its container died, its node
left) drops out after `ttl_s`; one that comes back under a new address replaces
its old entry. An address is one live device's: another device announcing it is
refused (`UrlTaken`) until its holder has been silent for the TTL, so a device
cannot draw away the prompts the streamer sends to another (the state monitor also
lets a device credential announce only its own id: services/state_monitor/app.py).

`advertised_url` is how an agent names its own address: an explicit URL wins;
an agent bound to every interface advertises its address on the route to the state
monitor (a Swarm task has several interfaces, and only the overlay one is reachable
from the streamer), else the address its host name resolves to.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TTL_S = 15.0
ANY_HOST = ("0.0.0.0", "::", "")


def url_origin(url: str) -> str:
    """scheme://host:port of a URL: how an address is compared (and how the issuer finds a URL's device)."""
    parts = urllib.parse.urlsplit(url.strip())
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


class UrlTaken(ValueError):
    """Another live device announced this address."""

    def __init__(self, url: str, holder: str) -> None:
        super().__init__(f"{url} is device {holder}'s address")
        self.holder = holder


@dataclass(frozen=True)
class Announcement:
    device_id: str
    url: str
    seen_at: float  # the registry clock's time of the latest announcement
    max_sessions: int | None = None


class DeviceRegistry:
    """Latest announcement per device id; `live()` lists the ones younger than the TTL."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, Announcement] = {}

    def announce(self, device_id: str, url: str, max_sessions: int | None = None) -> Announcement:
        """Record `device_id` at `url`; UrlTaken when another live device holds that address."""
        holder = self.holder(url)
        if holder is not None and holder.device_id != device_id:
            raise UrlTaken(url, holder.device_id)
        entry = Announcement(device_id, url.rstrip("/"), self._clock(), max_sessions)
        # One address, one device: a silent device's old entry at this address goes (an agent restarted under
        # a new id at an old address).
        origin = url_origin(entry.url)
        for other in [k for k, v in self._entries.items() if url_origin(v.url) == origin and k != device_id]:
            del self._entries[other]
        self._entries[device_id] = entry
        return entry

    def live(self) -> list[Announcement]:
        now = self._clock()
        for device_id in [k for k, v in self._entries.items() if now - v.seen_at > self.ttl_s]:
            del self._entries[device_id]
        return sorted(self._entries.values(), key=lambda a: a.device_id)

    def get(self, device_id: str) -> Announcement | None:
        """The device's live entry, if any."""
        return next((a for a in self.live() if a.device_id == device_id), None)

    def holder(self, url: str) -> Announcement | None:
        """The live device announced at `url` (compared by scheme, host and port), if any."""
        origin = url_origin(url)
        return next((a for a in self.live() if url_origin(a.url) == origin), None)

    def age_s(self, entry: Announcement) -> float:
        return max(0.0, self._clock() - entry.seen_at)


def route_source_address(peer_url: str) -> str:
    """This host's address on the route to `peer_url`'s host (a UDP connect sends nothing)."""
    parts = urllib.parse.urlsplit(peer_url)
    if not parts.hostname:
        raise OSError(f"no host in {peer_url!r}")
    info = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as sock:
        sock.connect(info[4])
        return str(sock.getsockname()[0])


def advertised_url(
    explicit: str,
    host: str,
    port: int,
    route_to: str = "",
    route_source: Callable[[str], str] = route_source_address,
    resolve: Callable[[str], str] = socket.gethostbyname,
    hostname: Callable[[], str] = socket.gethostname,
) -> str:
    """The base URL other machines reach this agent at."""
    if explicit:
        return explicit.rstrip("/")
    if host in ANY_HOST:
        try:
            host = route_source(route_to) if route_to else resolve(hostname())
        except OSError:
            try:
                host = resolve(hostname())
            except OSError:
                host = "127.0.0.1"
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def auto_device_id(port: int, hostname: Callable[[], str] = socket.gethostname) -> str:
    """`<host name>-<port>`: unique per replica both on a bridge network (each container has its own host
    name) and on host networking (replicas share the host name but not the port)."""
    name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in hostname())[:100] or "device"
    return f"{name}-{port}"
