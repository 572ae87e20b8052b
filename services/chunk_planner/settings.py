"""Chunk-planner settings, read from `TOPHAT_CHUNK_PLANNER_*` environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.edge_sd.plan_inputs import PlanDefaults
from shared.service_settings import ServiceSettings
from shared.settings import from_env

ENV_PREFIX = "TOPHAT_CHUNK_PLANNER_"


@dataclass(frozen=True)
class Settings(ServiceSettings):
    """Defaults suit a laptop run; every field is `TOPHAT_CHUNK_PLANNER_<FIELD>`."""

    host: str = "127.0.0.1"
    port: int = 8010
    default_chunk_size: int = 128  # HAT compares against server-side chunks of 128/256 (U-Sarathi)
    min_chunk_size: int = 16  # the smallest chunk eq. 3 may answer
    max_chunk_size: int = 1024  # the largest chunk eq. 3 may answer (never more than the prompt)
    # Where eq. 3 / eq. 6 telemetry comes from (GET /state/cloud, /state/device/{id});
    # empty: always the defaults, source "default:no-monitor".
    state_monitor_url: str = ""
    monitor_timeout_s: float = 0.5  # bound on each fetch from the monitor, connect to body
    stale_after_s: float = 30.0  # device telemetry older than this: defaults, "default:stale"
    pipeline_stages: int = 1  # P in eq. 3 (HAT's testbed: 4)
    # A (bytes/token) for callers that do not pass `bytes_per_token`: hidden_size x wire_dtype_bytes.
    # 0 = unknown: such callers get the defaults ("default:no-bytes-per-token"), never eq. 3 for a guess.
    hidden_size: int = 0
    wire_dtype_bytes: int = 2  # fp16 / bf16 hidden states on the wire
    default_parallel_draft_steps: int = 2  # eq. 6 fallback
    max_parallel_draft_steps: int = 16  # upper bound on eq. 6 answers
    # Edge SD (POST /edge-sd/plan): what the plan uses where the monitor's GET /state/edge-sd cannot say
    # (source "default:<reason>"). Defaults: the paper's Table II — T(b, F) = c1*F*b + c2 (eq. 17) of its
    # SBS drafting LLaMA-1.1B (RTX 3080) and MBS verifying LLaMA-7B (RTX 4500), l_max = 10 — and alpha = 0.8
    # (its Figs. 7-9). snr_db: a user's uplink SNR when the request gives none. min_samples: fewer measured
    # passes (or verdicts) than this keep the default instead of a fit.
    edge_sd_draft_c1: float = PlanDefaults.draft_c1  # s per FLOP, 4.11e-13
    edge_sd_draft_c2: float = PlanDefaults.draft_c2  # s per pass, 0.56e-3
    edge_sd_verify_c1: float = PlanDefaults.verify_c1  # 2.08e-14
    edge_sd_verify_c2: float = PlanDefaults.verify_c2  # 1.28e-2
    edge_sd_alpha: float = PlanDefaults.alpha  # 0.8
    edge_sd_l_max: int = PlanDefaults.l_max  # 10
    edge_sd_snr_db: float = PlanDefaults.snr_db  # 20 dB
    edge_sd_min_samples: int = PlanDefaults.min_samples  # 8

    def validate(self) -> None:
        super().validate()  # auth, logging, TLS (shared/service_settings.py)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.min_chunk_size < 1:
            raise ValueError("min_chunk_size must be >= 1")
        if self.max_chunk_size < self.min_chunk_size:
            raise ValueError("max_chunk_size must be >= min_chunk_size")
        if self.default_chunk_size < 1:
            raise ValueError("default_chunk_size must be >= 1")
        if min(self.pipeline_stages, self.wire_dtype_bytes) < 1 or self.hidden_size < 0:
            raise ValueError("pipeline_stages and wire_dtype_bytes must be >= 1, hidden_size >= 0")
        if not (self.monitor_timeout_s > 0 and self.stale_after_s > 0):
            raise ValueError("monitor_timeout_s and stale_after_s must be > 0")
        if not 0 <= self.default_parallel_draft_steps <= self.max_parallel_draft_steps:
            raise ValueError("need 0 <= default_parallel_draft_steps <= max_parallel_draft_steps")
        self.edge_sd_defaults()  # its own checks (alpha in [0, 1], l_max >= 1, c >= 0, ...)

    def edge_sd_defaults(self) -> PlanDefaults:
        return PlanDefaults(
            draft_c1=self.edge_sd_draft_c1,
            draft_c2=self.edge_sd_draft_c2,
            verify_c1=self.edge_sd_verify_c1,
            verify_c2=self.edge_sd_verify_c2,
            alpha=self.edge_sd_alpha,
            l_max=self.edge_sd_l_max,
            snr_db=self.edge_sd_snr_db,
            min_samples=self.edge_sd_min_samples,
        )


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    return from_env(Settings, ENV_PREFIX, environ, **overrides)
