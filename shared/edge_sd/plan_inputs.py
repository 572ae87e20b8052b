"""What an Edge SD planning round (paper 001, §III; plan.py) reads, each validated: the request body
(tasks, both models' shapes, the budget and the uplink), the state monitor's telemetry and the planner's
defaults.

A body this module refuses raises PlanRequestError (the planner answers 422) or EdgeTelemetryError
(the chunk planner plans with defaults, `default:bad-telemetry`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from shared.edge_sd.runtime import ModelShape, RuntimeModel

# Bounds on one request: Algorithm 1 is O(K^2 N) per l and runs l_max times, so K and the lengths
# (N = ceil(O / L) steps) are capped to keep one plan well under a second of CPU.
MAX_TASKS = 128  # the paper evaluates K = 100; K = 100 plans in ~3 s of one core here
MAX_TOKENS = 1 << 16
MAX_SPEC_LEN = 64
SNR_DB_RANGE = (-50.0, 100.0)
BANDWIDTH_SPLITS = ("eq27", "uniform")
BATCHINGS = ("dp", "max")
# Telemetry lists above this are cut to their first entries (the monitor caps its lists lower).
MAX_TELEMETRY_SAMPLES = 100_000


class PlanRequestError(ValueError):
    """A plan request the planner cannot price: wrong type, missing or unknown field, bad value."""


class EdgeTelemetryError(ValueError):
    """Telemetry (the monitor's `GET /state/edge-sd`) in a shape this planner cannot read."""


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_field(body: Mapping[str, Any], key: str, where: str, low: int = 1, high: int | None = None) -> int:
    value = body.get(key)
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise PlanRequestError(f"{where}{key} must be an int {bound}, got {value!r}")
    return value


def _positive_number(body: Mapping[str, Any], key: str) -> float:
    value = body.get(key)
    if not _is_number(value) or value <= 0:
        raise PlanRequestError(f"{key} must be a finite number > 0, got {value!r}")
    return float(value)


def _only_keys(body: object, allowed: set[str], required: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise PlanRequestError(f"{where or 'the request'} must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise PlanRequestError(f"{where}unknown field(s) {unknown}")
    missing = sorted(required - set(body))
    if missing:
        raise PlanRequestError(f"{where}missing field(s) {missing}")
    return body


@dataclass(frozen=True)
class EdgeTask:
    """Task k: I_k input tokens, O_k expected output tokens, the user's uplink SNR in dB (None:
    the planner's default)."""

    input_tokens: int
    output_tokens: int
    snr_db: float | None = None

    @classmethod
    def from_dict(cls, body: object, index: int) -> EdgeTask:
        where = f"tasks[{index}]."
        body = _only_keys(body, {"input_tokens", "output_tokens", "snr_db"}, {"input_tokens", "output_tokens"}, where)
        snr_db = body.get("snr_db")
        if snr_db is not None and (not _is_number(snr_db) or not SNR_DB_RANGE[0] <= snr_db <= SNR_DB_RANGE[1]):
            raise PlanRequestError(f"{where}snr_db must be a number in {list(SNR_DB_RANGE)} or null, got {snr_db!r}")
        return cls(
            _int_field(body, "input_tokens", where, high=MAX_TOKENS),
            _int_field(body, "output_tokens", where, high=MAX_TOKENS),
            None if snr_db is None else float(snr_db),
        )


def _shape(body: object, key: str) -> ModelShape:
    where = f"{key}."
    body = _only_keys(body, {"layers", "hidden", "ffn"}, {"layers", "hidden", "ffn"}, where)
    return ModelShape(*(_int_field(body, name, where, high=1 << 20) for name in ("layers", "hidden", "ffn")))


def _shape_dict(shape: ModelShape) -> dict[str, int]:
    return {"layers": shape.layers, "hidden": shape.hidden, "ffn": shape.ffn}


@dataclass(frozen=True)
class PlanRequest:
    """One planning round: the tasks, both models' shapes, Γ_s (bytes), B_w (Hz), λ (bits per input
    token, eq. 15), the split and batching to use, and l (None: chosen by eq. 7 over 1..l_max)."""

    tasks: tuple[EdgeTask, ...]
    draft_shape: ModelShape
    target_shape: ModelShape
    memory_budget_bytes: int
    bandwidth_hz: float
    bits_per_token: float
    bandwidth: str = "eq27"
    batching: str = "dp"
    spec_len: int | None = None

    @classmethod
    def from_dict(cls, body: object) -> PlanRequest:
        required = {"tasks", "draft_shape", "target_shape", "memory_budget_bytes", "bandwidth_hz", "bits_per_token"}
        body = _only_keys(body, required | {"bandwidth", "batching", "spec_len"}, required, "")
        tasks = body["tasks"]
        if not isinstance(tasks, list) or not 1 <= len(tasks) <= MAX_TASKS:
            raise PlanRequestError(f"tasks must be a list of 1..{MAX_TASKS} tasks")
        bandwidth, batching = body.get("bandwidth", "eq27"), body.get("batching", "dp")
        if bandwidth not in BANDWIDTH_SPLITS:
            raise PlanRequestError(f"bandwidth must be one of {list(BANDWIDTH_SPLITS)}, got {bandwidth!r}")
        if batching not in BATCHINGS:
            raise PlanRequestError(f"batching must be one of {list(BATCHINGS)}, got {batching!r}")
        spec_len = body.get("spec_len")
        return cls(
            tasks=tuple(EdgeTask.from_dict(task, k) for k, task in enumerate(tasks)),
            draft_shape=_shape(body["draft_shape"], "draft_shape"),
            target_shape=_shape(body["target_shape"], "target_shape"),
            memory_budget_bytes=_int_field(body, "memory_budget_bytes", "", high=1 << 60),
            bandwidth_hz=_positive_number(body, "bandwidth_hz"),
            bits_per_token=_positive_number(body, "bits_per_token"),
            bandwidth=bandwidth,
            batching=batching,
            spec_len=None if spec_len is None else _int_field(body, "spec_len", "", high=MAX_SPEC_LEN),
        )

    def as_dict(self) -> dict[str, Any]:
        """The JSON body `from_dict` reads (what an edge server or bench posts)."""
        return {
            "tasks": [
                {"input_tokens": t.input_tokens, "output_tokens": t.output_tokens, "snr_db": t.snr_db}
                for t in self.tasks
            ],
            "draft_shape": _shape_dict(self.draft_shape),
            "target_shape": _shape_dict(self.target_shape),
            "memory_budget_bytes": self.memory_budget_bytes,
            "bandwidth_hz": self.bandwidth_hz,
            "bits_per_token": self.bits_per_token,
            "bandwidth": self.bandwidth,
            "batching": self.batching,
            "spec_len": self.spec_len,
        }


@dataclass(frozen=True)
class PlanDefaults:
    """What the planner uses where telemetry cannot say. Defaults: the paper's Table II (RTX 3080
    drafting LLaMA-1.1B, RTX 4500 verifying LLaMA-7B; l_max = 10) and α = 0.8 (its Figs. 7-9)."""

    draft_c1: float = 4.11e-13  # s per FLOP (eq. 17, SBS)
    draft_c2: float = 0.56e-3  # s per pass
    verify_c1: float = 2.08e-14  # s per FLOP (MBS)
    verify_c2: float = 1.28e-2  # s per pass
    alpha: float = 0.8
    l_max: int = 10
    snr_db: float = 20.0  # a user's uplink SNR when the request does not give one
    min_samples: int = 8  # fewer passes (or verdicts) than this: the default, not a fit

    def __post_init__(self) -> None:
        RuntimeModel(self.draft_c1, self.draft_c2)
        RuntimeModel(self.verify_c1, self.verify_c2)
        if not _is_number(self.alpha) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if not _is_int(self.l_max) or not 1 <= self.l_max <= MAX_SPEC_LEN:
            raise ValueError(f"l_max must be an int in [1, {MAX_SPEC_LEN}], got {self.l_max!r}")
        if not _is_number(self.snr_db) or not SNR_DB_RANGE[0] <= self.snr_db <= SNR_DB_RANGE[1]:
            raise ValueError(f"snr_db must be in {list(SNR_DB_RANGE)}, got {self.snr_db!r}")
        if not _is_int(self.min_samples) or self.min_samples < 2:
            raise ValueError(f"min_samples must be an int >= 2 (eq. 17 has two unknowns), got {self.min_samples!r}")


def _telemetry_list(body: Mapping[str, Any], key: str, width: int) -> list[list[Any]]:
    rows = body.get(key)
    if rows is None:  # a list the sender had nothing for
        return []
    if not isinstance(rows, list):
        raise EdgeTelemetryError(f"{key} must be a list, got {type(rows).__name__}")
    rows = rows[:MAX_TELEMETRY_SAMPLES]
    for row in rows:
        if not isinstance(row, list) or len(row) != width or not all(_is_number(v) for v in row):
            raise EdgeTelemetryError(f"{key}: every entry must be {width} finite numbers, got {row!r}"[:200])
    return rows


@dataclass
class EdgeTelemetry:
    """Measured passes `(batch_size, flops_per_task, seconds)` of the draft (SBS) and verify (MBS)
    models, and verdicts `(drafts, accepted)`, as the state monitor serves them."""

    draft: list[tuple[int, float, float]] = field(default_factory=list)
    verify: list[tuple[int, float, float]] = field(default_factory=list)
    verdicts: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, body: object) -> EdgeTelemetry:
        if not isinstance(body, Mapping):
            raise EdgeTelemetryError(f"edge-sd telemetry must be a JSON object, got {type(body).__name__}")
        passes = {}
        for key in ("draft", "verify"):
            rows = _telemetry_list(body, key, 3)
            if any(not _is_int(b) or b < 1 or f < 0 or s < 0 for b, f, s in rows):
                raise EdgeTelemetryError(f"{key}: passes need an int batch size >= 1, flops >= 0, seconds >= 0")
            passes[key] = [(b, float(f), float(s)) for b, f, s in rows]
        verdicts = _telemetry_list(body, "verdicts", 2)
        if any(not (_is_int(d) and _is_int(a) and 0 <= a <= d) for d, a in verdicts):
            raise EdgeTelemetryError("verdicts need ints with 0 <= accepted <= drafts")
        return cls(passes["draft"], passes["verify"], [(d, a) for d, a in verdicts])
