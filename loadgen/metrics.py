"""Per-request records and the statistics computed from them (pure: no I/O, no clocks).

Definitions (times are seconds from the start of the run; stats are reported in ms):

* TTFT = first content chunk - *arrival* (the scheduled time, so queueing behind a
  client-side concurrency cap counts, as in HAT: "request arrival -> first token").
* TBT: every gap between consecutive delivered tokens. The stream carries text,
  not tokens, and one chunk can carry a whole speculative round, so a chunk of k
  tokens arriving G after the previous one counts as k gaps of G/k, and the first
  chunk's extra k-1 tokens as gaps of 0 -- shared/telemetry/latency_stats.py, the one
  definition the streamer, the engine and the chat client use too. (vllm's ITL
  would be one gap per chunk.) Each chunk's token count: tophatctl/chunk_tokens.py.
* TPOT = (E2E - TTFT) / (output tokens - 1); undefined for one-token outputs.
* E2E = end of the stream ([DONE] or failure) - arrival.
* HAT SLAs: prefill SLA = TTFT per 128 prompt tokens = TTFT * 128 / prompt tokens;
  decode SLA = delay per 10 generated tokens = 10 * TPOT.
* Failed requests are counted in `failed`, never compliant with an SLA, never good.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from shared.telemetry import latency_stats
from shared.telemetry.latency_stats import Timeline
from tophatctl.chunk_tokens import chunk_token_counts

PREFILL_SLA_TOKENS = 128
DECODE_SLA_TOKENS = 10
_MS = 1e3


@dataclass
class RequestRecord:
    """What the runner saw of one request."""

    index: int
    arrival_s: float
    max_tokens: int
    prompt_tokens: int | None = None  # server usage if reported, else the workload's count
    device_hint: int = 0
    send_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # filled by reconcile_tokens()
    completion_tokens: int | None = None  # usage (or the tophat stats) reported by the server
    server_rounds: list[int] | None = None  # tokens per delivered round, if the server reports them
    finish_reason: str | None = None
    accept_length: float | None = None
    num_rounds: int | None = None
    device_id: str | None = None
    server_ttft_s: float | None = None  # the streamer's own view, from the tophat field
    server_tbt_s: float | None = None
    server_queue_wait_s: float | None = None  # how long the streamer queued it for a device slot
    tophat: dict[str, Any] | None = None  # the streamer's final `tophat` object as sent (cost, endpoint, ...)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def reconcile_tokens(record: RequestRecord, count: Callable[[str], int] | None = None) -> None:
    """Set `record.chunk_tokens` (see chunk_token_counts)."""
    record.chunk_tokens = chunk_token_counts(record.chunk_texts, record.completion_tokens, record.server_rounds, count)


def output_tokens(r: RequestRecord) -> int:
    return sum(r.chunk_tokens) if r.chunk_tokens else len(r.chunk_times_s)


def timeline(r: RequestRecord) -> Timeline:
    """The request's deliveries from its *arrival*; a chunk not yet reconciled counts as one token."""
    return Timeline(r.arrival_s, list(r.chunk_times_s), list(r.chunk_tokens or [1] * len(r.chunk_times_s)))


def ttft_s(r: RequestRecord) -> float | None:
    return latency_stats.ttft_s(timeline(r)) if r.ok else None


def e2e_s(r: RequestRecord) -> float | None:
    return r.end_s - r.arrival_s if r.ok and r.end_s is not None else None


def tpot_s(r: RequestRecord) -> float | None:
    ttft, e2e, n = ttft_s(r), e2e_s(r), output_tokens(r)
    return (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None


def tbt_samples_s(r: RequestRecord) -> list[float]:
    return latency_stats.tbt_samples_s(timeline(r)) if r.ok else []


def prefill_sla_s(r: RequestRecord) -> float | None:
    ttft = ttft_s(r)
    return ttft * PREFILL_SLA_TOKENS / r.prompt_tokens if ttft is not None and r.prompt_tokens else None


def decode_sla_s(r: RequestRecord) -> float | None:
    tpot = tpot_s(r)
    return tpot * DECODE_SLA_TOKENS if tpot is not None else None


def summarize_ms(values_s: Iterable[float | None], name: str) -> dict[str, float | None]:
    """mean/median/std/p90/p99 of `name` in ms (None when there is no sample)."""
    stats = latency_stats.summary(None if v is None else v * _MS for v in values_s)
    return {f"{k}_{name}_ms": v for k, v in stats.items()}


def compliance_curve(
    records: list[RequestRecord], sla: Callable[[RequestRecord], float | None], thresholds_s: np.ndarray
) -> np.ndarray:
    """Fraction of requests whose SLA value is <= each threshold (a CDF). Failed requests are in
    the denominator and never comply; successful ones where the SLA is undefined are left out."""
    values = np.asarray([v for v in map(sla, records) if v is not None], dtype=float)
    denom = len(values) + sum(1 for r in records if not r.ok)
    if denom == 0:
        return np.zeros(len(thresholds_s))
    return np.searchsorted(np.sort(values), thresholds_s, side="right") / denom


def threshold_grid(
    records: list[RequestRecord],
    sla: Callable[[RequestRecord], float | None],
    points: int = 101,
    include_s: float | None = None,
) -> np.ndarray:
    """0 .. just past the largest value (and past `include_s`, an SLA to be shown on the curve)."""
    values = [v for v in map(sla, records) if v is not None] + ([include_s] if include_s else [])
    top = max(values) * 1.05 if values and max(values) > 0 else 1.0
    return np.linspace(0.0, top, points)


def goodput_rps(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float]) -> float | None:
    """Requests per second meeting every given SLO (`ttft`, `tpot`, `e2el`, in ms); None without SLOs."""
    if not slos_ms:
        return None
    getters = {"ttft": ttft_s, "tpot": tpot_s, "e2el": e2e_s}
    unknown = set(slos_ms) - set(getters)
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)} (use ttft, tpot, e2el)")
    good = 0
    for r in records:
        if not r.ok:
            continue
        values = {k: getters[k](r) for k in slos_ms}
        # A one-token answer has no TPOT; like vllm it does not fail a TPOT SLO.
        if all((v is None and k == "tpot") or (v is not None and v * _MS <= slos_ms[k]) for k, v in values.items()):
            good += 1
    return good / duration_s if duration_s > 0 else None


