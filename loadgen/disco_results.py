"""The DiSCo bench's results (loadgen/bench_disco.py runs the bench): the policies, one entry per run from its
per-request records, disco against the baselines (ratios, Pareto front), the table and the plot.

All pure: tests/e2e/test_bench_disco.py drives them with hand-made inputs.
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from loadgen.metrics import RequestRecord, build_results

BASELINES = ("device", "cloud", "random")
# A migration's largest delivery gap is compared with 1/r_c; the streamer paces by sleeping, so a
# gap of exactly 1/r_c comes out a few ms over it: 10% slack before it counts as a stall.
GAP_SLACK = 1.1


@dataclass(frozen=True)
class Policy:
    mode: str  # device | cloud | random | disco
    budget: float | None  # None for device and cloud (they do not depend on b)

    @property
    def label(self) -> str:
        return self.mode if self.budget is None else f"{self.mode}@{self.budget:g}"


# -- aggregation --------------------------------------------------------------------------------
def _finite(value: Any) -> float | None:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate(
    records: Sequence[RequestRecord], *, mode: str, budget: float | None, constraint: str, reading_rate_tps: float
) -> dict[str, Any]:
    """One results entry from a run's per-request records (their `tophat` objects carry cost, endpoint,
    migrations). Latency statistics are the load generator's own (metrics.build_results)."""
    stats = build_results(list(records))
    done = [r.tophat for r in records if r.ok and isinstance(r.tophat, dict)]  # the streamer's `tophat` objects
    cost: list[dict[str, Any]] = [c if isinstance(c := t.get("cost"), dict) else {} for t in done]
    totals = [v for v in (_finite(c.get("total")) for c in cost) if v is not None]
    # every hand-over begun; those called off (the receiver would have stalled delivery) stayed on the source
    handovers = [m for t in done for m in (t.get("migrations") or []) if isinstance(m, dict)]
    migrations = [m for m in handovers if "called_off" not in m]
    gaps = [v for v in (_finite(m.get("max_gap_s")) for m in handovers) if v is not None]
    limit_s = 1.0 / reading_rate_tps if reading_rate_tps > 0 else None
    return {
        "mode": mode,
        "budget": budget,
        "constraint": constraint,
        "reading_rate_tps": reading_rate_tps,
        "requests": len(records),
        "completed": stats["completed"],
        "failed": stats["failed"],
        "mean_ttft_ms": stats["mean_ttft_ms"],
        "median_ttft_ms": stats["median_ttft_ms"],
        "p99_ttft_ms": stats["p99_ttft_ms"],
        "mean_tbt_ms": stats["mean_tbt_ms"],
        "p99_tbt_ms": stats["p99_tbt_ms"],
        "mean_cost": _mean(totals),
        "mean_device_cost": _mean([v for v in (_finite(c.get("device")) for c in cost) if v is not None]),
        "mean_server_cost": _mean([v for v in (_finite(c.get("server")) for c in cost) if v is not None]),
        "costed": len(totals),  # requests whose cost the streamer reported
        "endpoints": dict(Counter(str(t.get("endpoint")) for t in done)),  # who gave the first token
        "decisions": dict(Counter(str(t.get("decision")) for t in done)),
        # requests whose dispatch started more than one endpoint (hand-over receivers not counted)
        "raced": sum(1 for t in done if len(t.get("endpoints") or []) - len(t.get("migrations") or []) > 1),
        "migrations": len(migrations),
        "handovers_called_off": len(handovers) - len(migrations),
        "migration_reasons": dict(Counter(str(m.get("reason")) for m in migrations)),
        "max_migration_gap_ms": max(gaps) * 1e3 if gaps else None,
        "migration_gap_limit_ms": limit_s * 1e3 if limit_s else None,
        "migration_stalls": sum(1 for g in gaps if limit_s and g > limit_s * GAP_SLACK),
        "migrations_unfinished": len(handovers) - len(gaps),  # the continuation never reached the user
        "errors": stats["errors"],
    }


# -- comparison ---------------------------------------------------------------------------------
def _point(entry: dict[str, Any], ttft_key: str) -> tuple[float, float] | None:
    x, y = _finite(entry.get("mean_cost")), _finite(entry.get(ttft_key))
    return None if x is None or y is None else (x, y)


def _label(entry: dict[str, Any]) -> str:
    return Policy(entry["mode"], entry["budget"]).label


def dominators(entry: dict[str, Any], others: Sequence[dict[str, Any]], ttft_key: str) -> list[str]:
    """Labels of the entries that dominate `entry` in (mean cost, ttft_key): no worse in both and better
    in one (lower is better in both)."""
    point = _point(entry, ttft_key)
    if point is None:
        return []
    beaten = []
    for other in others:
        q = _point(other, ttft_key)
        if q is not None and q[0] <= point[0] and q[1] <= point[1] and q != point:
            beaten.append(_label(other))
    return beaten


def _ratio(a: Any, b: Any) -> float | None:
    a, b = _finite(a), _finite(b)
    return a / b if a is not None and b not in (None, 0.0) else None


