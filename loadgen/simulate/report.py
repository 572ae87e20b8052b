"""Tables: modes side by side per rate (with ratios to a baseline), and sim vs real.

Both work on results dicts with the load generator's keys (mean_ttft_ms, median_ttft_ms,
p90_ttft_ms, p99_ttft_ms and the same for tbt), so a real `results.json` written by
`tophat loadgen` compares directly with a simulated run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STATS = (("mean", "mean"), ("median", "P50"), ("p90", "P90"), ("p99", "P99"))
ACCEPTANCE = 0.20  # sim vs real: relative difference allowed at <= 4 devices
JUDGED_STATS = ("mean", "median")  # tails are shown, not judged (see compare_with_real)


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def _rate_key(rate: Any) -> float:
    return math.inf if rate in ("inf", None) else float(rate)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def rate_table(runs: list[dict[str, Any]], baseline: str = "ushape") -> str:
    """One table for the runs of one rate: TTFT and TBT mean/P50/P90/P99 (ms), ratios to `baseline`."""
    base = next((r for r in runs if r["mode"] == baseline), None)
    header = ["mode"] + [f"TTFT {label}" for _, label in STATS] + [f"TBT {label}" for _, label in STATS]
    header += [f"TTFT/{baseline}", f"TBT/{baseline}", "accept", "stage ms"]
    rows = []
    for r in runs:
        cells = [r["mode"]] + [_ms(r.get(f"{s}_{m}_ms")) for m in ("ttft", "tbt") for s, _ in STATS]
        for metric in ("ttft", "tbt"):
            ours, theirs = r.get(f"mean_{metric}_ms"), (base or {}).get(f"mean_{metric}_ms")
            cells.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "-")
        accept = r.get("mean_accept_length")
        cells.append("-" if accept is None else f"{accept:.2f}")
        cells.append(_ms((r.get("cloud") or {}).get("mean_stage_ms")))
        rows.append(cells)
    return _table(header, rows)


def grid_tables(grid: Mapping[str, Any], baseline: str = "ushape") -> str:
    """`simulate_grid` output as one titled table per rate."""
    cfg = grid.get("config", {})
    out = []
    for rate in grid["rates"]:
        runs = [r for r in grid["runs"] if _rate_key(r["request_rate"]) == _rate_key(rate)]
        count = runs[0].get("num_prompts") if runs else 0
        title = (
            f"rate {_rate_key(rate):g} req/s | {cfg.get('devices')} devices, P = {cfg.get('stages')}, "
            f"{cfg.get('workload')}, {count} requests, seed {cfg.get('seed')}"
        )
        out.append(f"{title}\n{rate_table(runs, baseline)}")
    return "\n\n".join(out)


def _budget_share(run: Mapping[str, Any]) -> str:
    rounds = run.get("budget_rounds")
    if not rounds:
        return "-"
    total = sum(rounds.values())
    return ", ".join(f"{name} {count / total:.0%}" for name, count in rounds.items()) if total else "-"


def ratio_summary(
    grid: Mapping[str, Any], baseline: str = "ushape", mode: str | tuple[str, ...] = "hat", target: float | None = None
) -> str:
    """Every rate on one table: each mode's mean TTFT and TBT, its ratios to `baseline`, the budget's
    choices; then whether each of `mode`'s (one name or several) mean TBT is within `target` x the
    baseline's at every rate."""
    judged = (mode,) if isinstance(mode, str) else tuple(mode)
    header = ["rate", "mode", "TTFT mean", "TBT mean", f"TTFT/{baseline}", f"TBT/{baseline}", "budget rounds"]
    rows: list[list[str]] = []
    ratios: dict[str, list[float | None]] = {name: [] for name in judged}
    for rate in grid["rates"]:
        runs = [r for r in grid["runs"] if _rate_key(r["request_rate"]) == _rate_key(rate)]
        base: dict[str, Any] = next((r for r in runs if r["mode"] == baseline), {})
        for r in runs:
            cells = [f"{_rate_key(rate):g}", r["mode"], _ms(r.get("mean_ttft_ms")), _ms(r.get("mean_tbt_ms"))]
            for metric in ("ttft", "tbt"):
                ours, theirs = r.get(f"mean_{metric}_ms"), base.get(f"mean_{metric}_ms")
                ratio = ours / theirs if ours is not None and theirs else None
                cells.append("-" if ratio is None else f"{ratio:.2f}x")
                if metric == "tbt" and r["mode"] in ratios:
                    ratios[r["mode"]].append(ratio)
            rows.append(cells + [_budget_share(r)])
    out = _table(header, rows)
    for name, found in ratios.items():
        if target is None or not found:
            continue
        met = all(x is not None and x <= target for x in found)
        worst = max((x for x in found if x is not None), default=None)
        out += f"\n{name} mean TBT <= {target:g}x {baseline}'s at every rate: {'yes' if met else 'no'}" + (
            "" if worst is None else f" (worst {worst:.2f}x)"
        )
    return out