def mean_accept_length(records: list[RequestRecord]) -> float | None:
    """Tokens per verification over the run: per-request means weighted by their round counts
    (a request whose round count the server did not report counts as one round)."""
    return latency_stats.pooled_accept_length(
        (r.accept_length, r.num_rounds or 1) for r in records if r.ok and r.accept_length is not None
    )


def run_duration_s(records: list[RequestRecord]) -> float:
    """Start of the run (t = 0) to the last request's end (or last arrival, if later)."""
    ends = [r.end_s for r in records if r.end_s is not None] + [r.arrival_s for r in records]
    return max(ends, default=0.0)


def build_results(
    records: list[RequestRecord],
    *,
    slos_ms: dict[str, float] | None = None,
    sla_thresholds_ms: dict[str, float] | None = None,
    grid_points: int = 101,
) -> dict[str, Any]:
    """The `vllm bench serve`-style summary plus HAT's accept length and SLA compliance curves."""
    ok = [r for r in records if r.ok]
    duration = run_duration_s(records)
    out_tokens = sum(output_tokens(r) for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    res: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
    }
    res |= summarize_ms(map(ttft_s, records), "ttft")
    res |= summarize_ms((x for r in records for x in tbt_samples_s(r)), "tbt")
    res |= summarize_ms(map(tpot_s, records), "tpot")
    res |= summarize_ms(map(e2e_s, records), "e2el")
    res |= summarize_ms((r.send_s - r.arrival_s for r in ok if r.send_s is not None), "queue_delay")
    res |= summarize_ms((r.server_queue_wait_s for r in ok), "server_queue_wait")
    res["mean_accept_length"] = mean_accept_length(records)
    res["goodput"] = goodput_rps(records, duration, slos_ms or {})
    res["goodput_slos_ms"] = slos_ms or None
    compliance: dict[str, Any] = {}
    for name, sla in (("prefill", prefill_sla_s), ("decode", decode_sla_s)):
        res |= summarize_ms(map(sla, records), f"{name}_sla")
        limit = (sla_thresholds_ms or {}).get(name)
        grid = threshold_grid(records, sla, grid_points, None if limit is None else limit / _MS)
        curve = {"thresholds_ms": (grid * _MS).tolist(), "fraction": compliance_curve(records, sla, grid).tolist()}
        if limit is not None:
            curve["sla_ms"] = limit
            curve["compliance"] = float(compliance_curve(records, sla, np.array([limit / _MS]))[0])
        compliance[name] = curve
    res["sla_compliance"] = compliance
    res["errors"] = dict(Counter(r.error for r in records if r.error).most_common(10))
    return res


def request_row(r: RequestRecord) -> dict[str, Any]:
    """One requests.csv row: inputs, per-request metrics (ms) and the raw chunk trace."""

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * _MS, 3)

    tbt = tbt_samples_s(r)
    return {
        "index": r.index,
        "device_hint": r.device_hint,
        "device_id": r.device_id,
        "ok": r.ok,
        "error": r.error,
        "prompt_tokens": r.prompt_tokens,
        "max_tokens": r.max_tokens,
        "output_tokens": output_tokens(r),
        "finish_reason": r.finish_reason,
        "arrival_ms": ms(r.arrival_s),
        "send_ms": ms(r.send_s),
        "end_ms": ms(r.end_s),
        "ttft_ms": ms(ttft_s(r)),
        "tpot_ms": ms(tpot_s(r)),
        "e2el_ms": ms(e2e_s(r)),
        "mean_tbt_ms": ms(float(np.mean(tbt))) if tbt else None,
        "max_tbt_ms": ms(max(tbt)) if tbt else None,
        "prefill_sla_ms": ms(prefill_sla_s(r)),
        "decode_sla_ms": ms(decode_sla_s(r)),
        "accept_length": r.accept_length,
        "num_rounds": r.num_rounds,
        "server_ttft_ms": ms(r.server_ttft_s),
        "server_tbt_ms": ms(r.server_tbt_s),
        "server_queue_wait_ms": ms(r.server_queue_wait_s),
        "num_chunks": len(r.chunk_times_s),
        "chunk_times_ms": " ".join(f"{t * _MS:.3f}" for t in r.chunk_times_s),
        "chunk_tokens": " ".join(map(str, r.chunk_tokens)),
    }
