"""Verify and decode passes replayed from CUDA graphs, one per padded (rows, width) bucket.

On a GPU a small verify pass is launch-bound: every layer is a few dozen kernels of microseconds each, so
a pass of 1 row and one of 32 cost about the same, and most of it is the CPU launching them
(docs/bench/gpu-h100.json: 11 ms eager, 1.65 ms replayed). A CUDA graph launches the whole pass at once,
but only for the shapes and addresses it was captured with; so the sessions' KV sits in a static pool
(static_kv.py) and the pass reads it through index tensors (static_pass.py).

`StaticPasses.forward_batch` is a drop-in for `LayerRange.forward_batch`: a pass whose rows and widest
row fit a bucket is padded to it, its inputs copied into the bucket's static buffers, and its graph replayed
(captured the first time the bucket is used); anything else runs the eager packed pass on the same caches
(a long prefill chunk, more rows than the largest bucket, a cache not in the pool). Where the layers are not
on CUDA the static-shape pass runs eagerly instead of being captured (`capture=False`): the CPU tests run
the very function a graph holds.

Buckets: rows 1, 2, 4, ..., 32 (a decode row, a chain, a tree, a few sessions' drafts together); widths
(cache rows a row sees) doubling from 64 to the slot's capacity. A server captures the narrower widths at
its start (`capture_buckets`), the rest at first use, all from one private memory pool they share (never
replayed concurrently: one runner thread).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from shared.model.invariant_attention import CHUNK
from shared.model.kv_cache import SessionKV
from shared.model.split import LayerRange
from shared.model.static_kv import SlotKV, StaticKVPool
from shared.model.static_pass import StaticRows, plan_rows, seen_width, static_pass
from shared.model.tree_rows import TreeRows

log = logging.getLogger("shared.model.cuda_graphs")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_WIDTH = 64  # cache rows of the narrowest width bucket (a multiple of CHUNK)


def parse_row_buckets(text: str) -> tuple[int, ...]:
    """ "1,2,4,8" -> (1, 2, 4, 8): positive, strictly increasing."""
    try:
        buckets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"row buckets must be comma-separated integers, got {text!r}") from None
    if not buckets or buckets[0] < 1 or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"row buckets must be positive and increasing, got {text!r}")
    return buckets


def width_buckets(capacity: int) -> tuple[int, ...]:
    """MIN_WIDTH, doubling, then the capacity itself (each a multiple of CHUNK, as `attend` needs)."""
    widths, width = [], MIN_WIDTH
    while width < capacity:
        widths.append(width)
        width *= 2
    return (*widths, -(-capacity // CHUNK) * CHUNK)


def smallest(buckets: Sequence[int], needed: int) -> int | None:
    return next((bucket for bucket in buckets if bucket >= needed), None)


class CapturedPass:
    """One bucket's static inputs, its captured graph and the output the graph writes."""

    def __init__(self, layers: LayerRange, pool: StaticKVPool, rows: int, width: int, memory: Any):
        device, dtype = layers.device, layers.dtype
        self.hidden = torch.zeros(rows, layers.hidden_size, dtype=dtype, device=device)  # [R, H]
        self.rows = StaticRows.padding(rows, width, pool.scratch, dtype, device)
        # Warm up on a side stream first (cuBLAS handles and workspaces, the rotary table): allocations
        # and lazy initialisation must not happen inside the capture. The padding rows touch only scratch.
        # Streams and the capture belong to the current device: make it the layers' (cuda:N, any thread).
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    static_pass(layers, pool, self.hidden, self.rows)
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=memory):
                self.out = static_pass(layers, pool, self.hidden, self.rows)  # [R, H], rewritten by every replay

    def replay(self, hidden: torch.Tensor, rows: StaticRows) -> torch.Tensor:
        with torch.cuda.device(self.hidden.device):  # the runner's worker thread may have another current device
            self.hidden[: hidden.shape[0]].copy_(hidden)
            self.hidden[hidden.shape[0] :].zero_()
            self.rows.copy_from(rows)
            self.graph.replay()
            return self.out.clone()  # the next replay overwrites `out`


