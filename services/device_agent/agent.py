"""The device agent's state: its model, its verifier connection(s) (built in wiring.py), telemetry, the
planner's plans, kept sessions, an edge draft server, the background loops (readiness, link probes), and the
NDJSON events of one request (the mode's loop: rounds.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from contextlib import aclosing

from services.device_agent.admission import Admission
from services.device_agent.announce import own_url
from services.device_agent.cloud_client import CloudError, CloudUnavailable
from services.device_agent.detokenizer import IncrementalDetokenizer
from services.device_agent.edge_server import edge_draft_server
from services.device_agent.generate_request import GenerateRequest
from services.device_agent.kept import KeepableSession, KeptSessions
from services.device_agent.link_probes import LinkProbes
from services.device_agent.plans import DEFAULT_PARALLEL_STEPS, Plan, wire_bytes_per_token
from services.device_agent.rounds import ROUNDS, RoundsStart
from services.device_agent.settings import Settings
from services.device_agent.wiring import budget_tracker, hidden_clouds, plan_cache, planner_http, verifier_connection
from shared.auth import client as auth_client
from shared.auth.tls import client_context
from shared.auth.verify import ISSUER
from shared.jupiter.plan import load_plan
from shared.model.checkpoint import load_checkpoint
from shared.model.placement import detect_placement
from shared.modes import MODE_TABLE, ModeSpec
from shared.net.heartbeat import with_heartbeats
from shared.planning.device_speed import speed_schedule
from shared.planning.draft_budget import DraftShape
from shared.runtime import build_device_model
from shared.specdec.device_session import DeviceSession, SessionError, warm_up_device
from shared.specdec.draft_config import DraftConfig
from shared.specdec.replay import FailoverExhausted
from shared.specdec.sampling import SamplingParams
from shared.specdec.session_loop import drive
from shared.specdec.trial_round import TrialRound
from shared.telemetry import latency_stats
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import DeviceMetrics
from shared.wire import schema as wire

log = logging.getLogger("services.device_agent")

# Readiness follows the verifier connection: a drop is seen at once (the reader ends), a reconnect
# and split check is tried this often, each bounded; a verifier that refused the split is a
# configuration error, re-checked rarely so the refusal is not logged every second.
READINESS_INTERVAL_S = 1.0
READINESS_TIMEOUT_S = 5.0
REFUSED_RECHECK_S = 10.0
ASYNC_RETRY_EVERY = 10  # hat-async measured slower than HAT's chains: it still serves one request in this many


class DeviceAgent:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.placement = detect_placement(settings.device, settings.dtype, what=f"device agent {settings.device_id}")
        self.checkpoint = load_checkpoint(
            settings.model_dir, dtype=self.placement.dtype, quantize=self.placement.quantize
        )
        self.model = build_device_model(
            self.checkpoint, settings.split_layers, settings.adapter or None, speculative=settings.speculative
        ).to(self.placement.device)
        tls = client_context(settings.tls_ca)  # trusts the mesh's CA for https:// planner and monitor
        # This device's credentials (shared/auth/client.py): it enrolls with its bootstrap token at the issuer
        # (its id and URL) and gets a token per service it calls (verifier, monitor, planner); callers of its own
        # /generate and /info are checked against the issuer's public keys (app.py). None: the mesh runs open.
        enrollment = (
            auth_client.Enrollment(settings.device_id, own_url(settings), settings.max_sessions)
            if settings.authenticated
            else None
        )
        self.broker = auth_client.broker_for(settings, enrollment, tls)
        monitor_auth = auth_client.BrokerAuth(self.broker, ISSUER) if self.broker is not None else None
        self.telemetry = TelemetryClient(settings.state_monitor_url or None, verify=tls, auth=monitor_auth)
        self.metrics = DeviceMetrics(settings.device_id, settings.max_draft)
        self.telemetry.count_into(self.metrics.registry)  # its drops show on /metrics
        self.probes = LinkProbes(
            settings.device_id,
            self.telemetry,
            lambda: self.active > 0,
            settings.bandwidth_probe_interval_s,
            settings.rtt_probe_interval_s,
        )
        self.cloud = verifier_connection(settings, self.checkpoint, self.probes, self.metrics, self.broker)
        self.probes.cloud = self.cloud
        self.sessions_cloud, self.async_cloud = hidden_clouds(
            self.cloud, settings, self.checkpoint.hidden_size, self._on_replay
        )
        self.speed = speed_schedule(settings.speed)
        self.requests_served = 0
        self.replays = 0  # sessions moved to another verifier (or the same one, restarted)
        self.active = 0
        self.http = planner_http(settings, self.broker, tls)
        # The planner's answers, cached per device and refreshed off the request path (plans.py).
        self.bytes_per_token = wire_bytes_per_token(self.checkpoint.hidden_size, wire.WireDtype(settings.wire_dtype))
        self.budget = budget_tracker(settings, self.checkpoint)  # each draft shape's measurements (budget_tracker.py)
        self.async_fallbacks = 0  # hat-async requests HAT's chain rounds served, since hat-async measured slower
        self.plans = plan_cache(self.http, settings, self.bytes_per_token, self.model.context_length, self.budget)
        # An edge pipeline's first stage cuts prompts by the plan's sub-sequence table (Jupiter §IV-B2).
        self.edge_plan = (
            load_plan(settings.edge_plan, self.checkpoint.num_layers, self.checkpoint.hidden_size)
            if settings.edge_plan
            else None
        )
        self.kept = KeptSessions(settings.kept_ttl_s, settings.max_kept, self.sessions_cloud.close)
        self.edge = (
            edge_draft_server(settings, self.checkpoint, self.cloud, self.http) if settings.edge_draft_server else None
        )
        warm_up_device(self.model)

    async def readiness_loop(self) -> None:
        """Keep `cloud.ready` current: reconnect and re-check the split identity while it is not."""
        was_ready = False
        while True:
            ready = await self.cloud.check_ready(READINESS_TIMEOUT_S)
            if ready != was_ready:
                log.log(
                    logging.INFO if ready else logging.WARNING,
                    "device %s %s",
                    self.settings.device_id,
                    "is ready: the verifier accepted its split"
                    if ready
                    else f"is not ready: {self.cloud.not_ready_reason}",
                )
                was_ready = ready
            await asyncio.sleep(REFUSED_RECHECK_S if self.cloud.split_refused else READINESS_INTERVAL_S)

    def _on_replay(self, session_id: int, rows: int, seconds: float) -> None:
        self.replays += 1
        log.warning(
            "session %d continues on verifier %s: %d rows replayed, %.2f s after the loss",
            session_id,
            self.cloud.url,
            rows,
            seconds,
        )

    async def plan(self) -> Plan:
        """Chunk size and PD steps for a request starting now: the planner's cached plan, or the defaults."""
        if self.plans is None:
            return Plan.defaults(self.settings.default_chunk_size, DEFAULT_PARALLEL_STEPS)
        return await self.plans.current()

    def draft_config(
        self, rounds: str, max_draft: int, asked: str | None = None, params: SamplingParams | None = None
    ) -> tuple[DraftConfig, str | None, TrialRound | None]:
        """A request's draft policy, the budget shape it is measured for (None: not measured) and a trial round
        for its session (None: none). In hat rounds a shape the request names wins (not measured: a bench's
        fixed row must not steer the budget); else, with budgeting on, the cached plan's shape, with one round
        of a shape never tried (its prior alone would rarely win, and never be measured); else the configured
        one, which a seeded sampled request always runs (its draws' tokens depend on the drafts: the same seed
        must give the same answer whatever the load). Never waits for the planner."""
        s = self.settings
        seeded = params is not None and params.seed is not None and not params.is_greedy
        if rounds != "hat" or max_draft == 0 or (asked is None and (self.budget is None or seeded)):
            return DraftConfig(s.eta, max_draft, s.tree_nodes, s.tree_width, s.tree_min_prob), None, None
        if asked is not None:
            return self._shape_config(DraftShape.parse(asked, max_draft)), None, None
        assert self.budget is not None and self.plans is not None  # budgeting needs a planner
        plan = self.plans.peek()
        cached, predicted = (plan.shape, plan.predicted) if plan is not None else (None, None)
        shape = self.budget.shapes[cached or s.default_shape()]
        tried = self.budget.next_trial(predicted, running=shape.name)
        trial = TrialRound(tried, self._shape_config(self.budget.shapes[tried])) if tried is not None else None
        return self._shape_config(shape), shape.name, trial

    def _shape_config(self, shape: DraftShape) -> DraftConfig:
        s = self.settings
        return DraftConfig(s.eta, shape.max_draft, shape.tree_nodes, s.tree_width, s.tree_min_prob)

    def current_shape(self) -> tuple[str, str]:
        """The draft shape this agent's hat requests run now, and who chose it: the draft budget ("budget", the
        cached plan's) or the configuration ("configured"); /info reports it for the web console."""
        plan = self.plans.plan if self.budget is not None and self.plans is not None else None
        if plan is not None and plan.shape:
            return plan.shape, "budget"
        return self.settings.default_shape(), "configured"

    def admit(self, session: DeviceSession | None) -> Admission:
        """Count a request against `max_sessions` (released by its stream or its response, admission.py)."""
        self.active += 1
        return Admission(self._free_slot, session)

    def _free_slot(self) -> None:
        self.active -= 1

    async def stream(
        self,
        request: GenerateRequest,
        ids: list[int],
        session: DeviceSession | None,
        request_id: str,
        admission: Admission,
        shape: str | None = None,
    ):
        """NDJSON events of one request; `session` is None where the mode builds none (cloud); `shape` the
        draft budget's shape it runs (its rounds are measured for the next choices). However it ends, even
        at its first event, `admission` is released and the session freed (by its rounds, once they have it)."""
        spec = MODE_TABLE[request.option("mode", self.settings)]
        started = time.perf_counter()
        timeline = latency_stats.Timeline()  # seconds since `started`, one delivery per round
        detok = IncrementalDetokenizer(self.checkpoint.tokenizer, request.prefix_ids, request.prefix_text)
        session_id = random.getrandbits(63)
        delivered: list[int] = []  # the tokens, where no session counts them
        # Counted in both modes, so the speed schedule (HAT's mode switches) sees the same requests.
        request_slowdown = self.speed.slowdown_for(self.requests_served)
        self.requests_served += 1
        counted = 0  # of session.verdicts, those in the metrics
        try:
            yield json.dumps({"type": "start", "request_id": request_id, "prompt_tokens": len(ids)}) + "\n"
            start = RoundsStart(self, request, ids, session, session_id, request_slowdown)
            rounds = drive(await ROUNDS[spec.rounds](start))
            admission.hand_over_session()  # started at once below: its engine frees the session however it ends
            # closed here, not whenever the collector finds it (a client gone mid-stream); closing the heartbeats
            # closes the rounds (in the task that runs them)
            async with aclosing(with_heartbeats(rounds, self.settings.heartbeat_s)) as beats:
                async for tokens in beats:
                    if tokens is None:  # still waiting (e.g. in the verifier's queue): alive, not dead
                        yield json.dumps({"type": "heartbeat", "t": time.perf_counter() - started}) + "\n"
                        continue
                    if session is not None:  # spec-decode counters, live: this delivery is one round's (or prefill's)
                        counted = self._count_rounds(session, counted)
                    else:
                        delivered += tokens
                    now = time.perf_counter() - started
                    timeline.deliver(now, len(tokens))
                    text = detok.push(tokens)
                    yield json.dumps({"type": "tokens", "token_ids": tokens, "text": text, "t": now}) + "\n"
        except (CloudUnavailable, CloudError, SessionError, FailoverExhausted) as exc:
            log.warning("request %s failed: %s", request_id, exc)
            yield json.dumps({"type": "error", "code": type(exc).__name__, "message": str(exc)}) + "\n"
            return
        finally:
            admission.release()
            if session is not None:  # rounds verified but not delivered (the client went away) count too
                self._count_rounds(session, counted)
        done = self._done_event(request, spec, ids, session, delivered, timeline)
        yield json.dumps(done) + "\n"
        if session is not None:
            self._report_timings(session, request_slowdown)
            # a shape's speed is its typical round's: a stall behind another session's prompt is not the shape's
            speed = latency_stats.typical_tokens_per_s(timeline)
            if shape is not None and self.budget is not None:
                self._observe_budget(shape, session, request_slowdown, speed)
            elif spec.name == "hat-async" and self.budget is not None and not session.degraded:
                self._observe_async(speed)

    def _done_event(
        self,
        request: GenerateRequest,
        spec: ModeSpec,
        ids: list[int],
        session: DeviceSession | None,
        delivered: list[int],
        timeline: latency_stats.Timeline,
    ) -> dict:
        """The request's last event: why it finished and its stats."""
        if session is not None:
            generated, accept_lengths = session.generated, session.accept_lengths
        else:  # like the reference decoder: every round after the first yields exactly one token
            generated, accept_lengths = delivered, [1] * max(0, len(delivered) - 1)
        # shared/telemetry/latency_stats.py's definitions; 0.0 where undefined (no token, one token, no round)
        ttft, tbt = latency_stats.ttft_s(timeline) or 0.0, latency_stats.mean_tbt_s(timeline) or 0.0
        stats = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(generated),
            "ttft_s": ttft,
            "tbt_s": tbt,
            "mean_accept_length": latency_stats.mean_accept_length(accept_lengths) or 0.0,
            "num_rounds": len(accept_lengths),
            "mode": spec.name,
            "privacy": spec.private,  # False: token ids went to the cloud
            # finished by the draft model alone after losing the cloud: not the target model's text
            "degraded": bool(session is not None and session.degraded),
            # of prompt_tokens, those a fork started with in its caches (computed by the kept request)
            "cached_tokens": session.cached_tokens if isinstance(session, KeepableSession) else 0,
        }
        eos = self.model.eos_token_id
        finish = "stop" if generated and generated[-1] == eos and not request.ignore_eos else "length"
        done = {"type": "done", "finish_reason": finish, "stats": stats}
        if isinstance(session, KeepableSession) and session.kept is not None:
            done["kept"] = {"handle": session.kept.handle, "length": session.kept.length}
        return done

    def _count_rounds(self, session: DeviceSession, counted: int) -> int:
        """Count the session's verification rounds from index `counted` on; returns how many are counted now."""
        verdicts = session.verdicts[counted:]
        self.metrics.spec_decode.rounds(verdicts)
        return counted + len(verdicts)

    def _report_timings(self, session: DeviceSession, slowdown: float) -> None:
        """What only the device knows: its draft step (gamma) and, for the simulator's latency models,
        its prompt cost per token, its per-round time outside drafting and the cloud wait (mean and
        median: wall clock, divided by the emulated slowdown to be in gamma's unslowed units), how
        often a pre-drafted branch was the correction and how often a whole draft was accepted.
        Per-request telemetry (TTFT, token times, accept lengths) is the token-streamer's."""
        total_s, steps = sum(s for s, _ in session.draft_seconds), sum(n for _, n in session.draft_seconds)
        if not steps:
            return
        overheads = session.round_overhead_s
        prefill_s, prefill_tokens = (
            sum(s for s, _ in session.prefill_seconds),
            sum(n for _, n in session.prefill_seconds),
        )
        self.telemetry.emit_device_draft(
            self.settings.device_id,
            total_s / steps,
            steps,
            round_overhead_s=sum(overheads) / len(overheads) / slowdown if overheads else None,
            round_overhead_median_s=statistics.median(overheads) / slowdown if overheads else None,
            rounds=len(overheads),
            prefill_token_s=prefill_s / prefill_tokens / slowdown if prefill_tokens else None,
            prefill_tokens=prefill_tokens,
            pd_hit_rate=session.reused_branches / session.predraft_chances if session.predraft_chances else None,
            pd_chances=session.predraft_chances,
            # U-shape rounds (no draft) accept "everything" trivially; only speculative sessions say anything.
            full_accept_rate=(
                session.full_accepts / len(session.accept_lengths)
                if session.accept_lengths and session.draft_config.max_draft > 0
                else None
            ),
        )

    def _observe_budget(self, shape: str, session: DeviceSession, slowdown: float, tokens_per_s: float | None) -> None:
        """What a request in budget shape `shape` measured: its rounds (accept, rows, drafting) and, when it ran
        that shape alone, its decoding speed against the round model's (the shape's slowdown k)."""
        rounds, rows = list(session.accept_lengths), list(session.round_rows)
        if not rounds or not rows or session.degraded:  # a degraded end says nothing of the cloud
            return
        # the wall time rounds wait on drafting: parallel drafting runs while the verification is in flight
        draft_s = (sum(s for s, _ in session.draft_seconds) - session.predraft_seconds) * slowdown
        assert self.budget is not None
        trial = session.trial
        measured = trial.measured(rounds, rows) if trial is not None else None
        if trial is not None and measured is not None and trial.index is not None:
            accept, trial_rows, trial_draft_s = measured
            self.budget.observe(trial.name, [accept], trial_rows, trial_draft_s * slowdown)
            del rounds[trial.index], rows[trial.index]
            draft_s -= trial_draft_s * slowdown
        if rounds and rows:
            self.budget.observe(shape, rounds, sum(rows) / len(rows), max(0.0, draft_s) / len(rounds))
        plan = self.plans.peek() if self.plans is not None else None
        if trial is None and tokens_per_s and plan is not None and shape in plan.modelled:
            # the plan now in the cache: its model saw about the load this request ran under
            self.budget.observe_speed(shape, plan.modelled[shape], tokens_per_s)

    def _observe_async(self, tokens_per_s: float | None) -> None:
        """A hat-async request ran its own pipeline while the budget had chains: its speed against the chain's
        round model (hat-async's k, compared with the chain's by `serves_async`)."""
        plan = self.plans.peek() if self.plans is not None else None
        if self.budget is None or not tokens_per_s or plan is None or plan.shape != "chain":
            return
        if "chain" in plan.modelled:
            self.budget.observe_async_speed(plan.modelled["chain"], tokens_per_s)

    def serves_async(self) -> bool:
        """Whether a hat-async request runs its own pipeline (else HAT's rounds in the budget's shape): only on
        chains, once HAT's chain rounds have been measured (they are what it is measured against: until then HAT's
        rounds serve it and measure them), and unless it measured slower than they did; then one request in
        ASYNC_RETRY_EVERY still runs it, so its measurement follows the load."""
        shape, chosen_by = self.current_shape()
        if chosen_by != "budget" or self.budget is None:
            return True
        if shape == "chain" and self.budget.measured_slowdown("chain") is not None:
            if self.budget.async_pays() is not False:
                return True
            self.async_fallbacks += 1
            if self.async_fallbacks % ASYNC_RETRY_EVERY == 0:
                return True
        log.info(
            "hat-async request served by HAT's rounds: budget shape %s, k hat-async %s, k chain %s",
            shape,
            self.budget.async_slowdown.value,
            self.budget.measured_slowdown("chain"),
        )
        return False

    async def aclose(self) -> None:
        if self.edge is not None:
            await self.edge.aclose()
        await self.kept.aclose()  # closes their verifier sessions while the connection is still up
        await self.cloud.close_connection()
        if self.plans is not None:
            await self.plans.aclose()
        await self.http.aclose()
        await self.telemetry.aclose()
        if self.broker is not None:
            await self.broker.aclose()
