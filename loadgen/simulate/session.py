"""One request's life on a device, as a chain of events (shared/specdec/decode_loop.py's run_session).

Split modes (ushape, usarathi, hat*):

    open     one round trip (OpenSession / SessionOpened), as engine.run_session does first
    prefill  device input layers over each chunk (FIFO device compute), upload S·A bytes,
             cloud work item(s), the last one answers with the prompt's deep state (A bytes)
             -> first token. With PC the device computes and uploads chunk j+1 while the
             cloud works on chunk j; the cloud runs a session's chunks in order.
    decode   draft (k+1 steps of gamma; one step without SD), upload (k+1)·A, one cloud
             item of k+1 tokens, download (k+1)·A -> L tokens. With PD the device spends
             the verification window pre-drafting c branches and stops when the answer
             arrives (as the engine does), so a branch gets min(lambda, window/(c·gamma) − 1)
             steps; with `pd_batched` the c branches cost one branch's time (HAT drafts them
             as a batch). When the last draft
             token was corrected (L == k) the correction is a pre-drafted candidate with
             probability `pd_hit_rate`: the next round's first lambda drafts are ready, and it
             drafts on from them to where the chain stops (as the device does).

Cloud mode: token ids up, the whole model runs in the cloud, which samples; the sampled id
comes down and the device sends it back up for the next step (one token per round trip,
as the real agent's token_decode does). `cloud-stream`: the cloud decodes on its own and
streams each id down as it is made. No device compute in either.

Tree rounds (hat-tree, or the budget's tree): one (rows, tokens) pair drawn from the measured tree
rounds, the measured tree/chain drafting ratio times the device's chain round, the rows up, verified and
down, and no pre-drafting around them (loadgen/simulate/trees.py).

Speculation draws: L ~ accept_dist; with probability `full_accept_rate` the round accepted
its whole draft, so k = L - 1 (the target adds one token); otherwise drafting ran to the
rejected token, k = min(L, K). Without a measured rate every draft runs to the rejected
token (drafting stops at the first low-confidence token, which is usually the one rejected).
k is capped so a round never makes more than the tokens left. Each request has its own random
streams, so every mode sees the same draws for the same request (paired comparison).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loadgen.metrics import RequestRecord
from loadgen.simulate.budget import choose_shape, tree_draft_s
from loadgen.simulate.calibration import Calibration, DeviceProfile
from loadgen.simulate.cloud import Cloud, ReplicatedCloud
from loadgen.simulate.events import EventLoop, FifoServer, Link
from loadgen.simulate.modes import SimMode
from shared.planning.planners import chunk_size_eq3, fixed_chunks, parallel_draft_steps_eq6
from shared.telemetry.latency_stats import mean_accept_length

_ACCEPT_STREAM, _PD_STREAM, _OVERHEAD_STREAM, _FULL_STREAM, _TREE_STREAM = 3, 4, 5, 6, 7  # loadgen: 1, 2
_BIG = 1e30  # stands in for an unlimited bandwidth in the planners' equations


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    device_hint: int = 0


@dataclass
class Device:
    """A simulated device: its profile, its compute (one FIFO) and its two link directions."""

    index: int
    profile: DeviceProfile
    compute: FifoServer
    uplink: Link
    downlink: Link
    outstanding: int = 0
    served: int = 0

    @classmethod
    def build(cls, loop: EventLoop, index: int, profile: DeviceProfile) -> Device:
        return cls(
            index,
            profile,
            FifoServer(loop),
            Link(loop, profile.beta_up, profile.latency_s),
            Link(loop, profile.beta_down, profile.latency_s),
        )


@dataclass
class Context:
    """What every request of one run shares."""

    loop: EventLoop
    cloud: Cloud | ReplicatedCloud
    cal: Calibration
    mode: SimMode
    stages: int
    seed: int
    on_done: Callable[[RequestProcess], None] = lambda _: None
    _session_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.cum_accept = list(itertools.accumulate(self.cal.accept_dist))
        self.cum_tree = list(itertools.accumulate(p for _, _, p in self.cal.tree_joint or []))


class RequestProcess:
    def __init__(self, ctx: Context, req: SimRequest, device: Device, slowdown: float = 1.0) -> None:
        self.ctx, self.req, self.dev = ctx, req, device
        self.sid = next(ctx._session_ids)
        self.cloud = ctx.cloud.for_session(self.sid)  # the verifier (replica) this session is pinned to
        speed = device.profile.slowdown * slowdown
        self.gamma = device.profile.gamma_s * speed
        self.token_s = device.profile.prefill_token_s * speed
        self.speed = speed
        self.A = ctx.cal.bytes_per_token
        self.o = ctx.cal.frame_overhead_bytes
        self.record = RequestRecord(
            index=req.index,
            arrival_s=req.arrival_s,
            max_tokens=req.max_tokens,
            prompt_tokens=req.prompt_tokens,
            device_hint=req.device_hint,
            send_s=req.arrival_s,
            device_id=device.profile.device_id,
        )
        self.generated = 0
        self.rounds: list[int] = []
        self.chunks: list[int] = []
        self.ready_draft: int | None = None  # PD: length of an adopted pre-drafted draft
        self.cloud_made = 0  # cloud mode: tokens produced in the cloud so far
        self.shape: str | None = None  # the draft budget's last choice
        self.shape_rounds: dict[str, int] = {}  # rounds per budget shape
        self.rng_accept = np.random.default_rng([ctx.seed, _ACCEPT_STREAM, req.index])
        self.rng_pd = np.random.default_rng([ctx.seed, _PD_STREAM, req.index])
        self.rng_overhead = np.random.default_rng([ctx.seed, _OVERHEAD_STREAM, req.index])
        self.rng_full = np.random.default_rng([ctx.seed, _FULL_STREAM, req.index])
        self.rng_tree = np.random.default_rng([ctx.seed, _TREE_STREAM, req.index])

    @property
    def post_s(self) -> float:
        """Device time after the cloud's answer: constant, or lognormal around the measured median."""
        cal = self.ctx.cal
        sigma = cal.round_overhead_sigma
        if sigma == 0.0:
            return cal.round_overhead_s * self.speed
        median = cal.round_overhead_median_s
        assert median is not None  # a lognormal spread is fitted only where the median was measured (calibration.py)
        return median * math.exp(sigma * self.rng_overhead.standard_normal()) * self.speed

    # -- helpers -------------------------------------------------------------------------
    def _work(self, seconds: float, then: Callable[..., None], *args: object) -> None:
        """Device compute; zero-cost work skips the FIFO so it cannot wait behind other jobs."""
        if seconds > 0:
            self.dev.compute.submit(seconds, then, *args)
        else:
            then(*args)

    def _deliver(self, n: int) -> None:
        n = min(n, self.req.max_tokens - self.generated)
        self.record.chunk_times_s.append(self.ctx.loop.now)
        self.record.chunk_tokens.append(n)
        self.generated += n

    def _finish(self) -> None:
        rec = self.record
        rec.end_s = self.ctx.loop.now
        rec.completion_tokens = self.generated
        rec.num_rounds = len(self.rounds)
        rec.accept_length = mean_accept_length(self.rounds)
        rec.finish_reason = "length"
        self.dev.outstanding -= 1
        self.ctx.cloud.close(self.sid)
        self.ctx.on_done(self)

    def chunk_plan(self) -> list[int]:
        """Upload chunks: eq. 3 (or the calibration's fixed chunk) with PC, else the whole prompt."""
        cal, S = self.ctx.cal, self.req.prompt_tokens
        if not self.ctx.mode.client_chunking:
            return [S]
        if cal.pc_chunk is not None:
            size = cal.pc_chunk
        elif self.cloud.mu_ema is None:  # the planner's default:no-telemetry
            size = cal.default_chunk
        else:
            beta = self.dev.profile.beta_up if math.isfinite(self.dev.profile.beta_up) else _BIG
            size = chunk_size_eq3(
                self.A, beta, self.ctx.cal.g, self.cloud.mu_ema, self.ctx.stages, cal.min_chunk, cal.max_chunk, S
            )
        return fixed_chunks(S, size)

    # -- prefill -------------------------------------------------------------------------
    def start(self) -> None:
        if self.ctx.cal.session_open_rtt:  # OpenSession -> SessionOpened before the prompt
            self.dev.uplink.send(self.o, self.dev.downlink.send, self.o, self._begin_prefill)
        else:
            self._begin_prefill()

    def _begin_prefill(self) -> None:
        if self.ctx.mode.token_upload:
            S = self.req.prompt_tokens
            self.dev.uplink.send(
                S * self.ctx.cal.token_bytes + self.o, self.cloud.submit, self.sid, S, self._cloud_token, True
            )
            return
        self.chunks = self.chunk_plan()
        self._prefill_chunk(0)

    def _prefill_chunk(self, j: int) -> None:
        self._work(self.chunks[j] * self.token_s, self._upload_chunk, j)

    def _upload_chunk(self, j: int) -> None:
        self.dev.uplink.send(self.chunks[j] * self.A + self.o, self._chunk_at_cloud, j)
        if j + 1 < len(self.chunks):  # PC: compute the next chunk while this one uploads
            self._prefill_chunk(j + 1)

    def _chunk_at_cloud(self, j: int) -> None:
        last = j == len(self.chunks) - 1
        pieces = fixed_chunks(self.chunks[j], self.ctx.mode.server_chunk)  # U-Sarathi: server-side chunks
        for i, size in enumerate(pieces):
            if i < len(pieces) - 1:
                self.cloud.submit(self.sid, size, lambda: None, prefill=True)
            else:
                self.cloud.submit(self.sid, size, self._prefill_answer if last else self._chunk_ack, prefill=True)

    def _chunk_ack(self) -> None:
        self.dev.downlink.send(self.o, lambda: None)

    def _prefill_answer(self) -> None:
        self.dev.downlink.send(self.A + self.o, self._work, self.post_s, self._first_token)

    def _first_token(self) -> None:
        self._deliver(1)
        self._next_round()

    # -- decode (split modes) ------------------------------------------------------------
    def _draw_accept(self) -> int:
        return bisect.bisect_left(self.ctx.cum_accept, self.rng_accept.random() * self.ctx.cum_accept[-1]) + 1

    def _draw_tree(self) -> tuple[int, int]:
        """(rows, tokens) of a tree round, drawn jointly from the measured tree rounds."""
        cum, joint = self.ctx.cum_tree, self.ctx.cal.tree_joint
        assert joint is not None  # tree rounds are simulated only from measured ones (trees.py)
        rows, tokens, _ = joint[bisect.bisect_left(cum, self.rng_tree.random() * cum[-1])]
        return int(rows), int(tokens)

    def _next_round(self) -> None:
        remaining = self.req.max_tokens - self.generated
        if remaining <= 0:
            self._finish()
            return
        mode, cal = self.ctx.mode, self.ctx.cal
        if mode.speculative and self.ready_draft is None and mode.draft_budget:
            self.shape = choose_shape(
                cal, self.dev.profile, self.gamma, self.cloud.last_sessions(), self.cloud.g_of, self.shape
            )
            self.shape_rounds[self.shape] = self.shape_rounds.get(self.shape, 0) + 1
        if (
            mode.speculative
            and self.ready_draft is None
            and (self.shape == cal.tree_shape if mode.draft_budget else mode.tree_rounds)
        ):
            rows, tokens = self._draw_tree()
            self._work(
                tree_draft_s(cal, self.gamma), self._send_draft, rows - 1, min(tokens, remaining), remaining, True
            )
            return
        if mode.speculative and not (mode.draft_budget and self.ready_draft is None and self.shape == "none"):
            natural = self._draw_accept()
            full = cal.full_accept_rate is not None and self.rng_full.random() < cal.full_accept_rate
            # all accepted: the draft was natural - 1 long (+1 bonus); else it ran to the rejected token
            k = min(natural - 1 if full else natural, cal.max_draft, remaining - 1)
            # an adopted pre-drafted branch is drafted on to where the chain stops (Drafting._finish_ready_draft):
            # only the steps past its pre-drafted ones are drafted after the answer
            predrafted, self.ready_draft = self.ready_draft, None
            L = min(natural, k + 1)
            draft_s = (k + 1) * self.gamma if predrafted is None else max(0, k - predrafted) * self.gamma
        else:
            k, L, draft_s = 0, 1, self.gamma * cal.nosd_step_factor
        self._work(draft_s, self._send_draft, k, L, remaining)

    def _pd_steps(self, k: int, remaining: int) -> int:
        cal, prof = self.ctx.cal, self.dev.profile
        if cal.pd_steps is not None:
            lam = cal.pd_steps
        else:
            up = prof.beta_up if math.isfinite(prof.beta_up) else _BIG
            down = prof.beta_down if math.isfinite(prof.beta_down) else _BIG
            mu = self.cloud.mu_ema or float(k + 1)
            lam = parallel_draft_steps_eq6(
                k + 1, self.A, up, down, self.cloud.g_of(mu), max(self.gamma, 1e-12), cal.max_draft
            )
        return max(0, min(lam, cal.max_draft, remaining - k - 1))

    def _send_draft(self, k: int, L: int, remaining: int, tree: bool = False) -> None:
        mode, cal = self.ctx.mode, self.ctx.cal
        pd = mode.parallel_drafting and k >= 1 and not tree  # the device pre-drafts after chains only
        lam = self._pd_steps(k, remaining) if pd else 0
        sent_at = self.ctx.loop.now

        def join() -> None:
            # The engine stops pre-drafting when the verification answer arrives, so PD only
            # uses the window: the branches got as many steps as fit in it (at most lambda).
            steps = None
            if pd:
                branches = 1 if cal.pd_batched else cal.pd_candidates
                window = self.ctx.loop.now - sent_at
                steps = max(0, min(lam, int(window / (branches * max(self.gamma, 1e-12))) - 1))
            self._work(self.post_s, self._end_round, k, L, steps)

        def verified() -> None:
            self.dev.downlink.send((k + 1) * self.A + self.o, join)

        self.dev.uplink.send((k + 1) * self.A + self.o, self.cloud.submit, self.sid, k + 1, verified)

    def _end_round(self, k: int, L: int, lam: int | None) -> None:
        self._deliver(L)
        self.rounds.append(L)
        left = self.req.max_tokens - self.generated
        if lam is not None and L == k and left > 0 and self.rng_pd.random() < self.ctx.cal.pd_hit_rate:
            self.ready_draft = lam
        self._next_round()

    # -- cloud mode ----------------------------------------------------------------------
    def _cloud_token(self) -> None:
        """A cloud step sampled one token: send it down; streaming, queue the next step at once."""
        self.cloud_made += 1  # the prefill step makes the first token, each decode step one more
        last = self.cloud_made >= self.req.max_tokens
        self.dev.downlink.send(self.ctx.cal.token_bytes + self.o, self._cloud_arrived, last)
        if not last and self.ctx.mode.cloud_stream:
            self.cloud.submit(self.sid, 1, self._cloud_token)

    def _cloud_arrived(self, last: bool) -> None:
        self._deliver(1)
        if self.cloud_made > 1:
            self.rounds.append(1)
        if last:
            self._finish()
        elif not self.ctx.mode.cloud_stream:  # send the token back up for the next step
            tb = self.ctx.cal.token_bytes + self.o
            self.dev.uplink.send(tb, self.cloud.submit, self.sid, 1, self._cloud_token)
