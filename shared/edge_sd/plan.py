"""Edge SD planning round (paper 001, §III): one request's tasks + live telemetry -> batches, the
speculation length l and the uplink shares, with the `source` of every input.

Pure: the chunk planner fetches the telemetry (`GET /state/edge-sd` of the state monitor) and the
request body, plan_inputs.py validates them, this module only combines the library's pieces:

    runtime T(b, F) = c1*F*b + c2     runtime.fit_runtime on measured passes (eq. 17), else defaults
    alpha                             picospec_model.alpha_from_verdicts on measured verdicts
    batches                           batching.dp_batching (Algorithm 1) or max_batching
    l                                 speculation.choose_speculation_length (eq. 7 over 1..l_max),
                                      each l priced by the batching plan's T_inf (eq. 22)
    shares, upload times              bandwidth.uplink_split (eq. 27) or uniform_split; eq. 15

`sources` in the answer says, per input, whether it came from the request, telemetry or a default
and why (`default:<reason>`: no-telemetry, few-samples, unfit, no-trials, or the planner's fetch
failure such as monitor-unreachable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.edge_sd.bandwidth import uniform_split, uplink_split, upload_times
from shared.edge_sd.batching import BatchPlan, EdgeCosts, InfeasibleBatchingError, dp_batching, max_batching
from shared.edge_sd.plan_inputs import (
    EdgeTask,
    EdgeTelemetry,
    EdgeTelemetryError,
    PlanDefaults,
    PlanRequest,
    PlanRequestError,
)
from shared.edge_sd.runtime import RuntimeFitError, RuntimeModel, fit_runtime
from shared.edge_sd.speculation import choose_speculation_length
from shared.specdec.picospec_model import alpha_from_verdicts

# The planning round's API in one place: the device agent's edge server imports its inputs from here.
__all__ = [
    "EdgePlan",
    "EdgeTask",
    "EdgeTelemetry",
    "EdgeTelemetryError",
    "InfeasibleBatchingError",
    "PlanDefaults",
    "PlanRequest",
    "PlanRequestError",
    "plan_round",
]


@dataclass(frozen=True)
class EdgePlan:
    batches: tuple[tuple[int, ...], ...]  # task indices (request order), in pipeline order
    spec_len: int  # l
    shares: tuple[float, ...]  # w_k
    upload_s: tuple[float, ...]  # T_k,com (eq. 15)
    alpha: float
    draft_runtime: RuntimeModel
    verify_runtime: RuntimeModel
    inference_s: float  # T_inf (eq. 22)
    sources: dict[str, str]

    @property
    def upload_latency_s(self) -> float:
        """T_com (eq. 16): inference waits for the slowest upload."""
        return max(self.upload_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": [list(batch) for batch in self.batches],
            "spec_len": self.spec_len,
            "shares": list(self.shares),
            "upload_s": list(self.upload_s),
            "alpha": self.alpha,
            "draft_runtime": {"c1": self.draft_runtime.c1, "c2": self.draft_runtime.c2},
            "verify_runtime": {"c1": self.verify_runtime.c1, "c2": self.verify_runtime.c2},
            "predicted": {
                "upload_s": self.upload_latency_s,
                "inference_s": self.inference_s,
                "total_s": self.upload_latency_s + self.inference_s,
            },  # eq. 23
            "sources": dict(self.sources),
        }


def _fallback_reason(telemetry: EdgeTelemetry | None, telemetry_failure: str | None) -> str | None:
    """Why no telemetry at all could be used (None: there is some)."""
    if telemetry is not None:
        return None
    reason = telemetry_failure or "no-telemetry"
    return reason if reason.startswith("default:") else f"default:{reason}"


def _runtime(
    samples: list[tuple[int, float, float]], default: RuntimeModel, min_samples: int, no_telemetry: str | None
) -> tuple[RuntimeModel, str]:
    if no_telemetry is not None:
        return default, no_telemetry
    if len(samples) < min_samples:
        return default, "default:few-samples"
    try:
        return fit_runtime(samples), "fitted:telemetry"
    except RuntimeFitError:
        return default, "default:unfit"


def _alpha(
    verdicts: list[tuple[int, int]], default: float, min_samples: int, no_telemetry: str | None
) -> tuple[float, str]:
    if no_telemetry is not None:
        return default, no_telemetry
    if len(verdicts) < min_samples:
        return default, "default:few-samples"
    try:
        return alpha_from_verdicts(verdicts), "telemetry"
    except ValueError:  # only empty drafts: no draft was ever tested
        return default, "default:no-trials"


def _snrs(request: PlanRequest, defaults: PlanDefaults) -> tuple[list[float], str]:
    """Linear SNRs p_k g_k / σ² (bandwidth.py's unit) and whether they came from the request."""
    given = [task.snr_db is not None for task in request.tasks]
    source = "request" if all(given) else "default" if not any(given) else "request+default"
    decibels = [defaults.snr_db if task.snr_db is None else task.snr_db for task in request.tasks]
    return [10.0 ** (db / 10.0) for db in decibels], source


def plan_round(
    request: PlanRequest, telemetry: EdgeTelemetry | None, defaults: PlanDefaults, telemetry_failure: str | None = None
) -> EdgePlan:
    """Batches, l and shares for `request`. `telemetry` None: every measured input is the default
    with source `default:<telemetry_failure>` (e.g. monitor-unreachable). Raises
    InfeasibleBatchingError when a task alone exceeds the memory budget Γ_s."""
    no_telemetry = _fallback_reason(telemetry, telemetry_failure)
    measured = telemetry or EdgeTelemetry()
    draft_runtime, draft_source = _runtime(
        measured.draft, RuntimeModel(defaults.draft_c1, defaults.draft_c2), defaults.min_samples, no_telemetry
    )
    verify_runtime, verify_source = _runtime(
        measured.verify, RuntimeModel(defaults.verify_c1, defaults.verify_c2), defaults.min_samples, no_telemetry
    )
    alpha, alpha_source = _alpha(measured.verdicts, defaults.alpha, defaults.min_samples, no_telemetry)

    tasks = [(task.input_tokens, task.output_tokens) for task in request.tasks]
    batch = dp_batching if request.batching == "dp" else max_batching
    plans: dict[int, BatchPlan] = {}

    def latency_of_l(spec_len: int) -> float:
        # Memory (eqs. 9-10) does not depend on l: an infeasible task raises at the first l.
        costs = EdgeCosts(
            request.draft_shape,
            request.target_shape,
            draft_runtime,
            verify_runtime,
            spec_len,
            alpha,
            request.memory_budget_bytes,
        )
        plans[spec_len] = batch(costs, tasks)
        return plans[spec_len].latency

    if request.spec_len is None:
        spec_len, _ = choose_speculation_length(alpha, defaults.l_max, latency_of_l)
    else:
        spec_len = request.spec_len
        latency_of_l(spec_len)
    chosen = plans[spec_len]

    snrs, snr_source = _snrs(request, defaults)
    lengths = [task.input_tokens for task in request.tasks]
    shares = uplink_split(lengths, snrs) if request.bandwidth == "eq27" else uniform_split(len(lengths))
    uploads = upload_times(lengths, snrs, shares, request.bandwidth_hz, request.bits_per_token)
    sources = {
        "tasks": "request",
        "snr_db": snr_source,
        "alpha": alpha_source,
        "draft_runtime": draft_source,
        "verify_runtime": verify_source,
        "spec_len": "eq7" if request.spec_len is None else "request",
        "batching": "algorithm1" if request.batching == "dp" else "max-batch",
        "shares": request.bandwidth,
    }
    return EdgePlan(
        batches=chosen.batches,
        spec_len=spec_len,
        shares=tuple(shares),
        upload_s=tuple(uploads),
        alpha=alpha,
        draft_runtime=draft_runtime,
        verify_runtime=verify_runtime,
        inference_s=chosen.latency,
        sources=sources,
    )