def compare(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every disco entry with its ratios (disco / baseline: mean TTFT, P99 TTFT, mean cost) against
    random at the same budget, device-only and cloud-only of the same regime, and whether it is on
    the Pareto front of {device, cloud, random at every budget} in (mean TTFT, cost) and (P99 TTFT, cost)."""
    out = []
    for entry in entries:
        if entry["mode"] != "disco":
            continue
        same = [e for e in entries if e["constraint"] == entry["constraint"]]
        baselines = [e for e in same if e["mode"] in BASELINES]
        against = {
            "random": next((e for e in same if e["mode"] == "random" and e["budget"] == entry["budget"]), None),
            "device": next((e for e in same if e["mode"] == "device"), None),
            "cloud": next((e for e in same if e["mode"] == "cloud"), None),
        }
        ratios = {
            name: None
            if base is None
            else {
                "mean_ttft": _ratio(entry["mean_ttft_ms"], base["mean_ttft_ms"]),
                "p99_ttft": _ratio(entry["p99_ttft_ms"], base["p99_ttft_ms"]),
                "cost": _ratio(entry["mean_cost"], base["mean_cost"]),
            }
            for name, base in against.items()
        }
        by_mean = dominators(entry, baselines, "mean_ttft_ms")
        by_p99 = dominators(entry, baselines, "p99_ttft_ms")
        out.append(
            {
                **entry,
                "ratios": ratios,
                "pareto_mean": _point(entry, "mean_ttft_ms") is not None and not by_mean,
                "pareto_p99": _point(entry, "p99_ttft_ms") is not None and not by_p99,
                "dominated_by_mean": by_mean,
                "dominated_by_p99": by_p99,
            }
        )
    return out


# -- presentation -------------------------------------------------------------------------------
def _ms(v: Any) -> str:
    return "-" if _finite(v) is None else f"{v:.0f}"


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_tables(entries: Sequence[dict[str, Any]], title: str) -> str:
    """The measurements, then disco against the baselines measured in the same run."""
    lines = [
        title,
        f"{'regime':7s} {'policy':12s} {'done':>6s} {'TTFT mean':>9s} {'TTFT p99':>9s} {'cost $/req':>11s} "
        f"{'TBT p99':>8s} {'raced':>5s} {'first token dev/srv':>19s} {'migr (off)':>10s} {'max gap / 1/r_c':>16s}",
    ]
    for e in entries:
        first = e.get("endpoints") or {}
        server_first = sum(v for k, v in first.items() if k in ("cloud", "hat"))
        gap = (
            f"{_ms(e['max_migration_gap_ms'])}/{_ms(e['migration_gap_limit_ms'])} ms"
            if e.get("max_migration_gap_ms") is not None
            else "-"
        )
        cost = "-" if _finite(e.get("mean_cost")) is None else f"{e['mean_cost']:.3g}"
        lines.append(
            f"{e['constraint']:7s} {_label(e):12s} {e['completed']:>3d}/{e['requests']:<2d} "
            f"{_ms(e['mean_ttft_ms']):>7s}ms {_ms(e['p99_ttft_ms']):>7s}ms {cost:>11s} "
            f"{_ms(e['p99_tbt_ms']):>6s}ms {e['raced']:5d} {first.get('device', 0):>9d}/{server_first:<9d} "
            f"{e['migrations']:4d} ({e.get('handovers_called_off', 0):2d})  {gap:>16s}"
        )
    compared = compare(entries)
    if compared:
        lines += [
            "",
            "disco / baseline (mean TTFT, P99 TTFT, cost); Pareto front of {device, cloud, random@all b} "
            "in (TTFT, cost)",
            f"{'regime':7s} {'policy':12s} {'vs random@b':>23s} {'vs device-only':>23s} {'vs cloud-only':>23s} "
            f"{'front(mean)':>11s} {'front(p99)':>10s}",
        ]
        for c in compared:
            cells = []
            for name in ("random", "device", "cloud"):
                r = c["ratios"][name]
                cells.append("-" if r is None else f"{_x(r['mean_ttft'])} {_x(r['p99_ttft'])} {_x(r['cost'])}")
            lines.append(
                f"{c['constraint']:7s} {_label(c):12s} {cells[0]:>23s} {cells[1]:>23s} {cells[2]:>23s} "
                f"{'yes' if c['pareto_mean'] else 'no':>11s} {'yes' if c['pareto_p99'] else 'no':>10s}"
            )
            for key, name in (("dominated_by_mean", "mean"), ("dominated_by_p99", "p99")):
                if c[key]:
                    lines.append(f"{'':20s} ({name}) dominated by {', '.join(c[key])}")
    return "\n".join(lines)


def plot_cost_ttft(entries: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Mean and P99 TTFT against mean cost, one point per (policy, budget); random and disco joined
    across budgets."""
    from loadgen.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    markers = {"device": "s", "cloud": "^", "random": "o", "disco": "*"}
    for ax, key, name in ((axes[0], "mean_ttft_ms", "mean TTFT (ms)"), (axes[1], "p99_ttft_ms", "P99 TTFT (ms)")):
        for mode, marker in markers.items():
            points = sorted(
                (e["budget"] or 0.0, p) for e in entries if e["mode"] == mode for p in [_point(e, key)] if p is not None
            )
            if not points:
                continue
            xs, ys = [p[0] for _, p in points], [p[1] for _, p in points]
            ax.plot(
                xs, ys, marker=marker, ms=10 if mode == "disco" else 7, ls="-" if len(points) > 1 else "", label=mode
            )
            if mode in ("random", "disco"):
                for b, (x, y) in points:
                    ax.annotate(f"b={b:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(xlabel="mean cost per request ($)", ylabel=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
