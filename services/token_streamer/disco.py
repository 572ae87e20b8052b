"""DiSCo's controller in the token streamer: what the dispatch policy is built from, and the decision.

The policy (shared/disco/dispatch.py, the paper's Algorithms 1-3) is built from two distributions:
recent prompt lengths and the server endpoint's TTFTs. The state monitor keeps them for the whole
mesh in Redis (`GET /disco/history`, re-read every `disco_refresh_s` by an owned task); without a
monitor, or while it cannot answer, this streamer's own recent requests stand in. Policies are
precomputed per budget and rebuilt only when the history changed, so a decision is a lookup.

The decision needs the prompt's length in tokens before any endpoint has tokenized it: it is
estimated from its characters with the ratio the device agents' start lines taught us (the
answers carry the true count, which is what the history records).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
from collections import deque
from typing import Any

import httpx

from shared.disco.cost import CostModel
from shared.disco.dispatch import Decision, DispatchPolicy, random_decision

log = logging.getLogger(__name__)

DEFAULT_CHARS_PER_TOKEN = 4.0  # until a start line taught the real ratio
FALLBACK_TTFT_S = 1.0  # a migration's time before any TTFT of its target was seen
FIXED = {  # the baselines: one endpoint, never a second one
    "device": Decision(server=False, device_delay_s=0.0, reason="device-only"),
    "cloud": Decision(server=True, device_delay_s=None, reason="server-only"),
    "hat": Decision(server=True, device_delay_s=None, reason="server-only"),
}


class History:
    """Recent observations the policy and the migration controller read."""

    def __init__(self, size: int) -> None:
        self.prompt_tokens: deque[int] = deque(maxlen=size)
        self.server_ttft_s: deque[float] = deque(maxlen=size)
        # (tokens read, seconds to first token) of recent legs, device and server: migrations' t_m
        self.device_ttft: deque[tuple[int, float]] = deque(maxlen=256)
        self.leg_ttft: deque[tuple[int, float]] = deque(maxlen=256)
        self.output_tokens: deque[int] = deque(maxlen=256)
        self.chars_per_token = DEFAULT_CHARS_PER_TOKEN
        self.from_monitor = False
        self.version = 0  # bumped on every change: cached policies are rebuilt

    def learn_prompt(self, chars: int, tokens: int | None) -> None:
        if tokens and chars > 0:
            self.chars_per_token += 0.1 * (chars / tokens - self.chars_per_token)

    def estimate_tokens(self, chars: int) -> int:
        return max(1, round(chars / self.chars_per_token))

    def request_done(self, prompt_tokens: int | None, server_ttft_s: float | None, output_tokens: int) -> None:
        if not self.from_monitor:  # the monitor's copy already holds what this streamer reported to it
            if prompt_tokens:
                self.prompt_tokens.append(prompt_tokens)
            if server_ttft_s is not None:
                self.server_ttft_s.append(server_ttft_s)
            self.version += 1
        self.output_tokens.append(output_tokens)

    def replace(self, prompt_tokens: list[int], server_ttft_s: list[float]) -> None:
        """The mesh's history from the state monitor (newest first, as it serves them)."""
        if list(self.prompt_tokens) != prompt_tokens[::-1] or list(self.server_ttft_s) != server_ttft_s[::-1]:
            self.prompt_tokens = deque(reversed(prompt_tokens), maxlen=self.prompt_tokens.maxlen)
            self.server_ttft_s = deque(reversed(server_ttft_s), maxlen=self.server_ttft_s.maxlen)
            self.version += 1
        self.from_monitor = True

    @property
    def mean_output_tokens(self) -> float | None:
        return statistics.fmean(self.output_tokens) if self.output_tokens else None

    def leg_started(self, on_device: bool, tokens_read: int, ttft_s: float) -> None:
        """An endpoint's first token came `ttft_s` after it was asked, having read `tokens_read` tokens."""
        (self.device_ttft if on_device else self.leg_ttft).append((tokens_read, ttft_s))

    def ttft_estimate_s(self, on_device: bool, tokens: int, quantile: float) -> float:
        """t_m of a migration: the `quantile` of an endpoint's time to first token after reading `tokens`.
        Device TTFT is linear in what it reads (DiSCo §3); the server's mostly is not, but a cloud that
        prefills on a busy CPU is, so both are fitted as k*l + c by least squares over recent starts,
        plus the quantile of the residuals."""
        samples = list(self.device_ttft if on_device else self.leg_ttft)
        if not samples:
            return FALLBACK_TTFT_S
        n = len(samples)
        mean_l = sum(length for length, _ in samples) / n
        mean_t = sum(t for _, t in samples) / n
        var = sum((length - mean_l) ** 2 for length, _ in samples)
        k = sum((length - mean_l) * (t - mean_t) for length, t in samples) / var if var > 0 else 0.0
        residuals = sorted(t - (mean_t + k * (length - mean_l)) for length, t in samples)
        spread = residuals[min(n - 1, int(quantile * n))]
        return max(0.0, mean_t + k * (tokens - mean_l) + spread)


class DiscoController:
    def __init__(self, settings: Any, client: httpx.AsyncClient, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.client = client
        self.history = History(settings.disco_history)
        self.rng = rng or random.Random(None if settings.disco_seed < 0 else settings.disco_seed)
        self.base_cost: CostModel = settings.cost_model()
        self._policies: dict[float, tuple[int, DispatchPolicy]] = {}  # budget -> (history version, policy)

    def policy(self, budget: float) -> DispatchPolicy:
        cached = self._policies.get(budget)
        if cached is None or cached[0] != self.history.version:
            policy = DispatchPolicy.build(
                self.base_cost,
                list(self.history.prompt_tokens),
                list(self.history.server_ttft_s),
                budget,
                self.settings.disco_tail_ratio,
            )
            cached = (self.history.version, policy)
            self._policies[budget] = cached
        return cached[1]

    def decide(self, dispatch: str, budget: float, prompt_tokens: int) -> Decision:
        """Where a request of about `prompt_tokens` starts (Algorithm 1: the cost regime picks 2 or 3)."""
        if dispatch in FIXED:
            return FIXED[dispatch]
        if dispatch == "random":
            return random_decision(self.base_cost.constraint(), budget, self.rng)
        if dispatch != "disco":
            raise ValueError(f"unknown dispatch {dispatch!r}")
        return self.policy(budget).decide(prompt_tokens)

    async def refresh(self) -> bool:
        """Re-read the mesh's history from the state monitor; False (history kept) when it cannot answer."""
        url = self.settings.state_monitor_url
        if not url:
            return False
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                response = await self.client.get(
                    f"{url.rstrip('/')}/disco/history", params={"limit": self.settings.disco_history}
                )
            response.raise_for_status()
            body = response.json()
            lengths = [int(x) for x in body["prompt_tokens"] if int(x) > 0]
            ttfts = [float(x) for x in body["server_ttft_s"] if math.isfinite(float(x)) and float(x) >= 0]
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.debug("DiSCo history from %s unavailable: %s", url, exc)
            self.history.from_monitor = False
            return False
        self.history.replace(lengths, ttfts)
        return True

    async def refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a supervision loop must survive bugs in one refresh
                log.exception("DiSCo history refresh failed")
            await asyncio.sleep(self.settings.disco_refresh_s)
