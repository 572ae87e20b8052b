"""The state monitor's state: records applied to the in-memory model (shared/planning/state_model.py), the
source of truth for answers, and mirrored to Redis (best effort) so other processes and dashboards
can read them and a restarted monitor can resume its averages.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from services.state_monitor.records import (
    DeviceDraft,
    DeviceRtt,
    DeviceTransfer,
    RequestDone,
    VerifierCalibration,
    VerifierStep,
)
from services.state_monitor.settings import Settings
from shared.planning.compute_delay import ComputeDelayPredictor
from shared.planning.state_model import CloudState, DeviceState
from shared.telemetry import sink as tk

log = logging.getLogger(__name__)

PREDICT_SAMPLES = [2**k for k in range(13)]  # 1 .. 4096 batched tokens


class Monitor:
    """Applies records to the state model and mirrors them to Redis via the sink."""

    def __init__(self, settings: Settings, sink: tk.TelemetrySink | None) -> None:
        self.settings = settings
        self.sink = sink
        self.cloud = self._new_cloud()
        self.devices: dict[str, DeviceState] = {}
        self.started_at = time.time()

    def _new_cloud(self) -> CloudState:
        s = self.settings
        return CloudState(alpha=s.alpha, g=ComputeDelayPredictor(s.alpha, s.buckets_per_octave))

    def device(self, device_id: str) -> DeviceState:
        state = self.devices.get(device_id)
        if state is None:
            state = self.devices[device_id] = DeviceState(device_id, alpha=self.settings.alpha)
        return state

    async def restore(self) -> None:
        """Resume averages from Redis (best effort: bad or missing data is skipped)."""
        if self.sink is None:
            return
        try:
            cloud = await self.sink.read_hash(tk.VERIFIER_STATE)
            if cloud and cloud.get("model"):
                self.cloud = CloudState.from_dict(json.loads(cloud["model"]))
            for device_id in sorted(await self.sink.read_members(tk.DEVICES) or ())[:10_000]:
                data = await self.sink.read_hash(tk.device_state_key(device_id))
                if data and data.get("model"):
                    self.devices[device_id] = DeviceState.from_dict(json.loads(data["model"]))
        except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            log.warning("ignoring unreadable state in redis: %s", exc)
        log.info("restored state: %d cloud buckets, %d devices", self.cloud.g.observed_buckets, len(self.devices))

    async def ingest(
        self, rec: VerifierStep | VerifierCalibration | DeviceDraft | DeviceTransfer | DeviceRtt | RequestDone
    ) -> bool:
        now = time.time()
        raw = {**rec.model_dump(), "ts": rec.ts if rec.ts is not None else now}
        if isinstance(rec, VerifierCalibration):
            self.cloud.observe_calibration(rec.batched_tokens, rec.compute_s, now)
            return await self._write(events=[], states=[(tk.VERIFIER_STATE, self._cloud_hash(), None)])
        if isinstance(rec, VerifierStep):
            self.cloud.observe_step(
                rec.batched_tokens,
                rec.compute_s,
                now,
                overhead_s=rec.overhead_s,
                num_sessions=rec.num_sessions,
                step_kinds=rec.step_kinds,
                **({"pipeline_stages": rec.pipeline_stages} if rec.pipeline_stages else {}),
                **({"runs_on": rec.runs_on} if rec.runs_on else {}),
            )
            return await self._write(
                events=[(tk.VERIFIER_STEPS, raw)], states=[(tk.VERIFIER_STATE, self._cloud_hash(), None)]
            )
        if isinstance(rec, RequestDone):
            summary = {**raw, "mean_tbt_s": _mean(rec.token_times_s), "mean_accept_len": _mean(rec.accept_lengths)}
            cap = self.settings.disco_history
            samples = [(tk.DISCO_PROMPT_TOKENS, rec.prompt_tokens), (tk.DISCO_SERVER_TTFT, rec.server_ttft_s)]
            return await self._write(
                events=[(tk.REQUESTS, summary)],
                states=[(tk.request_key(rec.request_id), summary, self.settings.request_ttl_s)],
                lists=[(key, value, cap) for key, value in samples if value is not None],
            )
        dev = self.device(rec.device_id)
        if isinstance(rec, DeviceDraft):
            dev.observe_draft(
                rec.step_s,
                now,
                round_overhead_s=rec.round_overhead_s,
                round_overhead_median_s=rec.round_overhead_median_s,
                prefill_token_s=rec.prefill_token_s,
                pd_hit_rate=rec.pd_hit_rate,
                full_accept_rate=rec.full_accept_rate,
            )
        elif isinstance(rec, DeviceRtt):
            dev.observe_rtt(rec.rtt_s, now)
        else:
            raw["bytes_per_s"] = dev.observe_transfer(rec.direction, rec.bytes, rec.seconds, now)
        return await self._write(
            events=[(tk.device_events_key(rec.device_id), raw)],
            states=[(tk.device_state_key(rec.device_id), self._device_hash(dev), None)],
            members=[(tk.DEVICES, rec.device_id)],
        )

    async def _write(self, **ops: Any) -> bool:
        return await self.sink.write(**ops) if self.sink is not None else False

    def _cloud_hash(self) -> dict[str, Any]:
        c = self.cloud
        line = c.g.fit_line()
        return {
            "mu": c.mu.value,
            "eta": c.eta.value,
            "steps": c.mu.count,
            "last_mu_hat": c.last.get("mu_hat"),
            "last_eta_hat": c.last.get("eta_hat"),
            "num_sessions": c.last.get("num_sessions"),
            "step_kinds": c.last.get("step_kinds", {}),
            "step_overhead_s": c.step_overhead.value,
            "g_c1": line[0] if line else None,
            "g_c2": line[1] if line else None,
            "g": c.g.table(),
            "updated_at": c.updated_at,
            "model": c.to_dict(),
        }

    @staticmethod
    def _device_estimates(d: DeviceState) -> dict[str, float | None]:
        """The current value of every per-device average (HAT's gamma and beta, the simulator's rest)."""
        return {
            "gamma": d.gamma.value,
            "beta_up": d.beta_up.value,
            "beta_down": d.beta_down.value,
            "round_overhead_s": d.round_overhead.value,
            "round_overhead_median_s": d.round_overhead_median.value,
            "prefill_token_s": d.prefill_token.value,
            "rtt_s": d.rtt.value,
            "pd_hit_rate": d.pd_hit.value,
            "full_accept_rate": d.full_accept.value,
        }

    def _device_hash(self, d: DeviceState) -> dict[str, Any]:
        return {
            **self._device_estimates(d),
            "draft_samples": d.gamma.count,
            "up_samples": d.beta_up.count,
            "down_samples": d.beta_down.count,
            "last_update": d.last_update,
            "model": d.to_dict(),
        }

    def cloud_view(self) -> dict[str, Any]:
        c = self.cloud
        line = c.g.fit_line()
        return {
            "mu": c.mu.value,
            "eta": c.eta.value,
            "steps": c.mu.count,
            "alpha": c.alpha,
            "last": c.last,
            "step_overhead_s": c.step_overhead.value,
            "g": {"buckets": c.g.table(), "line": {"c1": line[0], "c2": line[1]} if line else None},
            "predict": {str(m): c.g.predict(m) for m in PREDICT_SAMPLES},
            "updated_at": c.updated_at,
        }

    def device_view(self, d: DeviceState) -> dict[str, Any]:
        now = time.time()
        return {
            "device_id": d.device_id,
            **self._device_estimates(d),
            "samples": {"draft": d.gamma.count, "up": d.beta_up.count, "down": d.beta_down.count},
            "last_update": d.last_update,
            "age_s": d.age(now),
            "stale": d.is_stale(now, self.settings.device_stale_s),
        }


def _mean(xs: list[float] | list[int]) -> float | None:
    return sum(xs) / len(xs) if xs else None
