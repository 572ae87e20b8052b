"""Calibrate the simulator from a running mesh's state monitor.

What the monitor knows (services/state_monitor/app.py):

* ``GET /state/cloud`` -> ``{"mu", "g": {"buckets": [{"mu", "eta", "mu_lo", "mu_hi", ...}]}, ...}``:
  g(mu) per log2 bucket, each an EMA (eq. 2) of whole-middle compute seconds (with P > 1
  stages the verifier reports the *sum* of the stages' compute, i.e. exactly what the
  simulator's g means). Rebuilt with `shared.planning.monitor_plans.predictor_from_cloud_state`, so the
  table is the monotone curve the chunk planner itself uses. ``"step_overhead_s"``: a step's
  wall time beyond its compute (scheduling, thread hop, replies), added to every simulated step.
* ``GET /state/devices`` -> ``{"devices": [{"device_id", "gamma", "beta_up", "beta_down",
  "round_overhead_s", "prefill_token_s", "rtt_s", ...}]}``; the simulator's round_overhead_s is
  the devices' mean, a device's one-way latency half its probed small-message round trip.

What it does not know, and where the value comes from instead (the `base` calibration,
`demo` by default, see calibration.py): prefill cost per prompt token when a device
has not reported it (scaled from the base by gamma), latency when it has not probed, the
accept-length distribution (per-request accept lengths go to Redis, not to /state),
the parallel-drafting hit rate, the model shape. Every choice is written to `notes`.

Caveats worth knowing when comparing with the real mesh: gamma is measured before the
device agent's emulated slowdown (pass `device_slowdowns`), and beta_up is measured from a
chunk's send to its answer, so it includes one round trip and the cloud's compute and
errs low (cloud_client.py says so).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import urllib.request
from typing import Any

from loadgen.simulate.calibration import BASES, Calibration, DeviceProfile
from shared.planning.monitor_plans import predictor_from_cloud_state

log = logging.getLogger(__name__)


def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (operator-given URL)
        return json.loads(response.read().decode())


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _non_negative(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _fleet_mean(
    entries: list[dict[str, Any]], key: str, *, at_most: float = math.inf, only_with: str | None = None
) -> tuple[float | None, int]:
    """Mean of `key` over the devices that report a usable value (optionally only those that
    also report `only_with`), and how many did."""
    values = [
        v
        for e in entries
        if (only_with is None or _non_negative(e.get(only_with)) is not None)
        and (v := _non_negative(e.get(key))) is not None
        and v <= at_most
    ]
    return (sum(values) / len(values) if values else None), len(values)


def calibration_from_state(
    cloud: dict[str, Any] | None,
    devices: dict[str, Any] | None,
    base: Calibration | None = None,
    device_slowdowns: dict[str, float] | None = None,
    cloud_before: dict[str, Any] | None = None,
) -> Calibration:
    """Pure part of `from_telemetry`: the monitor's two JSON documents -> a Calibration. With `cloud_before` (an
    earlier read of /state/cloud), g(mu) is the plain mean of the steps between the two reads."""
    base = base or BASES["demo"]()
    notes: list[str] = []
    g_table = _g_table_between(cloud_before, cloud, notes) if cloud_before is not None else None
    g_table = g_table or _g_table(cloud, base, notes)
    entries = [e for e in (devices or {}).get("devices", []) if isinstance(e, dict) and e.get("device_id")]
    profiles = _device_profiles(entries, base, device_slowdowns or {}, notes)
    round_overhead_s, round_overhead_median_s = _round_overheads(entries, base, notes)
    step_overhead_s = _non_negative((cloud or {}).get("step_overhead_s"))
    if step_overhead_s is not None:
        notes.append(f"step_overhead_s {step_overhead_s * 1e3:.2f} ms: telemetry")
    else:
        step_overhead_s = base.step_overhead_s
    pd_hit_rate, with_pd = _fleet_mean(entries, "pd_hit_rate", at_most=1.0)
    pd_hit_rate = base.pd_hit_rate if pd_hit_rate is None else pd_hit_rate
    notes.append(
        f"pd_hit_rate {pd_hit_rate:.2f}: " + (f"mean of {with_pd} devices' telemetry" if with_pd else "base value")
    )
    full_accept_rate, with_full = _fleet_mean(entries, "full_accept_rate", at_most=1.0)
    if full_accept_rate is None:
        full_accept_rate = base.full_accept_rate
    else:
        notes.append(f"full_accept_rate {full_accept_rate:.2f}: mean of {with_full} devices' telemetry")
    notes.append(
        f"accept_dist (mean {base.mean_accept_length:.2f}), "
        f"hidden {base.hidden_size}, n={base.num_layers}, m={base.split_layers}: base values"
    )
    return dataclasses.replace(
        base,
        g_table=g_table,
        devices=profiles,
        round_overhead_s=round_overhead_s,
        round_overhead_median_s=round_overhead_median_s,
        step_overhead_s=step_overhead_s,
        pd_hit_rate=pd_hit_rate,
        full_accept_rate=full_accept_rate,
        notes=base.notes + notes,
    )


def _g_table(cloud: dict[str, Any] | None, base: Calibration, notes: list[str]) -> list[tuple[float, float]]:
    """g(mu) as the chunk planner rebuilds it from the cloud's buckets, else the base's table."""
    predictor = predictor_from_cloud_state(cloud) if cloud else None
    if predictor is None:
        notes.append("g(mu): no telemetry buckets, base table")
        return base.g_table
    g_table = [(mu, eta) for mu, eta in predictor.points() if mu > 0]
    notes.append(f"g(mu): {len(g_table)} telemetry buckets, mu {g_table[0][0]:.0f}..{g_table[-1][0]:.0f}")
    return g_table


def _g_table_between(
    before: dict[str, Any], after: dict[str, Any] | None, notes: list[str]
) -> list[tuple[float, float]] | None:
    """g(mu) from the steps between two reads of /state/cloud: per bucket, the samples' summed mu and eta over
    their count, as the planner's curve is rebuilt from buckets (`predictor_from_cloud_state`: non-decreasing);
    None where no bucket saw a step in between. The monitor's EMAs weigh a bucket's last few steps, which on a
    shared box swing with whatever else ran then; a run's own means are what its requests met."""

    def sums(cloud: dict[str, Any] | None) -> dict[int, tuple[float, float, float]]:
        g = (cloud or {}).get("g")
        buckets = g.get("buckets") if isinstance(g, dict) else None
        found: dict[int, tuple[float, float, float]] = {}
        for b in buckets if isinstance(buckets, list) else []:
            if not isinstance(b, dict) or not isinstance(b.get("bucket"), int):
                continue
            count, mu_sum, eta_sum = (_non_negative(b.get(key)) for key in ("count", "mu_sum", "eta_sum"))
            if count is not None and mu_sum is not None and eta_sum is not None:
                found[b["bucket"]] = (count, mu_sum, eta_sum)
        return found

    start, means, steps = sums(before), [], 0
    for bucket, (count, mu_sum, eta_sum) in sorted(sums(after).items()):
        count0, mu0, eta0 = start.get(bucket, (0.0, 0.0, 0.0))
        if (n := count - count0) >= 1:
            means.append({"bucket": bucket, "mu": (mu_sum - mu0) / n, "eta": (eta_sum - eta0) / n, "count": n})
            steps += int(n)
    predictor = predictor_from_cloud_state({**(after or {}), "g": {"buckets": means}}) if means else None
    if predictor is None:
        return None
    g_table = [(mu, eta) for mu, eta in predictor.points() if mu > 0]
    notes.append(
        f"g(mu): means of the run's {steps} steps in {len(means)} buckets, mu {g_table[0][0]:.0f}..{g_table[-1][0]:.0f}"
    )
    return g_table


