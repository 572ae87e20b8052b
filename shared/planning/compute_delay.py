"""g(mu), the cloud's compute delay per batched size (HAT eq. 2), bucketed on a log2 scale.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.planning.ema import DEFAULT_ALPHA, Ema, check_alpha, check_sample


@dataclass
class _Bucket:
    mu: Ema  # where in the bucket the samples actually fell (x)
    eta: Ema  # compute seconds at that size (y), eq. 2
    updated_at: float | None = None
    # every sample's mu and eta added up (the count is eta's): two snapshots of a bucket give the plain means of
    # the samples between them, where the EMAs weigh the last few (the simulator's check of one run needs those)
    mu_sum: float = 0.0
    eta_sum: float = 0.0


class ComputeDelayPredictor:
    """g(mu): predicted compute seconds of a batch of `mu` tokens (eq. 2).

    `buckets_per_octave` sets resolution (bucket k covers mu around 2**(k/bpo)).
    With `monotone`, a running max over buckets makes predict() non-decreasing.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA, buckets_per_octave: int = 2, monotone: bool = True) -> None:
        self.alpha = check_alpha(alpha)
        if buckets_per_octave < 1:
            raise ValueError("buckets_per_octave must be >= 1")
        self.buckets_per_octave = int(buckets_per_octave)
        self.monotone = bool(monotone)
        self._buckets: dict[int, _Bucket] = {}

    def bucket_of(self, mu: float) -> int:
        return round(math.log2(max(float(mu), 1.0)) * self.buckets_per_octave)

    def observe(self, mu_hat: float, eta_hat: float, now: float | None = None) -> None:
        """Fold one round's (batched tokens, compute seconds) into its bucket."""
        mu_hat = check_sample(mu_hat, "mu_hat")
        eta_hat = check_sample(eta_hat, "eta_hat")
        if mu_hat < 1 or eta_hat < 0:
            raise ValueError(f"need mu_hat >= 1 and eta_hat >= 0, got {mu_hat!r}, {eta_hat!r}")
        key = self.bucket_of(mu_hat)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(Ema(self.alpha), Ema(self.alpha))
        bucket.mu.update(mu_hat)
        bucket.eta.update(eta_hat)
        bucket.mu_sum += mu_hat
        bucket.eta_sum += eta_hat
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
        mu = check_sample(mu, "mu")
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
            {
                "bucket": k,
                "mu_lo": 2 ** ((k - 0.5) / self.buckets_per_octave),
                "mu_hi": 2 ** ((k + 0.5) / self.buckets_per_octave),
                "mu": b.mu.value,
                "eta": b.eta.value,
                "count": b.eta.count,
                "mu_sum": b.mu_sum,
                "eta_sum": b.eta_sum,
                "updated_at": b.updated_at,
            }
            for k, b in sorted(self._buckets.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "buckets_per_octave": self.buckets_per_octave,
            "monotone": self.monotone,
            "buckets": [
                {
                    "bucket": k,
                    "mu": b.mu.to_dict(),
                    "eta": b.eta.to_dict(),
                    "updated_at": b.updated_at,
                    "mu_sum": b.mu_sum,
                    "eta_sum": b.eta_sum,
                }
                for k, b in sorted(self._buckets.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ComputeDelayPredictor:
        pred = cls(
            alpha=float(data.get("alpha", DEFAULT_ALPHA)),
            buckets_per_octave=int(data.get("buckets_per_octave", 2)),
            monotone=bool(data.get("monotone", True)),
        )
        for item in data.get("buckets", []):
            mu, eta = Ema.from_dict(item["mu"]), Ema.from_dict(item["eta"])
            if mu.value is None or eta.value is None:
                continue
            updated = item.get("updated_at")
            pred._buckets[int(item["bucket"])] = _Bucket(
                mu,
                eta,
                None if updated is None else float(updated),
                float(item.get("mu_sum", 0.0)),
                float(item.get("eta_sum", 0.0)),
            )
        return pred