class StaticPasses:
    """Packed passes over a static pool's sessions: static-shape passes per bucket, else eager."""

    def __init__(
        self,
        layers: LayerRange,
        pool: StaticKVPool,
        row_buckets: Sequence[int] = ROW_BUCKETS,
        capture: bool | None = None,
    ):
        """`capture`: record CUDA graphs (None: where the layers are on CUDA); False runs the static-shape
        pass eagerly."""
        self.layers, self.pool = layers, pool
        self.row_buckets = tuple(row_buckets)
        self.widths = width_buckets(pool.capacity)
        self.capture = layers.device.type == "cuda" if capture is None else capture
        if self.capture and layers.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the layers on CUDA, they are on {layers.device}")
        self.graphs: dict[tuple[int, int], CapturedPass] = {}
        self._memory = torch.cuda.graph_pool_handle() if self.capture else None
        self.counts: Counter[str] = Counter()  # passes by path: "graph" / "static" (eager, static shapes) / "eager"

    def capture_buckets(self, max_width: int) -> None:
        """Capture every row bucket at every width up to `max_width` now (a server's start), so the first
        requests do not pay the captures; wider buckets are still captured at first use."""
        if not self.capture:
            return
        for rows in self.row_buckets:
            for width in self.widths:
                if width <= max_width and (rows, width) not in self.graphs:
                    self.graphs[rows, width] = CapturedPass(self.layers, self.pool, rows, width, self._memory)
        log.info("captured %d verify passes as CUDA graphs", len(self.graphs))

    def bucket(self, caches: Sequence[SessionKV], lengths: Sequence[int], trees: Sequence[TreeRows | None]):
        """(rows, width) of the bucket this pass fits, or None (the eager pass runs it)."""
        if not all(isinstance(cache, SlotKV) and cache.pool is self.pool for cache in caches):
            return None
        rows = smallest(self.row_buckets, sum(lengths))
        width = smallest(self.widths, seen_width(caches, lengths, trees))
        return None if rows is None or width is None else (rows, width)

    def forward_batch(
        self, items: Sequence[tuple[SessionKV, torch.Tensor]], trees: Sequence[TreeRows | None] | None = None
    ) -> list[torch.Tensor]:
        """`LayerRange.forward_batch`'s contract: [(cache, hidden [S_i, H])] -> [[S_i, H]], caches appended."""
        caches, lengths = [cache for cache, _ in items], [h.shape[0] for _, h in items]
        listed = list(trees) if trees is not None else [None] * len(items)
        shape = self.bucket(caches, lengths, listed)
        if shape is None:
            self.counts["eager"] += 1
            return self.layers.forward_batch(items, trees)
        rows, width = shape
        slots = [cache for cache in caches if isinstance(cache, SlotKV)]  # all of them (bucket() checked)
        planned = plan_rows(slots, lengths, listed, rows, width, self.layers.dtype)
        packed = torch.cat([h for _, h in items])  # [T, H]
        if self.capture:
            graph = self.graphs.get(shape)
            if graph is None:
                log.info("capturing the verify pass for %d rows x %d cache rows", rows, width)
                graph = CapturedPass(self.layers, self.pool, rows, width, self._memory)
                self.graphs[shape] = graph
            out = graph.replay(packed, planned)
            self.counts["graph"] += 1
        else:
            padded = packed.new_zeros(rows, packed.shape[1])
            padded[: packed.shape[0]] = packed
            device = self.layers.device
            on_device = StaticRows(*(getattr(planned, f).to(device) for f in StaticRows.__dataclass_fields__))
            out = static_pass(self.layers, self.pool, padded, on_device)
            self.counts["static"] += 1
        for cache, n in zip(caches, lengths):
            cache.advance(n)  # the pass wrote rows length..length+n-1 of every layer
        return list(out[: packed.shape[0]].split(lengths))