def _device_profiles(
    entries: list[dict[str, Any]], base: Calibration, slowdowns: dict[str, float], notes: list[str]
) -> list[DeviceProfile]:
    """One profile per device that reported (what it did not report from the base's first device), else the
    base's profiles."""
    ref = base.devices[0]
    profiles: list[DeviceProfile] = []
    scaled_prefill: list[str] = []
    probed_latency: list[str] = []
    for entry in entries:
        profile, probed, scaled = _device_profile(entry, ref, slowdowns, notes)
        profiles.append(profile)
        if probed:
            probed_latency.append(profile.device_id)
        if scaled:
            scaled_prefill.append(profile.device_id)
    if not profiles:
        notes.append("no devices in telemetry: base device profiles")
        return list(base.devices)
    notes.append(
        f"{len(profiles)} device profiles from telemetry; one-way latency = half the probed "
        f"small-message round trip for {len(probed_latency)}, else {ref.latency_s * 1e3:.1f} ms "
        "from the base"
    )
    if scaled_prefill:
        notes.append(f"prefill_token_s scaled from the base by gamma for {', '.join(scaled_prefill)}")
    return profiles


def _device_profile(
    entry: dict[str, Any], ref: DeviceProfile, slowdowns: dict[str, float], notes: list[str]
) -> tuple[DeviceProfile, bool, bool]:
    """(profile, whether its latency was probed, whether its prefill cost was scaled from the base by gamma)."""
    dev_id = str(entry["device_id"])
    gamma = _positive(entry.get("gamma"))
    up, down = _positive(entry.get("beta_up")), _positive(entry.get("beta_down"))
    missing = [name for name, v in (("gamma", gamma), ("beta_up", up), ("beta_down", down)) if v is None]
    if missing:
        notes.append(f"device {dev_id}: no {', '.join(missing)} in telemetry, base values")
    if entry.get("stale"):
        notes.append(f"device {dev_id}: telemetry is stale")
    gamma = gamma or ref.gamma_s
    rtt = _positive(entry.get("rtt_s"))
    token_s = _positive(entry.get("prefill_token_s"))
    scaled = token_s is None
    if token_s is None:
        token_s = ref.prefill_token_s * gamma / ref.gamma_s if ref.gamma_s > 0 else ref.prefill_token_s
    profile = DeviceProfile(
        dev_id,
        gamma,
        token_s,
        up or ref.beta_up,
        down or ref.beta_down,
        rtt / 2 if rtt else ref.latency_s,
        float(slowdowns.get(dev_id, 1.0)),
    )
    return profile, rtt is not None, scaled


