"""DiSCo's unified cost (paper 003, §4.1): server dollars and device energy on one scale.

Pure: no I/O, no clocks. A request's cost is the sum, over the endpoints that worked on it,
of prompt tokens x the endpoint's prefill price plus generated tokens x its decode price.

* Server prices (c_s^p, c_s^d) are dollars per token (a cloud's list price).
* Device costs (c_d^p, c_d^d) are joules per token, turned into dollars by the exchange rate
  lambda ($ per J). Grid electricity is the floor; a user who wants to spare a battery raises
  lambda, which moves the policy from server-constrained towards device-constrained.
* `hat` splits one model between the two: a HAT token's compute is a `hat_device_share` part on
  the device (its first m of n layers plus the draft) and the rest on the server, so its price
  per token is  server price * (1 - share) + device price * share  (prefill and decode alike).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

Endpoint = Literal["device", "cloud", "hat"]
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
SERVER_ENDPOINTS = ("cloud", "hat")


def _check_endpoint(endpoint: str) -> None:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {ENDPOINTS}")


def _check_tokens(tokens: int) -> None:
    if tokens < 0:
        raise ValueError(f"token count must be >= 0, got {tokens}")


@dataclass(frozen=True)
class CostModel:
    """Per-token prices of each endpoint (defaults documented field by field)."""

    # c_s^p, c_s^d: GPT-4o-mini's list price, $0.15 / $0.60 per 1M tokens (DiSCo Table 8).
    server_prompt: float = 0.15e-6
    server_decode: float = 0.60e-6
    # c_d^p, c_d^d in joules per token, a Jetson-Orin-class estimate for a ~1B draft model:
    # decoding ~40 tok/s at ~15 W is ~0.4 J/token; prefill is batched (~1000 tok/s at ~20 W),
    # ~0.02 J/token. Override per device class with `with_device_energy` / parse_device_energy.
    device_prompt_j: float = 0.02
    device_decode_j: float = 0.4
    # lambda, $ per J: grid electricity at $0.15/kWh = 0.15 / 3.6e6.
    exchange_rate: float = 4.17e-8
    # Fraction of a HAT token's compute done on the device (m/n layers + the draft).
    hat_device_share: float = 0.1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{f.name} must be a finite number >= 0, got {value!r}")
        if self.hat_device_share > 1:
            raise ValueError(f"CostModel.hat_device_share must be in [0, 1], got {self.hat_device_share}")

    def device_prompt(self) -> float:
        """Device $ per prompt token: lambda * c_d^p."""
        return self.exchange_rate * self.device_prompt_j

    def device_decode(self) -> float:
        """Device $ per generated token: lambda * c_d^d."""
        return self.exchange_rate * self.device_decode_j

    def constraint(self) -> Literal["device", "server"]:
        """Algorithm 1: device-constrained iff min(c_d^p, c_d^d) > max(c_s^p, c_s^d), all in $."""
        if min(self.device_prompt(), self.device_decode()) > max(self.server_prompt, self.server_decode):
            return "device"
        return "server"

    def prefill_split(self, endpoint: Endpoint) -> tuple[float, float]:
        """($ per prompt token paid in device energy, $ per prompt token paid to the server)."""
        return self._split(endpoint, self.device_prompt(), self.server_prompt)

    def decode_split(self, endpoint: Endpoint) -> tuple[float, float]:
        """($ per generated token paid in device energy, $ per generated token paid to the server)."""
        return self._split(endpoint, self.device_decode(), self.server_decode)

    def _split(self, endpoint: Endpoint, device_price: float, server_price: float) -> tuple[float, float]:
        _check_endpoint(endpoint)
        if endpoint == "device":
            return device_price, 0.0
        if endpoint == "cloud":
            return 0.0, server_price
        share = self.hat_device_share
        return device_price * share, server_price * (1.0 - share)

    def prefill_price(self, endpoint: Endpoint) -> float:
        """$ per prompt token; for hat, server price * (1 - share) + device price * share."""
        return sum(self.prefill_split(endpoint))

    def decode_price(self, endpoint: Endpoint) -> float:
        """$ per generated token; for hat, server price * (1 - share) + device price * share."""
        return sum(self.decode_split(endpoint))

    def prefill_cost(self, endpoint: Endpoint, tokens: int) -> float:
        """$ for `endpoint` to prefill `tokens` prompt tokens."""
        _check_tokens(tokens)
        return self.prefill_price(endpoint) * tokens

    def decode_cost(self, endpoint: Endpoint, tokens: int) -> float:
        """$ for `endpoint` to generate `tokens` tokens."""
        _check_tokens(tokens)
        return self.decode_price(endpoint) * tokens

    def with_device_energy(self, prompt_j: float, decode_j: float) -> CostModel:
        """The same prices with another device class's joules per token (validated)."""
        return dataclasses.replace(self, device_prompt_j=prompt_j, device_decode_j=decode_j)


def parse_device_energy(spec: str) -> dict[str, tuple[float, float]]:
    """Parse "orin:0.02,0.4;xavier:0.05,0.9" into {class: (prompt J/token, decode J/token)}.

    Blank input (or blank entries, e.g. a trailing ';') gives nothing; anything else malformed
    raises ValueError naming the entry.
    """
    classes: dict[str, tuple[float, float]] = {}
    for entry in spec.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, numbers = entry.partition(":")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"device energy entry {entry!r}: expected 'class:prompt_J,decode_J'")
        parts = [p.strip() for p in numbers.split(",")]
        if len(parts) != 2:
            raise ValueError(f"device energy entry {entry!r}: expected two numbers, prompt_J,decode_J")
        try:
            prompt_j, decode_j = float(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"device energy entry {entry!r}: {numbers!r} are not numbers") from None
        if not all(math.isfinite(v) and v >= 0 for v in (prompt_j, decode_j)):
            raise ValueError(f"device energy entry {entry!r}: joules must be finite and >= 0")
        if name in classes:
            raise ValueError(f"device energy: class {name!r} given twice")
        classes[name] = (prompt_j, decode_j)
    return classes


@dataclass
class CostLedger:
    """One request's cost, accumulated as endpoints prefill and decode (the loser of a race too)."""

    cost: CostModel
    device: float = 0.0  # $ of device energy
    server: float = 0.0  # $ paid to the server
    tokens: dict[str, dict[str, int]] = field(
        default_factory=lambda: {e: {"prefill": 0, "decode": 0} for e in ENDPOINTS}
    )

    def prefill(self, endpoint: Endpoint, tokens: int) -> None:
        """`endpoint` prefilled `tokens` prompt tokens (a migration's re-prefill counts too)."""
        _check_tokens(tokens)
        self._add(self.cost.prefill_split(endpoint), tokens)
        self.tokens[endpoint]["prefill"] += tokens

    def decode(self, endpoint: Endpoint, tokens: int) -> None:
        """`endpoint` generated `tokens` tokens."""
        _check_tokens(tokens)
        self._add(self.cost.decode_split(endpoint), tokens)
        self.tokens[endpoint]["decode"] += tokens

    def _add(self, split: tuple[float, float], tokens: int) -> None:
        self.device += split[0] * tokens
        self.server += split[1] * tokens

    @property
    def total(self) -> float:
        return self.device + self.server

    def as_dict(self) -> dict:
        """{"total", "device", "server" ($), "tokens": {endpoint: {"prefill": n, "decode": n}}}."""
        return {
            "total": self.total,
            "device": self.device,
            "server": self.server,
            "tokens": {e: dict(counts) for e, counts in self.tokens.items()},
        }