# -- sim vs real ---------------------------------------------------------------------------


def _load(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    return json.loads(Path(item).read_text())


def _real_runs(real: Any, mode: str | None) -> list[tuple[str | None, dict[str, Any]]]:
    """Normalize the `real` argument to [(mode, results)]."""
    if isinstance(real, (str, Path)) or (isinstance(real, Mapping) and "mean_ttft_ms" in real):
        data = _load(real)
        return [(mode or data.get("mode"), data)]
    if isinstance(real, Mapping):  # {mode: results or path}
        return [(str(m), _load(v)) for m, v in real.items()]
    return [(mode or _load(item).get("mode"), _load(item)) for item in real]


def _sim_runs(sim: Any) -> list[dict[str, Any]]:
    if isinstance(sim, Mapping) and "runs" in sim:
        return list(sim["runs"])
    if isinstance(sim, Mapping):
        return [dict(sim)]
    return list(sim)


def compare_with_real(
    sim_results: Any,
    real_results_json: Any,
    *,
    mode: str | None = None,
    echo: bool = True,
    tolerance: float = ACCEPTANCE,
) -> str:
    """Sim vs real TTFT/TBT (mean, P50, P90, P99) and the relative difference (sim - real) / real.

    `sim_results`: a `simulate_grid` dict, one run's results, or a list of them.
    `real_results_json`: a loadgen results.json path or dict, a list of them, or {mode: path|dict}.
    A real run is matched to the simulated run with the same rate and mode (`mode` names the
    mode when the real results do not; default: the only simulated mode at that rate, else
    "hat"). Means and medians are held to `tolerance` (flagged OFF beyond it); P90/P99 are
    shown but not judged: with tens of requests on one small box the tails are set by the
    co-located processes competing for the same cores, which the simulator (device and cloud
    on their own hardware, as deployed) deliberately does not model. The last line of each block estimates the
    device-side per-round overhead that would close the mean-TBT gap
    (Calibration.round_overhead_s), since that is the usual missing piece.
    """
    sims = _sim_runs(sim_results)
    blocks = []
    for real_mode, real in _real_runs(real_results_json, mode):
        rate = _rate_key(real.get("request_rate"))
        at_rate = [s for s in sims if _rate_key(s.get("request_rate")) == rate]
        wanted = real_mode or (at_rate[0]["mode"] if len(at_rate) == 1 else "hat")
        sim = next((s for s in at_rate if s["mode"] == wanted), None)
        head = f"{wanted} @ {real.get('request_rate')} req/s, {real.get('num_devices')} real devices"
        if sim is None:
            blocks.append(f"{head}: no simulated run with that mode and rate")
            continue
        rows, worst = [], 0.0
        for metric in ("ttft", "tbt"):
            for stat, label in STATS:
                s, r = sim.get(f"{stat}_{metric}_ms"), real.get(f"{stat}_{metric}_ms")
                rel = (s - r) / r if s is not None and r else None
                judged = stat in JUDGED_STATS
                if rel is not None and judged:
                    worst = max(worst, abs(rel))
                flag = "" if rel is None else ("(tail)" if not judged else "ok" if abs(rel) <= tolerance else "OFF")
                rows.append([f"{metric.upper()} {label}", _ms(s), _ms(r), "-" if rel is None else f"{rel:+.1%}", flag])
        text = f"{head} (sim {sim.get('num_devices')} devices)\n"
        text += _table(["metric", "sim ms", "real ms", "rel diff", ""], rows)
        text += f"\nworst |rel diff| of mean/P50 {worst:.1%} (acceptance {tolerance:.0%})"
        s_tbt, r_tbt = sim.get("mean_tbt_ms"), real.get("mean_tbt_ms")
        accept = real.get("mean_accept_length") or sim.get("mean_accept_length") or 1.0
        if s_tbt is not None and r_tbt is not None:
            text += (
                f"\nmean-TBT gap x accept length = {(r_tbt - s_tbt) * accept:+.2f} ms per round "
                "(a candidate for round_overhead_s)"
            )
        blocks.append(text)
    out = "\n\n".join(blocks)
    if echo:
        print(out)
    return out
