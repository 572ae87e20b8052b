"""HAT planners applied to the state monitor's JSON: eq. 3 / eq. 6 from live telemetry, or a named default.

No I/O here. The chunk-planner service fetches the state monitor's JSON and
hands it to `plan_from_state` / `plan_draft_steps_from_state`, which either
apply the equations (shared/planning/planners.py) or name the reason they could
not ("default:<reason>"), so the HTTP layer can report a truthful `source`.

Default reasons (the `source` suffix after "default:"):
    no-telemetry   the monitor knows nothing yet (unknown device, no g(mu) data)
    stale          the device's telemetry is older than `stale_after_s`
    missing-beta   the device reported no uplink (eq. 3) / up+down (eq. 6) transfers
    missing-gamma  the device reported no draft-step time (eq. 6)
    bad-telemetry  values present but unusable (non-finite, non-positive bandwidth)
    no-bytes-per-token  neither the caller nor the planner's configuration gave A
The service adds reasons of its own for failures before any JSON exists
(no-monitor, monitor-unreachable, monitor-error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.planners import chunk_size_eq3, parallel_draft_steps_eq6


@dataclass(frozen=True)
class PlannerInputs:
    """Static planner configuration that, with the monitor's telemetry, fixes eq. 3 / eq. 6.

    `stale_after_s` is the planner's own freshness policy: a device whose last
    telemetry is older is planned with defaults, since its bandwidth may have changed.
    """

    bytes_per_token: int | None  # A; None: unknown (eq. 3 / eq. 6 cannot be applied)
    stages: int = 1  # P
    min_chunk_size: int = 16
    max_chunk_size: int = 1024
    default_chunk_size: int = 128
    stale_after_s: float = 30.0
    default_draft_steps: int = 2
    max_draft_steps: int = 16

    def default_chunk(self, prompt_tokens: int) -> int:
        """The fallback chunk: default clamped to [min, max], never above the prompt."""
        size = min(max(self.default_chunk_size, self.min_chunk_size), self.max_chunk_size)
        return min(size, prompt_tokens)

    def default_steps(self) -> int:
        return min(max(self.default_draft_steps, 0), self.max_draft_steps)


def _finite(value: Any) -> float | None:
    """A finite float from JSON, or None (missing, null, NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def predictor_from_cloud_state(cloud: Mapping[str, Any]) -> ComputeDelayPredictor | None:
    """Rebuild g(μ) from `GET /state/cloud` (its `g.buckets` table); None if it has no usable bucket.

    The table carries each bucket's averaged μ and η; prediction only needs those
    points (interpolated, running max as the monitor's monotone predictor does).
    Buckets per octave are recovered from a bucket's mu_hi/mu_lo = 2**(1/bpo).
    """
    g = cloud.get("g")
    buckets = g.get("buckets") if isinstance(g, Mapping) else None
    if not isinstance(buckets, list):
        return None
    bpo = 2
    items: list[dict[str, Any]] = []
    for b in buckets:
        if not isinstance(b, Mapping) or not isinstance(b.get("bucket"), int):
            continue
        mu, eta = _finite(b.get("mu")), _finite(b.get("eta"))
        if mu is None or eta is None:
            continue
        lo, hi = _finite(b.get("mu_lo")), _finite(b.get("mu_hi"))
        if lo and hi and hi > lo > 0:
            bpo = max(1, round(1.0 / math.log2(hi / lo)))
        count = max(1, int(_finite(b.get("count")) or 1))
        items.append(
            {
                "bucket": b["bucket"],
                "mu": {"value": mu, "count": count},
                "eta": {"value": eta, "count": count},
                "updated_at": _finite(b.get("updated_at")),
            }
        )
    if not items:
        return None
    alpha = _finite(cloud.get("alpha"))
    return ComputeDelayPredictor.from_dict(
        {
            "alpha": alpha if alpha is not None and 0 <= alpha < 1 else 0.8,
            "buckets_per_octave": bpo,
            "monotone": True,
            "buckets": items,
        }
    )


def _cloud_terms(cloud: Mapping[str, Any] | None) -> tuple[Callable[[float], float], float] | str:
    """(g, μ) from the cloud JSON, or a default reason."""
    if cloud is None:
        return "no-telemetry"
    predictor = predictor_from_cloud_state(cloud)
    if predictor is None:
        return "no-telemetry"
    # g measured (the verifier's startup passes) but no step served yet: nothing is batched, mu = 0
    mu = _finite(cloud.get("mu")) if cloud.get("mu") is not None else 0.0
    if mu is None:
        return "no-telemetry"
    if mu < 0:
        return "bad-telemetry"

    def g(m: float) -> float:
        value = predictor.predict(m)
        return 0.0 if value is None else value  # cannot happen: the predictor has data

    return g, mu


def _device_problem(device: Mapping[str, Any] | None, stale_after_s: float) -> str | None:
    """Why a device's telemetry is unusable, or None.

    Freshness uses the monitor's `age_s` against the planner's `stale_after_s`;
    only when `age_s` is absent does the monitor's own `stale` flag decide.
    """
    if device is None or device.get("last_update") is None:
        return "no-telemetry"
    age = _finite(device.get("age_s"))
    stale = device.get("stale") is not False if age is None else age > stale_after_s
    return "stale" if stale else None


def usable_state(
    cloud: Mapping[str, Any] | None, device: Mapping[str, Any] | None, inputs: PlannerInputs
) -> tuple[int, Callable[[float], float], float, Mapping[str, Any]] | str:
    """(A, g, μ, device) when A is known and both sides have usable telemetry, else the default reason."""
    bytes_per_token = inputs.bytes_per_token
    if bytes_per_token is None:
        return "no-bytes-per-token"
    reason = _device_problem(device, inputs.stale_after_s)
    if reason is not None or device is None:
        return reason or "no-telemetry"
    terms = _cloud_terms(cloud)
    if isinstance(terms, str):
        return terms
    return bytes_per_token, terms[0], terms[1], device


def positive_field(device: Mapping[str, Any], key: str, missing: str) -> float | str:
    """A positive finite device value (bandwidth, step time), or the default reason."""
    value = device.get(key)
    if value is None:
        return missing
    x = _finite(value)
    return x if x is not None and x > 0 else "bad-telemetry"


def plan_from_state(
    cloud: Mapping[str, Any] | None, device: Mapping[str, Any] | None, inputs: PlannerInputs, prompt_tokens: int
) -> tuple[int, str]:
    """Chunk size for one prompt from the monitor's JSON: (size, "eq3") or (default, "default:<reason>").

    `cloud` is `GET /state/cloud`, `device` is `GET /state/device/{id}` (None for a 404).
    """
    state = usable_state(cloud, device, inputs)
    if isinstance(state, str):
        return inputs.default_chunk(prompt_tokens), f"default:{state}"
    bytes_per_token, g, mu, dev = state
    beta_up = positive_field(dev, "beta_up", "missing-beta")
    if isinstance(beta_up, str):
        return inputs.default_chunk(prompt_tokens), f"default:{beta_up}"
    size = chunk_size_eq3(
        bytes_per_token, beta_up, g, mu, inputs.stages, inputs.min_chunk_size, inputs.max_chunk_size, prompt_tokens
    )
    return size, "eq3"


def _eq6_terms(
    cloud: Mapping[str, Any] | None, device: Mapping[str, Any] | None, inputs: PlannerInputs
) -> tuple[int, float, float, float, float] | str:
    """(A, β_up, β_down, g(μ), γ) from the monitor's JSON, or the default reason."""
    state = usable_state(cloud, device, inputs)
    if isinstance(state, str):
        return state
    bytes_per_token, g, mu, dev = state
    beta_up = positive_field(dev, "beta_up", "missing-beta")
    beta_down = positive_field(dev, "beta_down", "missing-beta")
    gamma = positive_field(dev, "gamma", "missing-gamma")
    for value in (beta_up, beta_down, gamma):
        if isinstance(value, str):
            return value
    return bytes_per_token, float(beta_up), float(beta_down), g(mu), float(gamma)


def plan_draft_steps_table_from_state(
    cloud: Mapping[str, Any] | None, device: Mapping[str, Any] | None, inputs: PlannerInputs, max_draft_len: int
) -> tuple[list[int], str]:
    """λ for every draft length 0..max_draft_len from one telemetry snapshot, so a device can look
    up each round's λ for the rows it actually sends: ([λ_0..λ_max], "eq6") or the default for all."""
    terms = _eq6_terms(cloud, device, inputs)
    if isinstance(terms, str):
        return [inputs.default_steps()] * (max_draft_len + 1), f"default:{terms}"
    bytes_per_token, beta_up, beta_down, g_mu, gamma = terms
    return [
        parallel_draft_steps_eq6(n, bytes_per_token, beta_up, beta_down, g_mu, gamma, inputs.max_draft_steps)
        for n in range(max_draft_len + 1)
    ], "eq6"


def plan_draft_steps_from_state(
    cloud: Mapping[str, Any] | None, device: Mapping[str, Any] | None, inputs: PlannerInputs, draft_len: int
) -> tuple[int, str]:
    """Parallel-draft steps from the monitor's JSON: (λ, "eq6") or (default, "default:<reason>").

    `draft_len` is μ_i of eq. 6: the rows one verification moves each way (k drafts + 1)."""
    terms = _eq6_terms(cloud, device, inputs)
    if isinstance(terms, str):
        return inputs.default_steps(), f"default:{terms}"
    bytes_per_token, beta_up, beta_down, g_mu, gamma = terms
    return parallel_draft_steps_eq6(
        draft_len, bytes_per_token, beta_up, beta_down, g_mu, gamma, inputs.max_draft_steps
    ), "eq6"
