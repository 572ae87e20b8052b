"""Which KV layout a verifier's runners keep, and whether their passes run from CUDA graphs, per settings.

kv_layout: dynamic (caches that grow by doubling, shared/model/kv_cache.py), static (a preallocated slot of
the whole context per session, shared/model/static_kv.py), auto (static where CUDA graphs run, else
dynamic). cuda_graphs: auto (static-shape passes captured as graphs where the layers are on CUDA and the
layout is static), on (the static-shape passes everywhere: captured on CUDA, eager elsewhere, as the
CPU tests run them), off. The math is in shared/model/; this file only decides and builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.model.cuda_graphs import ROW_BUCKETS, StaticPasses, parse_row_buckets
from shared.model.split import LayerRange
from shared.model.static_kv import StaticKVPool, static_capacity


class KVSettings(Protocol):
    """What a plan reads of the verifier's Settings (settings.py imports this module, so not that class)."""

    @property
    def kv_layout(self) -> str: ...
    @property
    def cuda_graphs(self) -> str: ...
    @property
    def cuda_graph_rows(self) -> str: ...
    @property
    def kv_bytes_total(self) -> int: ...
    @property
    def max_sessions(self) -> int: ...


PRECAPTURED_WIDTH = 1024  # cache rows: graphs up to this width are captured when a runner is built
KV_LAYOUTS = ("auto", "dynamic", "static")
CUDA_GRAPHS = ("auto", "on", "off")


def check_kv_settings(kv_layout: str, cuda_graphs: str, cuda_graph_rows: str) -> None:
    """The settings' syntax, and that graphs are not asked of a layout they cannot read."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {cuda_graphs!r}")
    if cuda_graphs == "on" and kv_layout == "dynamic":
        raise ValueError("cuda_graphs on needs the static KV layout (kv_layout static or auto)")
    parse_row_buckets(cuda_graph_rows)


@dataclass(frozen=True)
class KVPlan:
    """A runner's KV layout, decided for one device (picklable: stage workers get theirs in their spec)."""

    static: bool = False
    graphs: bool = False  # static-shape passes: captured as CUDA graphs where the layers are on CUDA
    row_buckets: tuple[int, ...] = ROW_BUCKETS
    # the slots of a pool: min(max_sessions, kv_bytes_total // one slot's bytes), at least one
    kv_bytes_total: int = 32 * 2**30
    max_sessions: int = 256

    @classmethod
    def decide(
        cls,
        kv_layout: str,
        cuda_graphs: str,
        cuda_graph_rows: str,
        on_cuda: bool,
        kv_bytes_total: int,
        max_sessions: int,
    ) -> "KVPlan":
        check_kv_settings(kv_layout, cuda_graphs, cuda_graph_rows)
        graphs_wanted = cuda_graphs == "on" or (cuda_graphs == "auto" and on_cuda)
        static = kv_layout == "static" or (kv_layout == "auto" and graphs_wanted)
        return cls(static, static and graphs_wanted, parse_row_buckets(cuda_graph_rows), kv_bytes_total, max_sessions)

    @classmethod
    def of(cls, settings: KVSettings, on_cuda: bool) -> "KVPlan":
        """From a verifier's Settings, for layers on CUDA or not."""
        return cls.decide(
            settings.kv_layout,
            settings.cuda_graphs,
            settings.cuda_graph_rows,
            on_cuda,
            settings.kv_bytes_total,
            settings.max_sessions,
        )

    def runner_parts(self, layers: LayerRange, context_length: int) -> tuple[StaticKVPool | None, StaticPasses | None]:
        """The pool and passes a ModelRunner over `layers` takes: (None, None) in the dynamic layout."""
        if not self.static:
            return None, None
        capacity = static_capacity(context_length)
        slot = StaticKVPool.slot_bytes(len(layers.layers), layers.num_kv_heads, layers.head_dim, layers.dtype, capacity)
        pool = StaticKVPool.for_layers(layers, capacity, max(1, min(self.max_sessions, self.kv_bytes_total // slot)))
        if not self.graphs:
            return pool, None
        passes = StaticPasses(layers, pool, self.row_buckets)
        passes.capture_buckets(PRECAPTURED_WIDTH)  # where the layers are on CUDA; wider ones at first use
        return pool, passes


DYNAMIC = KVPlan()  # growable caches, eager passes: the plan of a runner built without settings
