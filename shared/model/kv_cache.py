"""Per-session KV caches that grow in place and roll back to any length.

Rollback after a rejected draft is just moving `length` back: the stale rows
stay allocated and are overwritten by the next append, so repeated rollbacks
cost nothing and never copy.

After a token tree was verified, `compact` keeps only the accepted path: its
rows move down to sit right after the committed prefix (base, base+1, ...).
They were computed at positions base + depth, which are exactly where they
land, so their rotary embeddings stay right.

Capacity depends only on how far a cache was asked to reach, never on the
order of the requests: a fresh cache holds MIN_CAPACITY rows, a fork
`fork_capacity(length)`, and growing to `needed` rows gives
`grown_capacity(needed)` (the next power of two times MIN_CAPACITY: doubling,
amortised O(1) per row). So whoever admits work can bound a cache's bytes from
the positions it will reach (services/verifier_cloud/budgets.py) without
knowing which items succeed.

A cache made with a `capacity` is static instead: preallocated at that size and
never reallocated (growing past it is a KVCacheError), so its tensors keep their
addresses for the session's life (shared/model/static_kv.py: slots of one pool,
read by static-shape passes and CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_CAPACITY = 64  # rows of a fresh cache


def grown_capacity(needed: int) -> int:
    """The capacity a cache grows to when it must hold `needed` rows: MIN_CAPACITY * 2**k >= needed."""
    capacity = MIN_CAPACITY
    while capacity < needed:
        capacity *= 2
    return capacity


def fork_capacity(length: int) -> int:
    """The capacity of a fork of `length` positions: the prefix and a little room to go on."""
    return max(length + 16, MIN_CAPACITY)


class KVCacheError(ValueError):
    """An invalid cache operation (truncate beyond length, use after free)."""


class LayerKV:
    """Keys and values of one attention layer for one session."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int = MIN_CAPACITY,
        device: torch.device | str = "cpu",
        fixed: bool = False,
    ):
        self.fixed = fixed  # static: never reallocated (a static pass or a CUDA graph holds its address)
        # keys/values: [Hkv, capacity, D] on the layer's device; rows >= length are stale or zeros, never
        # NaN (batch-invariant attention reads padding rows and weights them by exactly 0)
        self.keys = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def _grow(self, needed: int) -> None:
        if self.fixed:
            raise KVCacheError(f"a static cache of {self.capacity} rows cannot hold {needed}")
        new_capacity = grown_capacity(needed)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], new_capacity, old.shape[2])  # same dtype and device
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [Hkv, S, D] and return views of the whole cache, [Hkv, length, D]."""
        new_length = self.length + keys.shape[1]
        if new_length > self.capacity:
            self._grow(new_length)
        self.keys[:, self.length : new_length] = keys
        self.values[:, self.length : new_length] = values
        self.length = new_length
        return self.keys[:, :new_length], self.values[:, :new_length]

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows, the length unchanged (grown rows are zeros)."""
        if rows > self.capacity:
            self._grow(rows)

    def padded(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first `width` >= length rows, [Hkv, width, D]: the rows past the length are finite."""
        if width < self.length:
            raise KVCacheError(f"a padded view of {width} rows is shorter than the cache's {self.length}")
        self.reserve(width)
        return self.keys[:, :width], self.values[:, :width]

    @torch.inference_mode()  # the KV grows inside inference mode, so its tensors are inference tensors
    def compact(self, base: int, rows: torch.Tensor) -> None:
        """Move rows (absolute, >= base, increasing; checked by SessionKV.compact) to base, base+1, ..."""
        # rows: [K] int64 on the cache's device
        end = base + rows.shape[0]
        self.keys[:, base:end] = self.keys[:, rows]  # advanced indexing copies first: overlaps are safe
        self.values[:, base:end] = self.values[:, rows]
        self.length = end


class SessionKV:
    """The KV cache of one session across a contiguous range of layers."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int | None = None,
    ):
        """`capacity`: a static cache of that many rows (never reallocated); None: growable from MIN_CAPACITY."""
        self.layers: list[LayerKV] | None = [
            LayerKV(num_kv_heads, head_dim, dtype, capacity or MIN_CAPACITY, device, fixed=capacity is not None)
            for _ in range(num_layers)
        ]

    def _alive(self) -> list[LayerKV]:
        if self.layers is None:
            raise KVCacheError("KV cache used after free")
        return self.layers

    @property
    def length(self) -> int:
        layers = self._alive()
        return layers[0].length if layers else 0

    def layer(self, index: int) -> LayerKV:
        return self._alive()[index]

    def truncate(self, length: int) -> None:
        """Roll back to `length` positions (any depth, any number of times)."""
        if not 0 <= length <= self.length:
            raise KVCacheError(f"cannot truncate a cache of length {self.length} to {length}")
        for layer in self._alive():
            layer.length = length

    def reserve(self, width: int) -> None:
        """Room for `width` rows in every layer, the length unchanged (a native pass writes the rows itself)."""
        for layer in self._alive():
            layer.reserve(width)

    def advance(self, rows: int) -> None:
        """Count `rows` more positions, which a native pass has written into every layer's reserved room."""
        for layer in self._alive():
            if layer.length + rows > layer.capacity:
                raise KVCacheError(f"cannot advance {layer.length} by {rows} rows past a capacity of {layer.capacity}")
            layer.length += rows

    def compact(self, base: int, rows: Sequence[int]) -> None:
        """Keep rows < base and then only `rows` (absolute, each >= base, strictly increasing, < length),
        moved to base, base+1, ...; the length becomes base + len(rows)."""
        length = self.length
        if not 0 <= base <= length:
            raise KVCacheError(f"cannot compact a cache of length {length} from base {base}")
        kept = [int(row) for row in rows]
        if any(row < base or row >= length for row in kept):
            raise KVCacheError(f"rows {kept} outside {base}..{length - 1}")
        if any(a >= b for a, b in zip(kept, kept[1:])):
            raise KVCacheError(f"rows {kept} are not strictly increasing")
        if kept == list(range(base, base + len(kept))):
            self.truncate(base + len(kept))  # already in place (e.g. the tree's first path): no copy
            return
        for layer in self._alive():
            layer.compact(base, torch.tensor(kept, dtype=torch.int64, device=layer.keys.device))

    def fork(self, length: int) -> "SessionKV":
        """An independent copy of the first `length` positions (a speculative branch)."""
        if not 0 <= length <= self.length:
            raise KVCacheError(f"cannot fork {length} positions of a cache of length {self.length}")
        branch = SessionKV.__new__(SessionKV)
        branch.layers = []
        for layer in self._alive():
            copy = LayerKV.__new__(LayerKV)
            copy.fixed = layer.fixed  # a static cache's fork is static too, at the same capacity
            capacity = layer.capacity if layer.fixed else fork_capacity(length)
            copy.keys = layer.keys.new_zeros(layer.keys.shape[0], capacity, layer.keys.shape[2])
            copy.values = layer.values.new_zeros(layer.values.shape[0], capacity, layer.values.shape[2])
            copy.keys[:, :length] = layer.keys[:, :length]
            copy.values[:, :length] = layer.values[:, :length]
            copy.length = length
            branch.layers.append(copy)
        return branch

    def free(self) -> None:
        self.layers = None

    @property
    def is_freed(self) -> bool:
        return self.layers is None

    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self._alive())
