"""State model of HAT §3.2 (state monitoring): pure math, no I/O.

Cloud side. Every verifier round t reports the batched token count mu_hat^t and
the batch compute delay eta_hat^t. The monitor keeps
    mu^t   = a * mu^{t-1}   + (1 - a) * mu_hat^t      (eq. 1)
    g^t(m) = a * g^{t-1}(m) + (1 - a) * eta_hat^t     (eq. 2)
with a = 0.8; the first sample initializes an average instead of being blended
with zero.

Why g is bucketed. eq. 2 needs "g at the batched size of this round", but the
batched sizes are not spread evenly: decode/verify steps batch a few tokens per
session (small mu), prefill chunks add hundreds (large mu), so observations
cluster in a few regions that span orders of magnitude. One global line fit
would let the many cheap decode steps drag the estimate for prefill chunks (and
vice versa). Buckets on a log2 scale give each region its own EMA, with equal
relative resolution at 8 and at 2048 tokens, so the curve adapts per region as
load shifts. Between observed buckets we interpolate linearly; beyond them we
extrapolate linearly (least-squares slope over all buckets as fallback). Each
bucket also averages the mu values it saw, so the curve runs through where the
data actually is, not through nominal bucket centers.

Device side. Each device reports its draft step time gamma and the bytes and
seconds of real uploads/downloads, from which beta_up/beta_down (bytes/s) are
averaged the same way. `last_update` lets consumers notice a silent device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_ALPHA = 0.8


def _check_alpha(alpha: float) -> float:
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")
    return float(alpha)


def _check_sample(x: float, name: str) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return x


@dataclass
class Ema:
    """Exponential moving average v = a*v + (1-a)*x; the first sample sets v."""

    alpha: float = DEFAULT_ALPHA
    value: float | None = None
    count: int = 0

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)

    def update(self, sample: float) -> float:
        sample = _check_sample(sample, "sample")
        if self.value is None:
            self.value = sample
        else:
            self.value = self.alpha * self.value + (1.0 - self.alpha) * sample
        self.count += 1
        return self.value

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "value": self.value, "count": self.count}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ema:
        value = data.get("value")
        return cls(alpha=float(data.get("alpha", DEFAULT_ALPHA)),
                   value=None if value is None else float(value), count=int(data.get("count", 0)))


@dataclass
class _Bucket:
    mu: Ema      # where in the bucket the samples actually fell (x)
    eta: Ema     # compute seconds at that size (y), eq. 2
    updated_at: float | None = None


class ComputeDelayPredictor:
    """g(mu): predicted compute seconds of a batch of `mu` tokens (eq. 2).

    `buckets_per_octave` sets resolution (bucket k covers mu around 2**(k/bpo)).
    With `monotone`, a running max over buckets makes predict() non-decreasing.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA, buckets_per_octave: int = 2, monotone: bool = True) -> None:
        self.alpha = _check_alpha(alpha)
        if buckets_per_octave < 1:
            raise ValueError("buckets_per_octave must be >= 1")
        self.buckets_per_octave = int(buckets_per_octave)
        self.monotone = bool(monotone)
        self._buckets: dict[int, _Bucket] = {}

    def bucket_of(self, mu: float) -> int:
        return round(math.log2(max(float(mu), 1.0)) * self.buckets_per_octave)

    def observe(self, mu_hat: float, eta_hat: float, now: float | None = None) -> None:
        """Fold one round's (batched tokens, compute seconds) into its bucket."""
        mu_hat = _check_sample(mu_hat, "mu_hat")
        eta_hat = _check_sample(eta_hat, "eta_hat")
        if mu_hat < 1 or eta_hat < 0:
            raise ValueError(f"need mu_hat >= 1 and eta_hat >= 0, got {mu_hat!r}, {eta_hat!r}")
        key = self.bucket_of(mu_hat)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(Ema(self.alpha), Ema(self.alpha))
        bucket.mu.update(mu_hat)
        bucket.eta.update(eta_hat)
        bucket.updated_at = now

    @property
    def observed_buckets(self) -> int:
        return len(self._buckets)

    def points(self) -> list[tuple[float, float]]:
        """(mu, eta) per observed bucket in mu order; running max applied if monotone."""
        pts: list[tuple[float, float]] = []
        top = -math.inf
        for key in sorted(self._buckets):
            b = self._buckets[key]
            y = b.eta.value or 0.0
            if self.monotone:
                top = max(top, y)
                y = top
            pts.append((b.mu.value or 0.0, y))
        return pts

    def fit_line(self) -> tuple[float, float] | None:
        """Least-squares c1, c2 of eta ~ c1*mu + c2 over bucket points (None if < 2 distinct mu)."""
        pts = self.points()
        n = len(pts)
        if n < 2:
            return None
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        if sxx <= 0:
            return None
        c1 = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
        return c1, my - c1 * mx

    def predict(self, mu: float) -> float | None:
        """Predicted compute seconds for `mu` batched tokens; None before any data.

        One bucket: that bucket's value everywhere (no slope is known yet).
        Inside the observed range: linear interpolation between neighbours.
        Outside: linear extrapolation from the edge segment, falling back to the
        least-squares slope when the edge segment is flat or degenerate; the
        slope is never negative under `monotone`, and the result is >= 0.
        """
        mu = _check_sample(mu, "mu")
        pts = self.points()
        if not pts:
            return None
        if len(pts) == 1:
            return max(pts[0][1], 0.0)
        if mu <= pts[0][0]:
            (x0, y0), (x1, y1) = pts[0], pts[1]
            anchor_x, anchor_y = x0, y0
        elif mu >= pts[-1][0]:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            anchor_x, anchor_y = x1, y1
        else:
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                if x0 <= mu <= x1:
                    if x1 <= x0:
                        return max(y0, y1)
                    return y0 + (y1 - y0) * (mu - x0) / (x1 - x0)
            raise AssertionError("unreachable: mu inside the observed range")
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        if slope <= 0:
            line = self.fit_line()
            slope = line[0] if line else 0.0
        if self.monotone:
            slope = max(slope, 0.0)
        return max(anchor_y + slope * (mu - anchor_x), 0.0)

    def table(self) -> list[dict[str, Any]]:
        """Bucket table for APIs and dashboards (raw EMAs, before the running max)."""
        return [
            {"bucket": k, "mu_lo": 2 ** ((k - 0.5) / self.buckets_per_octave),
             "mu_hi": 2 ** ((k + 0.5) / self.buckets_per_octave), "mu": b.mu.value,
             "eta": b.eta.value, "count": b.eta.count, "updated_at": b.updated_at}
            for k, b in sorted(self._buckets.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "buckets_per_octave": self.buckets_per_octave,
                "monotone": self.monotone,
                "buckets": [{"bucket": k, "mu": b.mu.to_dict(), "eta": b.eta.to_dict(),
                             "updated_at": b.updated_at} for k, b in sorted(self._buckets.items())]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ComputeDelayPredictor:
        pred = cls(alpha=float(data.get("alpha", DEFAULT_ALPHA)),
                   buckets_per_octave=int(data.get("buckets_per_octave", 2)),
                   monotone=bool(data.get("monotone", True)))
        for item in data.get("buckets", []):
            mu, eta = Ema.from_dict(item["mu"]), Ema.from_dict(item["eta"])
            if mu.value is None or eta.value is None:
                continue
            updated = item.get("updated_at")
            pred._buckets[int(item["bucket"])] = _Bucket(mu, eta, None if updated is None else float(updated))
        return pred


@dataclass
class CloudState:
    """Cloud load as the monitor sees it: mu (eq. 1), g (eq. 2) and the last raw round."""

    alpha: float = DEFAULT_ALPHA
    mu: Ema = field(default_factory=Ema)
    eta: Ema = field(default_factory=Ema)  # overall average step time, for dashboards
    # A step's wall time beyond its compute (scheduling, thread hop, replies): not in g(mu), but
    # every step pays it, so the simulator adds it to each step.
    step_overhead: Ema = field(default_factory=Ema)
    g: ComputeDelayPredictor = field(default_factory=ComputeDelayPredictor)
    last: dict[str, Any] = field(default_factory=dict)
    updated_at: float | None = None

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        self.mu.alpha = self.eta.alpha = self.g.alpha = self.step_overhead.alpha = self.alpha

    def observe_step(self, mu_hat: float, eta_hat: float, now: float, overhead_s: float | None = None,
                     **extra: Any) -> None:
        self.mu.update(mu_hat)
        self.eta.update(eta_hat)
        if overhead_s is not None:
            self.step_overhead.update(overhead_s)
        if mu_hat >= 1:  # an empty round says nothing about g
            self.g.observe(mu_hat, eta_hat, now)
        self.last = {"mu_hat": mu_hat, "eta_hat": eta_hat, **extra}
        self.updated_at = now

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "mu": self.mu.to_dict(), "eta": self.eta.to_dict(),
                "step_overhead": self.step_overhead.to_dict(), "g": self.g.to_dict(), "last": self.last, "updated_at": self.updated_at}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CloudState:
        return cls(alpha=float(data.get("alpha", DEFAULT_ALPHA)), mu=Ema.from_dict(data.get("mu", {})),
                   eta=Ema.from_dict(data.get("eta", {})),
                   step_overhead=Ema.from_dict(data.get("step_overhead", {})), g=ComputeDelayPredictor.from_dict(data.get("g", {})),
                   last=dict(data.get("last", {})), updated_at=data.get("updated_at"))


@dataclass
class DeviceState:
    """Per-device capabilities: gamma (draft step s), beta_up / beta_down (bytes/s)."""

    device_id: str
    alpha: float = DEFAULT_ALPHA
    gamma: Ema = field(default_factory=Ema)
    beta_up: Ema = field(default_factory=Ema)
    beta_down: Ema = field(default_factory=Ema)
    # Seconds per decode round outside drafting and the cloud wait (head, accept, thread hops):
    # not a HAT quantity, but the simulator needs it to reproduce the mesh's TBT.
    round_overhead: Ema = field(default_factory=Ema)
    round_overhead_median: Ema = field(default_factory=Ema)  # the same per-round times are skewed: their median
    prefill_token: Ema = field(default_factory=Ema)  # seconds per prompt token on the device
    rtt: Ema = field(default_factory=Ema)  # a one-row message's round trip to the cloud (latency + framing)
    pd_hit: Ema = field(default_factory=Ema)  # parallel drafting: corrections that were a pre-drafted candidate
    full_accept: Ema = field(default_factory=Ema)  # rounds that accepted every drafted token
    last_update: float | None = None

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        for ema in (self.gamma, self.beta_up, self.beta_down, self.round_overhead, self.round_overhead_median,
                    self.prefill_token, self.rtt, self.pd_hit, self.full_accept):
            ema.alpha = self.alpha

    def observe_draft(self, step_seconds: float, now: float, *, round_overhead_s: float | None = None,
                      prefill_token_s: float | None = None, pd_hit_rate: float | None = None,
                      round_overhead_median_s: float | None = None, full_accept_rate: float | None = None) -> None:
        if not step_seconds > 0:
            raise ValueError(f"draft step seconds must be > 0, got {step_seconds!r}")
        for name, value in (("round overhead", round_overhead_s), ("round overhead median", round_overhead_median_s)):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} seconds must be >= 0, got {value!r}")
        if prefill_token_s is not None and not prefill_token_s > 0:
            raise ValueError(f"prefill seconds per token must be > 0, got {prefill_token_s!r}")
        for name, rate in (("pd hit rate", pd_hit_rate), ("full accept rate", full_accept_rate)):
            if rate is not None and not 0 <= rate <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {rate!r}")
        self.gamma.update(step_seconds)
        if round_overhead_s is not None:
            self.round_overhead.update(round_overhead_s)
        if round_overhead_median_s is not None:
            self.round_overhead_median.update(round_overhead_median_s)
        if prefill_token_s is not None:
            self.prefill_token.update(prefill_token_s)
        if pd_hit_rate is not None:
            self.pd_hit.update(pd_hit_rate)
        if full_accept_rate is not None:
            self.full_accept.update(full_accept_rate)
        self.last_update = now

    def observe_rtt(self, rtt_seconds: float, now: float) -> None:
        if not rtt_seconds > 0:
            raise ValueError(f"round-trip seconds must be > 0, got {rtt_seconds!r}")
        self.rtt.update(rtt_seconds)
        self.last_update = now

    def observe_transfer(self, direction: str, nbytes: int, seconds: float, now: float) -> float:
        """Fold one real transfer in; returns its bandwidth in bytes/s."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        if nbytes < 0 or not seconds > 0:
            raise ValueError(f"need bytes >= 0 and seconds > 0, got {nbytes!r}, {seconds!r}")
        rate = nbytes / seconds
        (self.beta_up if direction == "up" else self.beta_down).update(rate)
        self.last_update = now
        return rate

    def age(self, now: float) -> float | None:
        return None if self.last_update is None else max(now - self.last_update, 0.0)

    def is_stale(self, now: float, max_age_s: float) -> bool:
        age = self.age(now)
        return age is None or age > max_age_s

    def to_dict(self) -> dict[str, Any]:
        return {"device_id": self.device_id, "alpha": self.alpha, "gamma": self.gamma.to_dict(),
                "beta_up": self.beta_up.to_dict(), "beta_down": self.beta_down.to_dict(),
                "round_overhead": self.round_overhead.to_dict(),
                "round_overhead_median": self.round_overhead_median.to_dict(), "prefill_token": self.prefill_token.to_dict(),
                "rtt": self.rtt.to_dict(), "pd_hit": self.pd_hit.to_dict(),
                "full_accept": self.full_accept.to_dict(), "last_update": self.last_update}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceState:
        last = data.get("last_update")
        return cls(device_id=str(data["device_id"]), alpha=float(data.get("alpha", DEFAULT_ALPHA)),
                   gamma=Ema.from_dict(data.get("gamma", {})), beta_up=Ema.from_dict(data.get("beta_up", {})),
                   beta_down=Ema.from_dict(data.get("beta_down", {})),
                   round_overhead=Ema.from_dict(data.get("round_overhead", {})),
                   round_overhead_median=Ema.from_dict(data.get("round_overhead_median", {})),
                   prefill_token=Ema.from_dict(data.get("prefill_token", {})),
                   rtt=Ema.from_dict(data.get("rtt", {})), pd_hit=Ema.from_dict(data.get("pd_hit", {})),
                   full_accept=Ema.from_dict(data.get("full_accept", {})),
                   last_update=None if last is None else float(last))
