"""One request under a DiSCo dispatch: endpoints raced or delayed, token-level migration, paced delivery.

A *leg* (disco_legs.py) is one endpoint's generation for the request, a /generate stream on the request's device
agent in mode `device` (the draft model alone), `cloud` (token mode) or `hat`. The decision (disco.py) starts a
server leg, a device leg, or both (the device's possibly after a wait w(l)); the first leg to produce a token wins
and every other leg is closed at once, which stops its generation and frees its sessions (device and cloud KV).

Delivery is paced at the user's reading rate r_c: the first token goes out at once (TTFT), each later one 1/r_c
after the previous (a leg generating faster fills a buffer). When the winner is the costlier decoder and eq. 4 says
the hand-over pays, and the buffer holds B = r_c * t_m tokens (eq. 5, t_m the target's expected time to its first
token), decoding migrates: the source is closed and the target is started with the prompt and every token generated
so far (`prefix_ids`: token ids, no KV), so its first token continues the answer while the buffer keeps delivery
going. A server leg that fails mid-answer (the cloud vanished) migrates the same way, to the device. The user sees
one stream: no token lost (the prefix is everything generated) and none repeated (the target delivers only what
follows it).

`DiscoStream` looks like a `DeviceStream` to the streamer's `Run` (events, device, prompt_tokens, queue_wait_s,
aclose) and adds `summary()` for the response's `tophat` object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from services.token_streamer.device_stream import DeviceStream
from services.token_streamer.disco import DiscoController
from services.token_streamer.disco_legs import Leg, Legs
from services.token_streamer.dispatcher import Dispatcher
from services.token_streamer.router import DeviceError, DeviceState
from shared.disco.cost import CostLedger, Endpoint
from shared.disco.dispatch import Decision
from shared.disco.migration import buffer_tokens, expected_remaining, migration_saving, migration_target

log = logging.getLogger(__name__)

MAX_HANDOVER_ATTEMPTS = 3  # a hand-over called off is tried again with a bigger buffer, this many times in all


class DiscoStream:
    def __init__(
        self,
        controller: DiscoController,
        dispatcher: Dispatcher,
        body: dict[str, Any],
        *,
        dispatch: str,
        budget: float,
        reading_rate_tps: float,
        migration: bool,
        prompt_chars: int,
    ) -> None:
        s = controller.settings
        self.controller, self.dispatcher, self.body = controller, dispatcher, body
        self.dispatch, self.budget, self.reading_rate = dispatch, budget, reading_rate_tps
        self.prompt_chars = prompt_chars
        # Settings accept only cloud or hat for disco_server_endpoint.
        configured: Endpoint = "hat" if s.disco_server_endpoint == "hat" else "cloud"
        self.server_endpoint: Endpoint = "hat" if dispatch == "hat" else "cloud" if dispatch == "cloud" else configured
        self.may_migrate = dispatch == "disco" and migration
        self.idle_timeout_s = s.line_timeout_s + s.first_byte_timeout_s
        self.max_new = int(body["max_new_tokens"])
        self.ledger = CostLedger(controller.base_cost)
        self.inbox: asyncio.Queue[tuple[Leg | None, str, Any]] = asyncio.Queue()
        self.legs = Legs(dispatcher, self.inbox, self._leg_body, self._opened)
        self.active: Leg | None = None  # the leg whose tokens make the answer
        self.pending: Leg | None = None  # the receiver of a hand-over in progress (the source goes on meanwhile)
        self.reserve: list[tuple[list[int], str]] = []  # what the source made meanwhile, shown only if it is called off
        self.delivered = 0  # tokens delivered so far
        self._slowest_handover_s = 0.0  # a called-off hand-over's wait: the next attempt buffers for longer
        self.first_endpoint: str | None = None
        self.generated: list[int] = []
        self.text = ""  # what the generated tokens show the user (a migration target continues it)
        self.buffer: deque[tuple[list[int], str, Leg]] = deque()
        self.deliveries: list[float] = []
        self.next_due = 0.0
        self.finished: dict[str, Any] | None = None  # the active leg's done event
        self.failure: DeviceError | None = None  # raised once the buffer is delivered
        self.migrations: list[dict[str, Any]] = []
        self.server_ttft_s: float | None = None
        self.decision: Decision | None = None
        self.device: DeviceState | None = None
        self.queue_wait_s = 0.0
        self.prompt_tokens: int | None = None
        self._timer: asyncio.Task | None = None
        self._closed = False

    # -- starting ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Decide, open the first leg (queueing for a device like any request; its errors raise) and
        the others as the decision says."""
        history = self.controller.history
        estimate = history.estimate_tokens(self.prompt_chars)
        self.decision = decision = self.controller.decide(self.dispatch, self.budget, estimate)
        first: Endpoint = self.server_endpoint if decision.server else "device"
        leg = Leg(first, 0)
        stream = await self.dispatcher.open(self._leg_body(leg))
        self.device, self.queue_wait_s, self.prompt_tokens = stream.device, stream.queue_wait_s, stream.prompt_tokens
        history.learn_prompt(self.prompt_chars, self.prompt_tokens)
        self.ledger = CostLedger(self.controller.settings.cost_model(stream.device.speed_class or ""))
        self.legs.adopt(leg, stream)
        if decision.server and decision.device_delay_s is not None:
            if decision.device_delay_s <= 0:
                self._open_beside(Leg("device", 0))
            else:
                self._timer = asyncio.create_task(
                    self._start_device_after(decision.device_delay_s), name="disco-device-wait"
                )

    async def _start_device_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self.inbox.put((None, "device_due", None))

    def _leg_body(self, leg: Leg) -> dict[str, Any]:
        body = {**self.body, "mode": leg.endpoint, "request_id": f"{self.body['request_id']}-{len(self.legs)}"}
        if leg.prefix:
            body["prefix_ids"] = self.generated[: leg.prefix]
            body["prefix_text"] = self.text
            body["max_new_tokens"] = self.max_new - leg.prefix
        return body

    def _opened(self, leg: Leg, stream: DeviceStream) -> None:
        self.ledger.prefill(leg.endpoint, stream.prompt_tokens or 0)

    def _open_beside(self, leg: Leg) -> None:
        """Start a leg on the request's device without blocking delivery."""
        assert self.device is not None  # start() set it before any other leg is opened
        self.legs.open_beside(self.device, leg)

    # -- the delivery loop ---------------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Paced token events, then `done`; a failure nothing can take over is raised (DeviceError)
        once every token generated before it has been delivered."""
        while True:
            now = time.perf_counter()
            if self.buffer and now >= self.next_due:
                yield self._deliver(now)
                continue
            if not self.buffer and self.pending is not None and self.reserve and now >= self.next_due:
                self._call_off("would stall")  # the receiver is late: the source's tokens keep delivery going
                continue
            if not self.buffer:
                if self.failure is not None:
                    raise self.failure
                if self.finished is not None:
                    yield {"type": "done", "finish_reason": self.finished.get("finish_reason"), "stats": self._stats()}
                    return
            if self.failure is not None:
                await asyncio.sleep(self.next_due - now)
                continue
            wait = self.next_due - now if self.buffer or (self.pending and self.reserve) else self.idle_timeout_s
            try:
                async with asyncio.timeout(wait):
                    leg, kind, payload = await self.inbox.get()
            except TimeoutError:
                if self.buffer or (self.pending and self.reserve):
                    continue
                raise DeviceError(504, "disco_timeout", f"no endpoint produced anything for {wait:g} s") from None
            try:
                await self._handle(leg, kind, payload)
            except DeviceError as exc:
                self.failure = exc

    def _deliver(self, now: float) -> dict[str, Any]:
        ids, text, leg = self.buffer.popleft()
        first_index, self.delivered = self.delivered, self.delivered + len(ids)
        self.deliveries.append(now)
        if self.reading_rate > 0:
            # On schedule (a timer's lateness is not carried over), unless nothing was there to deliver.
            on_time = self.deliveries[:-1] and now - self.next_due < 0.5 / self.reading_rate
            self.next_due = (self.next_due if on_time else now) + len(ids) / self.reading_rate
        else:
            self.next_due = now
        for migration in self.migrations:
            if first_index == migration["at_token"] and "max_gap_s" not in migration:
                # the continuation's first token reached the user: the largest gap between deliveries from
                # the last one before the hand-over began to this one
                started = migration["started"]
                times = [t for t in self.deliveries if t < started][-1:] + [t for t in self.deliveries if t >= started]
                migration["max_gap_s"] = max((b - a for a, b in zip(times, times[1:])), default=now - started)
        return {"type": "tokens", "token_ids": ids, "text": text}

    async def _handle(self, leg: Leg | None, kind: str, payload: Any) -> None:
        if kind == "device_due":
            if self.active is None and not any(other.endpoint == "device" for other in self.legs):
                self._open_beside(Leg("device", 0))
            return
        assert leg is not None
        if kind == "alive":  # a leg waiting (its heartbeat): nothing to do, but the request is not idle
            return
        if kind == "event":
            event_type = payload.get("type")
            if event_type == "tokens":
                self._on_tokens(leg, payload)
            elif event_type == "done":
                if leg is self.active:
                    if self.pending is not None:
                        self._call_off("source finished")  # the answer is whole: nothing left to hand over
                    self.finished = payload
                self.legs.close(leg)  # its device slot is free while the buffer is still being delivered
            elif event_type == "error":
                await self._on_failure(
                    leg,
                    DeviceError(
                        502,
                        str(payload.get("code") or "device_error"),
                        str(payload.get("message") or "the endpoint failed"),
                    ),
                )
            return
        await self._on_failure(leg, payload)  # open_failed / failed

    def _on_tokens(self, leg: Leg, event: dict[str, Any]) -> None:
        ids = event.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise DeviceError(502, "device_bad_response", "a tokens event without a list of token ids")
        now = time.perf_counter()
        self.ledger.decode(leg.endpoint, len(ids))  # computed, so paid for, even by a leg that lost
        if leg.first_at is None:
            leg.first_at = now
            ttft = now - leg.started
            assert leg.stream is not None  # only a leg being read produces tokens
            self.controller.history.leg_started(leg.endpoint == "device", leg.stream.prompt_tokens or 0, ttft)
            if leg.endpoint != "device" and leg.prefix == 0:
                self.server_ttft_s = ttft
        if self.active is None:  # the race is decided
            self.active, self.first_endpoint = leg, leg.endpoint
            for other in self.legs:
                if other is not leg:
                    self.legs.close(other)
            if self._timer is not None:
                self._timer.cancel()
        text = str(event.get("text") or "")
        if leg.prefix and leg.first_at == now and self.migrations:  # a receiver's first token
            self.migrations[-1]["ready_s"] = now - self.migrations[-1]["started"]
        if leg is self.pending:
            self._complete_handover()
        elif leg is self.active and self.pending is not None:
            self.reserve.append((ids, text))
            return
        if leg is not self.active or leg.closed:
            return
        self.generated += ids
        self.text += text
        self.buffer.append((ids, text, leg))
        self._maybe_migrate()

    async def _on_failure(self, leg: Leg, exc: DeviceError) -> None:
        self.legs.close(leg)
        if self.active is None:  # still racing: the others may win
            if any(not other.closed for other in self.legs) or (self._timer is not None and not self._timer.done()):
                if self._timer is not None and not self._timer.done() and leg.endpoint != "device":
                    self._timer.cancel()  # the server failed: do not make the device wait for it
                    self._open_beside(Leg("device", 0))
                log.info("DiSCo leg %s failed before its first token (%s); racing on", leg.endpoint, exc.message)
                return
            raise exc
        if leg is self.pending:
            self._call_off(f"receiver failed: {exc.message}")
            return
        if leg is not self.active:
            return
        if self.pending is not None:  # the source failed while handing over: the receiver takes it from here
            self.active, self.pending, self.reserve = self.pending, None, []
            return
        if leg.endpoint != "device" and self.may_resume_on_device():
            log.warning("server endpoint lost mid-answer (%s); migrating to the device", exc.message)
            self._migrate("device", "cloud_lost", 0.0, 0)  # no buffer to wait for: the cloud is gone
            return
        raise exc

    def may_resume_on_device(self) -> bool:
        return self.dispatch != "cloud" and self.dispatch != "hat" and self.device is not None

    # -- migration -----------------------------------------------------------------------------
    def _maybe_migrate(self) -> None:
        if (
            not self.may_migrate
            or self.pending is not None
            or self.finished is not None
            or self.active is None
            or len(self.migrations) >= MAX_HANDOVER_ATTEMPTS
            or any("called_off" not in m for m in self.migrations)
        ):
            return
        eos = getattr(self.device, "eos_token_id", None)
        if eos is not None and self.generated and self.generated[-1] == eos and not self.body.get("ignore_eos"):
            return  # the answer is over
        source = self.active.endpoint
        target = migration_target(self.ledger.cost, source, "device" if source != "device" else self.server_endpoint)
        if target is None:
            return
        history = self.controller.history
        remaining = expected_remaining(len(self.generated), self.max_new, history.mean_output_tokens)
        resume = (self.prompt_tokens or 0) + len(self.generated)
        if remaining < 1 or migration_saving(self.ledger.cost, source, target, remaining, resume) <= 0:
            return
        quantile = self.controller.settings.disco_migration_quantile
        t_m = max(history.ttft_estimate_s(target == "device", resume, quantile), 1.5 * self._slowest_handover_s)
        need = buffer_tokens(self.reading_rate, t_m) if self.reading_rate > 0 else 0
        if sum(len(ids) for ids, _, _ in self.buffer) >= need:
            self._migrate(target, "cost", t_m, need)

    def _migrate(self, target: Endpoint, reason: str, t_m: float, need: int) -> None:
        """Start the receiver from the answer so far. A lost source is replaced at once; a working one
        goes on until the receiver's first token (Fig. 4), its tokens kept aside, so that a receiver
        slower than the buffer can be called off instead of stalling delivery."""
        source = self.active
        assert source is not None  # callers migrate only an active leg
        leg = Leg(target, len(self.generated))
        self.migrations.append(
            {
                "from": source.endpoint,
                "to": target,
                "at_token": len(self.generated),
                "reason": reason,
                "buffered": sum(len(ids) for ids, _, _ in self.buffer),
                "buffer_needed": need,
                "estimated_s": t_m,
                "started": time.perf_counter(),
            }
        )
        if reason == "cost":
            self.pending = leg
        else:
            self.legs.close(source)
            self.active = leg
            if len(self.generated) >= self.max_new:  # it failed after its last token, before saying done
                self.finished = {"finish_reason": "length", "stats": {}}
                return
        self._open_beside(leg)

    def _complete_handover(self) -> None:
        """The receiver's first token: the source stops; what it made meanwhile is dropped (paid, never shown)."""
        assert self.active is not None  # a hand-over starts only from an active leg
        self.legs.close(self.active)
        self.active, self.pending, self.reserve = self.pending, None, []

    def _call_off(self, why: str) -> None:
        """Give the hand-over up: close the receiver; the source's tokens made meanwhile join the answer."""
        migration = self.migrations[-1]
        migration["called_off"] = why
        self._slowest_handover_s = time.perf_counter() - migration["started"]
        assert self.pending is not None and self.active is not None  # called only during a hand-over
        self.legs.close(self.pending)
        self.pending = None
        for ids, text in self.reserve:
            self.generated += ids
            self.text += text
            self.buffer.append((ids, text, self.active))
        self.reserve = []
        log.info("hand-over %s -> %s called off (%s)", migration["from"], migration["to"], why)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.legs.close_all()
        await asyncio.gather(*self.legs.closing, *([self._timer] if self._timer else []), return_exceptions=True)
        if self.prompt_tokens is not None:  # a request that never started teaches nothing
            self.controller.history.request_done(self.prompt_tokens, self.server_ttft_s, len(self.generated))

    def _stats(self) -> dict[str, Any]:
        stats = dict((self.finished or {}).get("stats") or {})
        stats.update(prompt_tokens=self.prompt_tokens, completion_tokens=len(self.generated))
        return stats

    def summary(self) -> dict[str, Any]:
        migrations = [{k: v for k, v in m.items() if k != "started"} for m in self.migrations]
        return {
            "dispatch": self.dispatch,
            "budget": self.budget,
            "reading_rate_tps": self.reading_rate,
            "decision": self.decision.reason if self.decision else None,
            "device_delay_s": self.decision.device_delay_s if self.decision else None,
            "endpoint": self.first_endpoint,
            "endpoints": [leg.endpoint for leg in self.legs],
            "server_ttft_s": self.server_ttft_s,
            "cost": self.ledger.as_dict(),
            "migrations": migrations,
        }
