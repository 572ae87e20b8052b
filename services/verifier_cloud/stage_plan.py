"""Per-stage settings of a pipeline, as written in settings and flags, parsed and checked.

    layers     "2-5,5-12,12-30"   contiguous [start, stop) layer ranges, one per stage
    slowdowns  "1,3,3"            each stage's emulated slowdown (shared/planning/device_speed.py): a number >= 1
                                  or a fixed speed class (orin, xavier)
    links      "lan;lan;far;lan"  P+1 hop link specs (shared/net/links.py), hop 0 = main -> stage 0,
                                  hop P = last stage -> main; one spec alone applies to every hop
    address    "jetson-1:7200"    where a stage started on its own listens (host:port, [v6]:port)

Empty strings mean: equal split, no slowdown, unshaped hops.
"""

from __future__ import annotations

from shared.net.links import UNSHAPED, LinkProfile, parse_link_spec
from shared.planning.device_speed import speed_schedule


def parse_stage_layers(spec: str, first_layer: int | None = None) -> list[tuple[int, int]]:
    """'a-b,b-c,...' -> [(a, b), (b, c), ...]: non-empty, contiguous, starting at `first_layer` if given."""
    ranges: list[tuple[int, int]] = []
    for part in (p.strip() for p in spec.split(",")):
        start, sep, stop = part.partition("-")
        try:
            if not sep:
                raise ValueError
            ranges.append((int(start), int(stop)))
        except ValueError:
            raise ValueError(f"stage_layers: bad range {part!r} in {spec!r} (use e.g. 2-5,5-12,12-30)") from None
    for (lo, hi), nxt in zip(ranges, ranges[1:] + [None]):
        if not 0 <= lo < hi:
            raise ValueError(f"stage_layers: range {lo}-{hi} is empty or negative")
        if nxt is not None and nxt[0] != hi:
            raise ValueError(f"stage_layers: ranges must be contiguous: {lo}-{hi} is followed by {nxt[0]}-{nxt[1]}")
    if first_layer is not None and ranges[0][0] != first_layer:
        raise ValueError(
            f"stage_layers: the first stage must start at split_layers ({first_layer}), got {ranges[0][0]}"
        )
    return ranges


def check_layers_cover(ranges: list[tuple[int, int]], num_layers: int) -> None:
    """The last range must end at the model's last layer (known only once its config is read)."""
    if ranges[-1][1] != num_layers:
        raise ValueError(f"stage_layers must end at the model's {num_layers} layers, got {ranges[-1][1]}")


def parse_stage_slowdowns(spec: str, num_stages: int) -> list[float]:
    """'1,3,3' -> [1.0, 3.0, 3.0] (one per stage); empty: every stage at full speed."""
    if not spec.strip():
        return [1.0] * num_stages
    slowdowns = []
    for part in (p.strip() for p in spec.split(",")):
        modes = speed_schedule(part).modes
        if len(modes) != 1:
            raise ValueError(f"stage_slowdowns: {part!r} changes speed over time; a stage needs one slowdown")
        slowdowns.append(modes[0])
    if len(slowdowns) != num_stages:
        raise ValueError(f"stage_slowdowns: {len(slowdowns)} values for {num_stages} stages")
    return slowdowns


def parse_stage_links(spec: str, num_stages: int) -> list[LinkProfile]:
    """P+1 hop profiles from 'spec;spec;...' (one spec alone: every hop); empty: every hop unshaped."""
    if not spec.strip():
        return [UNSHAPED] * (num_stages + 1)
    parts = [p.strip() for p in spec.split(";")]
    profiles = [parse_link_spec(p) for p in parts]
    if len(profiles) == 1:
        return profiles * (num_stages + 1)
    if len(profiles) != num_stages + 1:
        raise ValueError(
            f"stage_links: {len(profiles)} hop specs for {num_stages} stages "
            f"(give {num_stages + 1}: main -> stage 0, ..., stage {num_stages - 1} -> main, or one "
            "for every hop)"
        )
    return profiles


def parse_address(text: str) -> tuple[str, int]:
    """`host:port` (a bracketed IPv6 host allowed) as an Address; ValueError naming the problem."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    return host, int(port)
