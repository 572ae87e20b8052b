"""The web console's view of the mesh: one row per device and per verifier, from what is measured.

Pure functions over what the token streamer already holds or can read (services/token_streamer/console.py
gathers them): its router's view of each device agent, each agent's GET /info, the state monitor's device
and cloud state (GET /state/devices, /state/cloud) and the console's own request history
(shared/console/history.py). A field nobody measures is None (the page shows "—"); nothing is estimated here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

BITS_PER_BYTE = 8


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _scaled(value: Any, factor: float) -> float | None:
    number = _number(value)
    return None if number is None else number * factor


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def g_points(cloud: Mapping[str, Any]) -> list[tuple[float, float]]:
    """The verifier's measured g(mu): (batched tokens, step seconds) per bucket that has both, by mu."""
    buckets = ((cloud.get("g") or {}).get("buckets")) or []
    points = [(_number(b.get("mu")), _number(b.get("eta"))) for b in buckets if isinstance(b, Mapping)]
    return sorted((mu, eta) for mu, eta in points if mu is not None and eta is not None)


def interpolate(points: Sequence[tuple[float, float]], x: float | None) -> float | None:
    """Piecewise-linear y at `x` between measured points, the nearest point's y outside them; None without
    points or x. Only what was measured: no slope is extended beyond the measured range."""
    if x is None or not points:
        return None
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def device_rows(
    routed: Sequence[Mapping[str, Any]],
    infos: Mapping[str, Mapping[str, Any] | None],
    seen_at: Mapping[str, float],
    monitored: Mapping[str, Mapping[str, Any]],
    mean_accept: Mapping[str, float],
    now: float,
) -> list[dict[str, Any]]:
    """A row per device the streamer routes to. `routed`: its router's snapshot; `infos`: each URL's
    last /info answer (None: it did not answer); `seen_at`: when each URL last answered (unix s);
    `monitored`: the state monitor's device state by device id; `mean_accept`: accept length by device id."""
    rows = []
    for entry in routed:
        url = str(entry.get("url"))
        info = infos.get(url) or {}
        device_id = _text(info.get("device_id")) or _text(entry.get("device_id"))
        state = monitored.get(device_id or "", {})
        heard = [t for t in (seen_at.get(url), _number(state.get("last_update"))) if t is not None]
        sessions = info.get("active_sessions", entry.get("outstanding"))
        rows.append(
            {
                "device_id": device_id,
                "url": url,
                "speed_class": _text(info.get("speed")),
                "mode": _text(info.get("mode")),
                "rtt_ms": _scaled(state.get("rtt_s"), 1e3),
                "up_mbps": _scaled(state.get("beta_up"), BITS_PER_BYTE / 1e6),
                "down_mbps": _scaled(state.get("beta_down"), BITS_PER_BYTE / 1e6),
                "draft_step_ms": _scaled(state.get("gamma"), 1e3),
                "sessions": _number(sessions),
                "max_sessions": _number(info.get("max_sessions", entry.get("max_sessions"))),
                "mean_accept_length": mean_accept.get(device_id or ""),
                "draft_shape": _text(info.get("draft_shape")),
                "draft_shape_source": _text(info.get("draft_shape_source")),
                "ready": bool(entry.get("healthy")) and bool(info),
                "last_seen_s": max(0.0, now - max(heard)) if heard else None,
                "served": entry.get("served"),
                "failures": entry.get("failures"),
                "last_error": entry.get("last_error"),
            }
        )
    return sorted(rows, key=lambda row: (row["device_id"] is None, row["device_id"] or row["url"]))


def verifier_rows(cloud: Mapping[str, Any] | None, now: float) -> list[dict[str, Any]]:
    """The verifier as the state monitor sees it from its step records (none before its first step).
    Replicas report into one state (their records carry no replica name), so this is one row for them all."""
    if not cloud or not cloud.get("steps"):
        return []
    last = cloud.get("last") or {}
    mu = _number(cloud.get("mu"))
    points = g_points(cloud)
    updated = _number(cloud.get("updated_at"))
    return [
        {
            "name": "verifier",
            "runs_on": _text(last.get("runs_on")),
            "sessions": _number(last.get("num_sessions")),
            "rows_per_step": mu,
            "step_ms": _scaled(cloud.get("eta"), 1e3),
            "g_at_mu_ms": _scaled(interpolate(points, mu), 1e3),
            "g_points": [[x, y * 1e3] for x, y in points],
            "steps": _number(cloud.get("steps")),
            "pipeline_stages": _number(last.get("pipeline_stages")),
            "last_seen_s": max(0.0, now - updated) if updated is not None else None,
        }
    ]


def mesh_view(
    routed: Sequence[Mapping[str, Any]],
    infos: Mapping[str, Mapping[str, Any] | None],
    seen_at: Mapping[str, float],
    monitor_devices: Sequence[Mapping[str, Any]] | None,
    monitor_cloud: Mapping[str, Any] | None,
    mean_accept: Mapping[str, float],
    now: float,
    monitor: str,
) -> dict[str, Any]:
    """GET /console/mesh's body. `monitor`: "ok", "unreachable" or "not configured" (its fields are then None)."""
    monitored = {str(d.get("device_id")): d for d in monitor_devices or () if isinstance(d, Mapping)}
    return {
        "now": now,
        "monitor": monitor,
        "devices": device_rows(routed, infos, seen_at, monitored, mean_accept, now),
        "verifiers": verifier_rows(monitor_cloud, now),
    }