def _round_overheads(entries: list[dict[str, Any]], base: Calibration, notes: list[str]) -> tuple[float, float | None]:
    """(round_overhead_s, its median): the devices' means where they report them, else the base's."""
    overhead, with_overhead = _fleet_mean(entries, "round_overhead_s")
    if overhead is None:
        notes.append(f"round_overhead_s {base.round_overhead_s * 1e3:.2f} ms: base value")
        return base.round_overhead_s, base.round_overhead_median_s
    median, with_median = _fleet_mean(entries, "round_overhead_median_s", only_with="round_overhead_s")
    median_s = median if with_median == with_overhead else None  # a mean of all or nothing
    median_note = f", median {median_s * 1e3:.2f} ms" if median_s is not None else ""
    notes.append(f"round_overhead_s {overhead * 1e3:.2f} ms{median_note}: mean of {with_overhead} devices' telemetry")
    return overhead, median_s


def from_telemetry(
    state_monitor_url: str,
    *,
    base: Calibration | None = None,
    timeout_s: float = 2.0,
    device_slowdowns: dict[str, float] | None = None,
    cloud_before: dict[str, Any] | None = None,
) -> Calibration:
    """GET /state/cloud and /state/devices from a running state monitor and fill what it knows (g(mu) from the
    steps since `cloud_before`, a `cloud_state` read, where given).

    An unreachable monitor raises (OSError/ValueError); a monitor without data yields the base.
    """
    root = state_monitor_url.rstrip("/")
    cloud = cloud_state(root, timeout_s)
    devices = _get_json(f"{root}/state/devices", timeout_s)
    cal = calibration_from_state(cloud, devices, base, device_slowdowns, cloud_before)
    for note in cal.notes:
        log.info("calibration: %s", note)
    return cal


def cloud_state(state_monitor_url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """GET /state/cloud: what `from_telemetry` takes as `cloud_before` to fit g(mu) to the steps after it."""
    return _get_json(f"{state_monitor_url.rstrip('/')}/state/cloud", timeout_s)
