"""The soak's memory rule: each service's resident memory over the soak, and whether it grew like a leak.

RSS is read from /proc/<pid>/status (VmRSS) before the warm-up, right after it (the baseline), every few
seconds of the load and at the end. Growth is measured on the samples after the warm-up only (the warm-up
loads every lazy path: the first prefill, allocator pools), and robustly: the median of the last third of
them minus the median of the first third, so one late spike (a large batch, a collection not yet run) does
not count as a leak, and a steady climb does. A service fails when its growth exceeds both bounds of
`RssLimit`: a share of its baseline and a floor in MiB (so a small process's allocator noise, Redis's
+1 MiB being +10%, does not fail a soak). A service restarted during the soak fails too: a crash or an OOM
kill, and its memory's history is lost with it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

KIB_PER_MIB = 1024


def rss_kib(pid: int) -> int | None:
    """Resident memory of `pid` in KiB (VmRSS), or None if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class RssLimit:
    """Growth after the warm-up that fails the soak: over `max_growth_pct` of the baseline and over
    `min_growth_mib` (both)."""

    max_growth_pct: float = 5.0
    min_growth_mib: float = 8.0

    def __post_init__(self) -> None:
        if not (self.max_growth_pct >= 0 and self.min_growth_mib >= 0):
            raise ValueError(f"RSS limits must be >= 0: {self}")

    def describe(self) -> str:
        return f"growth over {self.max_growth_pct:g}% and over {self.min_growth_mib:g} MiB after the warm-up"


def rss_growth_kib(samples_kib: Sequence[int]) -> float | None:
    """How much the samples (after the warm-up, in order) grew: the median of the last third minus the median of
    the first third; with fewer than three samples, the last minus the first. None without two samples."""
    if len(samples_kib) < 2:
        return None
    if len(samples_kib) < 3:
        return float(samples_kib[-1] - samples_kib[0])
    third = len(samples_kib) // 3
    return statistics.median(samples_kib[-third:]) - statistics.median(samples_kib[:third])


@dataclass
class ServiceMemory:
    """One service's RSS over the soak (KiB). `samples`: from the baseline (after the warm-up) to the end."""

    name: str
    pid: int
    start_kib: int | None  # before the warm-up
    baseline_kib: int | None = None  # right after the warm-up
    end_kib: int | None = None
    peak_kib: int | None = None
    end_pid: int | None = None
    lost: bool = False  # its pid changed (restarted) or it is gone
    samples: list[int] = field(default_factory=list)

    def sample(self, pid: int | None) -> None:
        """Read the service's RSS now, if it still is the process the soak started with."""
        self.end_pid = pid
        if pid != self.pid:
            self.lost = True  # restarted or gone: its memory's history ends here
            return
        kib = rss_kib(pid)
        if kib is not None:
            self.samples.append(kib)
            self.peak_kib = max(self.peak_kib or 0, kib)

    def finish(self, end_kib: int | None) -> None:
        """Record the end reading (taken after the last sample) and the peak over the start, the samples and the
        end: the end may be the highest reading (CI once saw it 4 KiB above the samples' peak). A restarted
        service's end is another process's RSS, so it does not count toward the peak."""
        self.end_kib = end_kib
        own_end = end_kib if not self.lost else None
        self.peak_kib = max(self.peak_kib or 0, self.start_kib or 0, own_end or 0) or None

    @property
    def growth_kib(self) -> float | None:
        return rss_growth_kib(self.samples)

    @property
    def growth_pct(self) -> float | None:
        growth = self.growth_kib
        if growth is None or not self.baseline_kib:
            return None
        return 100.0 * growth / self.baseline_kib

    def failure(self, limit: RssLimit) -> str | None:
        """Why this service fails the soak's memory rule, or None when it passes."""
        if self.lost:
            now = "is gone" if self.end_pid is None else f"was restarted (pid {self.pid} -> {self.end_pid})"
            return f"{self.name} {now} during the soak"
        growth, pct = self.growth_kib, self.growth_pct
        if growth is None or pct is None:
            return None
        if pct > limit.max_growth_pct and growth > limit.min_growth_mib * KIB_PER_MIB:
            return (
                f"{self.name} grew {growth / KIB_PER_MIB:.1f} MiB ({pct:+.1f}%) after the warm-up "
                f"(limit: {limit.describe()})"
            )
        return None
