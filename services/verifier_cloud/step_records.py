"""What the verifier tells the state monitor about its passes: one verifier_step record per served batch
(HAT's mu-hat and eta-hat, per micro-batch with P > 1) and, once serving, the timed passes it made at startup
as calibration samples of g (so the planners read a measured curve before the first request)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.verifier_cloud.engine import StepStats
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import VerifierMetrics

log = logging.getLogger("services.verifier_cloud")


class StepRecorder:
    def __init__(
        self,
        telemetry: TelemetryClient,
        metrics: VerifierMetrics,
        pipeline_stages: int,
        runs_on: str,
        calibration: Sequence[tuple[int, float]] = (),
    ) -> None:
        self.telemetry, self.metrics = telemetry, metrics
        self.pipeline_stages, self.runs_on = pipeline_stages, runs_on
        self.calibration = list(calibration)  # (rows, seconds) of timed passes at startup
        self.steps = 0

    def send_calibration(self) -> None:
        for rows, seconds in self.calibration:
            self.telemetry.emit_verifier_calibration(rows, seconds)

    def record(self, stats: StepStats, overhead_s: float | None) -> None:
        self.steps += 1
        self.metrics.step(stats.batched_tokens, stats.compute_s)
        kinds = {"prefill": stats.num_prefill, "verify": stats.num_verify}
        if stats.num_token:
            kinds["token"] = stats.num_token  # of the prefill + verify items, those in token mode
        self.telemetry.emit_verifier_step(
            stats.batched_tokens,
            stats.compute_s,
            stats.num_sessions,
            kinds,
            overhead_s,
            pipeline_stages=self.pipeline_stages,
            runs_on=self.runs_on,
        )
        log.debug(
            "step %d: %d tokens, %d sessions, %.1f ms",
            self.steps,
            stats.batched_tokens,
            stats.num_sessions,
            stats.compute_s * 1e3,
        )
