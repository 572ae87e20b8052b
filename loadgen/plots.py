"""PNG figures of a load-generator run (matplotlib, Agg backend: no display needed).

The CDF plots mirror HAT Figs. 9-10 (TTFT/TBT and SLA compliance), and the
per-step plot Fig. 8 (cloud compute delay), so runs can be compared by eye.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from loadgen.metrics import RequestRecord, tbt_samples_s, ttft_s

log = logging.getLogger(__name__)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (benches run headless), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if values_ms.size == 0:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(values_ms)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("fraction")
    ax.grid(alpha=0.3)


def plot_latency_cdfs(records: Sequence[RequestRecord], out_dir: Path, title: str) -> list[Path]:
    """ttft_cdf.png and tbt_cdf.png (successful requests; TBT pooled over all tokens)."""
    plt = pyplot()
    written = []
    series = {
        "ttft": np.asarray([v for v in map(ttft_s, records) if v is not None]) * 1e3,
        "tbt": np.asarray([x for r in records for x in tbt_samples_s(r)]) * 1e3,
    }
    for name, values in series.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        _cdf(ax, values, name.upper())
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_title(f"{name.upper()} CDF - {title}", fontsize=9)
        path = out_dir / f"{name}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_sla_compliance(compliance: dict[str, Any], out_dir: Path, title: str) -> Path:
    """sla_compliance.png: fraction of requests within each threshold, prefill and decode side by side."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = {"prefill": "TTFT per 128 prompt tokens (ms)", "decode": "delay per 10 output tokens (ms)"}
    for ax, (name, xlabel) in zip(axes, labels.items()):
        curve = compliance.get(name) or {}
        ax.plot(curve.get("thresholds_ms", []), curve.get("fraction", []))
        if curve.get("sla_ms") is not None:
            ax.axvline(curve["sla_ms"], color="grey", ls="--", lw=1)
            ax.set_title(f"{name} SLA: {curve['compliance']:.1%} within {curve['sla_ms']:g} ms", fontsize=9)
        else:
            ax.set_title(f"{name} SLA compliance", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    path = out_dir / "sla_compliance.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cloud_steps(steps: Sequence[dict[str, float]], out_dir: Path, title: str) -> Path:
    """cloud_compute_delay.png: per-step verifier compute delay over the run, with mean and std."""
    plt = pyplot()
    delay = np.asarray([s["compute_s"] for s in steps]) * 1e3
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(np.arange(delay.size), delay, lw=0.8)
    ax.axhline(delay.mean(), color="red", lw=1, label=f"mean {delay.mean():.2f} ms, std {delay.std():.2f} ms")
    ax.set_xlabel("verifier step")
    ax.set_ylabel("compute delay (ms)")
    ax.set_title(f"cloud compute delay per step - {title}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path = out_dir / "cloud_compute_delay.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(
    records: Sequence[RequestRecord],
    results: dict[str, Any],
    out_dir: Path,
    title: str,
    steps: Sequence[dict[str, float]] = (),
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = plot_latency_cdfs(records, out_dir, title)
    paths.append(plot_sla_compliance(results.get("sla_compliance") or {}, out_dir, title))
    if steps:
        paths.append(plot_cloud_steps(steps, out_dir, title))
    log.info("wrote %s", ", ".join(p.name for p in paths))
    return paths
