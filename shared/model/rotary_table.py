"""The rotary embedding's cos and sin rows, read from a table the HF module made once.

Why: every pass needs cos and sin for its rows' positions, and the HF rotary module computes them afresh
(about a dozen small operations and an autocast switch): about 0.1 ms of a decode step at int4, run cold
(the weights the step streams push the interpreter's working set out of the caches). With the default rope
a row depends on its position alone: each element is one product inv_freq[i] * position, then cos and sin,
so the module's own call over positions 0..N-1 holds every row any call would give. A probe checks that
on the module at hand (other rope types, e.g. dynamic scaling, depend on the call, and keep the module).
"""

from __future__ import annotations

import weakref

import torch

TABLE_START = 4096  # positions in a first table; it doubles as passes reach further


class RotaryTables:
    """Per rotary module (weakly): per (device, dtype), the cos and sin tables [N, D], or None where a probe
    found their rows differ from the module's own call."""

    def __init__(self) -> None:
        self._tables: weakref.WeakKeyDictionary[
            torch.nn.Module, dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor] | None]
        ] = weakref.WeakKeyDictionary()

    def rows(
        self, rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor, limit: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for `positions` [T], every one below `limit` (the pass's cached plus new rows)."""
        # like: [T, H], the states entering the pass (the tables' device and dtype)
        if getattr(rotary_emb, "rope_type", None) != "default":
            return _module_rows(rotary_emb, like, positions)
        per_module = self._tables.setdefault(rotary_emb, {})
        key = (like.device, like.dtype)
        tables = per_module.get(key, ())
        if tables is None:
            return _module_rows(rotary_emb, like, positions)
        if not tables or tables[0].shape[0] < limit:
            size = max(limit, TABLE_START, 2 * (tables[0].shape[0] if tables else 0))
            tables = _made_table(rotary_emb, like, size)
            per_module[key] = tables
            if tables is None:
                return _module_rows(rotary_emb, like, positions)
        cos, sin = tables
        return cos[positions], sin[positions]


def _module_rows(
    rotary_emb: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary_emb(like, positions[None, :])  # each [1, T, D]
    return cos[0], sin[0]


def _made_table(rotary_emb: torch.nn.Module, like: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The module's rows for positions 0..size-1, or None if some row differs from a call of its own."""
    cos, sin = _module_rows(rotary_emb, like, torch.arange(size, device=like.device))
    probe = torch.tensor([size - 1, 0, size // 2 + 1, 7], device=like.device)
    probe = probe[probe < size]
    for alone in (probe, probe[:1]):  # several rows in one call, and one row alone (a decode step's)
        probe_cos, probe_sin = _module_rows(rotary_emb, like, alone)
        if not (torch.equal(probe_cos, cos[alone]) and torch.equal(probe_sin, sin[alone])):
            return None
    return cos, sin


ROTARY_TABLES = RotaryTables()  # the process's tables: every runner reads the same rows
