"""Device <-> cloud link profiles (HAT §4.1 "Testbed").

HAT's devices sit on WiFi at 2, 8 and 14 m from the access point and see an
uplink of 5-10 MB/s and a downlink of 10-15 MB/s. Those numbers are for a
4096-wide model (Vicuna-7B), whose per-token hidden state is 8 KiB in fp16.
Our demo model is far narrower, so a token is far fewer bytes; to keep the
*seconds per token on the wire* (what shapes TTFT/TBT) equal to the paper's,
`scaled_for_hidden` shrinks the bandwidths by hidden_size / 4096. Latency and
jitter are per message, not per byte, so they are never scaled.

The paper gives no latency; we pick a few milliseconds one-way (typical
uncongested WiFi) growing with distance. See docs/links.md for the table.

A profile is only data. Two mechanisms enforce it: `tophatctl.netns` (kernel
shaping of a veth into a network namespace) and `shared.net.shaper` (in-process
bookkeeping when namespaces are unavailable).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

REFERENCE_HIDDEN = 4096  # hidden size of the paper's Vicuna-7B, for which the MB/s figures hold

MB = 1_000_000  # the paper's MB/s are taken as decimal megabytes


@dataclass(frozen=True)
class LinkProfile:
    """One device's link. Bandwidths in bytes/s (``math.inf`` = unlimited);
    ``latency_s`` is one-way propagation delay per direction; ``jitter_s`` is
    the half-width of a uniform +/- variation of that delay (netem semantics)."""

    uplink_bytes_s: float
    downlink_bytes_s: float
    latency_s: float = 0.0
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("uplink_bytes_s", "downlink_bytes_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
                raise ValueError(f"LinkProfile.{name} must be a positive number or inf, got {value!r}")
        for name in ("latency_s", "jitter_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LinkProfile.{name} must be a finite number >= 0, got {value!r}")
        if self.jitter_s > self.latency_s:
            # A uniform +/- jitter wider than the latency would need negative delays.
            raise ValueError(f"LinkProfile.jitter_s ({self.jitter_s}) must not exceed latency_s ({self.latency_s})")

    @property
    def shaped(self) -> bool:
        """False for the "none" profile: nothing to emulate at all."""
        return not (
            math.isinf(self.uplink_bytes_s)
            and math.isinf(self.downlink_bytes_s)
            and self.latency_s == 0
            and self.jitter_s == 0
        )

    def describe(self) -> str:
        """Short human-readable form (for logs), e.g. ``up=625.0KB/s down=937.5KB/s lat=2.0ms jitter=0.5ms``."""
        if not self.shaped:
            return "unshaped"
        return (
            f"up={_fmt_rate(self.uplink_bytes_s)} down={_fmt_rate(self.downlink_bytes_s)} "
            f"lat={self.latency_s * 1e3:.1f}ms jitter={self.jitter_s * 1e3:.1f}ms"
        )


UNSHAPED = LinkProfile(math.inf, math.inf, 0.0, 0.0)

# HAT's three distance groups, for a 4096-wide model. Bandwidths span the
# paper's ranges (up 5-10, down 10-15 MB/s); latency/jitter are our choice.
PROFILES: dict[str, LinkProfile] = {
    "near": LinkProfile(10 * MB, 15 * MB, 0.002, 0.0005),  # 2 m
    "mid": LinkProfile(7.5 * MB, 12.5 * MB, 0.003, 0.001),  # 8 m
    "far": LinkProfile(5 * MB, 10 * MB, 0.005, 0.002),  # 14 m
}
PROFILES["slow"] = PROFILES["far"]
PROFILES["none"] = UNSHAPED
# Jupiter's edge LAN (§V: devices on a 100 Mbps LAN), for links between pipeline stages
# (shared/wire/stage_link.py): 100 Mbit/s each way, ~1 ms one-way, 0.1 ms jitter (latency/jitter our choice).
# Real bytes, not a 4096-wide model's: never pass it through scaled_for_hidden.
PROFILES["lan"] = LinkProfile(100e6 / 8, 100e6 / 8, 0.001, 0.0001)


def scaled_for_hidden(profile: LinkProfile, hidden_size: int, reference_hidden: int = REFERENCE_HIDDEN) -> LinkProfile:
    """Scale bandwidths by hidden_size / reference_hidden.

    Bytes per token on the wire are proportional to the hidden size (one fp16
    row of H values per token), so this keeps seconds-per-token equal to the
    paper's: e.g. 10 MB/s for H=4096 becomes 625 KB/s for H=256. Latency and
    jitter are unchanged; unlimited bandwidth stays unlimited.
    """
    if hidden_size <= 0 or reference_hidden <= 0:
        raise ValueError(f"hidden sizes must be positive, got {hidden_size} / {reference_hidden}")
    factor = hidden_size / reference_hidden
    return dataclasses.replace(
        profile,
        uplink_bytes_s=profile.uplink_bytes_s * factor,
        downlink_bytes_s=profile.downlink_bytes_s * factor,
    )


_RATE_UNITS = {
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "kib": 1024.0,
    "mib": 1024.0**2,
    "gib": 1024.0**3,
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")
_KEYS = {
    "up": "uplink_bytes_s",
    "down": "downlink_bytes_s",
    "lat": "latency_s",
    "jitter": "jitter_s",
}


def parse_bytes(text: str, *, bits: bool = True) -> float | None:
    """'5MB', '2MiB', '40mbit' (only with bits), a bare number = bytes; None when it is not one of those."""
    match = _NUM_UNIT.match(text.strip().lower())
    if match is None:
        return None
    unit = match.group(2)
    if (unit not in _RATE_UNITS and unit != "") or (not bits and unit.endswith("bit")):
        return None
    return float(match.group(1)) * _RATE_UNITS.get(unit, 1.0)


def _parse_rate(text: str) -> float:
    lowered = text.strip().lower()
    if lowered in {"inf", "unlimited"}:
        return math.inf
    value = parse_bytes(lowered.removesuffix("/s"))
    if value is None:
        raise ValueError(f"bad bandwidth {text!r} (use e.g. 5MB, 625KB, 40mbit, 2MiB; bare number = bytes/s)")
    return value


def _parse_time(text: str) -> float:
    match = _NUM_UNIT.match(text.strip().lower())
    if not match or match.group(2) not in _TIME_UNITS:
        raise ValueError(f"bad duration {text!r} (a unit is required: s, ms or us)")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def parse_link_spec(spec: str) -> LinkProfile:
    """Parse a CLI/env link spec into a profile (in the units written; no scaling).

    Forms: a name (``near``, ``mid``, ``far``, ``slow`` = far, ``lan``, ``none``);
    ``up=5MB,down=10MB,lat=5ms,jitter=1ms`` (omitted bandwidth = unlimited,
    omitted lat/jitter = 0); or a name followed by overrides,
    ``far,lat=20ms``. Bandwidth units: B, KB, MB, GB (decimal), KiB, MiB, GiB,
    bit, kbit, mbit, gbit, optional ``/s``; a bare number is bytes/s. Time
    units are required.
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError("empty link spec")
    base = UNSHAPED
    if "=" not in parts[0]:
        name = parts.pop(0).lower()
        if name not in PROFILES:
            raise ValueError(f"unknown link profile {name!r}; known: {', '.join(sorted(PROFILES))}")
        base = PROFILES[name]
    values: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise ValueError(f"bad link spec item {part!r} in {spec!r}; expected one of {', '.join(_KEYS)}=<value>")
        field = _KEYS[key]
        if field in values:
            raise ValueError(f"duplicate {key!r} in link spec {spec!r}")
        values[field] = _parse_rate(raw) if key in {"up", "down"} else _parse_time(raw)
    return dataclasses.replace(base, **values)


def _fmt_rate(bytes_s: float) -> str:
    if math.isinf(bytes_s):
        return "inf"
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_s >= size:
            return f"{bytes_s / size:.1f}{unit}"
    return f"{bytes_s:.0f}B/s"
