"""State model of HAT §3.2 (state monitoring): pure math, no I/O.

Cloud side. Every verifier round t reports the batched token count mu_hat^t and
the batch compute delay eta_hat^t. The monitor keeps
    mu^t   = a * mu^{t-1}   + (1 - a) * mu_hat^t      (eq. 1)
    g^t(m) = a * g^{t-1}(m) + (1 - a) * eta_hat^t     (eq. 2)
with a = 0.8; the first sample initializes an average instead of being blended
with zero. g is bucketed by batched size (shared/planning/compute_delay.py).

Device side. Each device reports its draft step time gamma and the bytes and
seconds of real uploads/downloads, from which beta_up/beta_down (bytes/s) are
averaged the same way. `last_update` lets consumers notice a silent device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.ema import DEFAULT_ALPHA, Ema, check_alpha


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
        check_alpha(self.alpha)
        self.mu.alpha = self.eta.alpha = self.g.alpha = self.step_overhead.alpha = self.alpha

    def observe_step(
        self, mu_hat: float, eta_hat: float, now: float, overhead_s: float | None = None, **extra: Any
    ) -> None:
        self.mu.update(mu_hat)
        self.eta.update(eta_hat)
        if overhead_s is not None:
            self.step_overhead.update(overhead_s)
        if mu_hat >= 1:  # an empty round says nothing about g
            self.g.observe(mu_hat, eta_hat, now)
        self.last = {"mu_hat": mu_hat, "eta_hat": eta_hat, **extra}
        self.updated_at = now

    def observe_calibration(self, rows: float, seconds: float, now: float) -> None:
        """A timed pass at the verifier's start: a point of g, but no load (mu) and no served step."""
        if rows >= 1:
            self.g.observe(rows, seconds, now)
            self.updated_at = now

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "mu": self.mu.to_dict(),
            "eta": self.eta.to_dict(),
            "step_overhead": self.step_overhead.to_dict(),
            "g": self.g.to_dict(),
            "last": self.last,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CloudState:
        return cls(
            alpha=float(data.get("alpha", DEFAULT_ALPHA)),
            mu=Ema.from_dict(data.get("mu", {})),
            eta=Ema.from_dict(data.get("eta", {})),
            step_overhead=Ema.from_dict(data.get("step_overhead", {})),
            g=ComputeDelayPredictor.from_dict(data.get("g", {})),
            last=dict(data.get("last", {})),
            updated_at=data.get("updated_at"),
        )


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
        check_alpha(self.alpha)
        for ema in (
            self.gamma,
            self.beta_up,
            self.beta_down,
            self.round_overhead,
            self.round_overhead_median,
            self.prefill_token,
            self.rtt,
            self.pd_hit,
            self.full_accept,
        ):
            ema.alpha = self.alpha

    def observe_draft(
        self,
        step_seconds: float,
        now: float,
        *,
        round_overhead_s: float | None = None,
        prefill_token_s: float | None = None,
        pd_hit_rate: float | None = None,
        round_overhead_median_s: float | None = None,
        full_accept_rate: float | None = None,
    ) -> None:
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
        return {
            "device_id": self.device_id,
            "alpha": self.alpha,
            "gamma": self.gamma.to_dict(),
            "beta_up": self.beta_up.to_dict(),
            "beta_down": self.beta_down.to_dict(),
            "round_overhead": self.round_overhead.to_dict(),
            "round_overhead_median": self.round_overhead_median.to_dict(),
            "prefill_token": self.prefill_token.to_dict(),
            "rtt": self.rtt.to_dict(),
            "pd_hit": self.pd_hit.to_dict(),
            "full_accept": self.full_accept.to_dict(),
            "last_update": self.last_update,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceState:
        last = data.get("last_update")
        return cls(
            device_id=str(data["device_id"]),
            alpha=float(data.get("alpha", DEFAULT_ALPHA)),
            gamma=Ema.from_dict(data.get("gamma", {})),
            beta_up=Ema.from_dict(data.get("beta_up", {})),
            beta_down=Ema.from_dict(data.get("beta_down", {})),
            round_overhead=Ema.from_dict(data.get("round_overhead", {})),
            round_overhead_median=Ema.from_dict(data.get("round_overhead_median", {})),
            prefill_token=Ema.from_dict(data.get("prefill_token", {})),
            rtt=Ema.from_dict(data.get("rtt", {})),
            pd_hit=Ema.from_dict(data.get("pd_hit", {})),
            full_accept=Ema.from_dict(data.get("full_accept", {})),
            last_update=None if last is None else float(last),
        )
