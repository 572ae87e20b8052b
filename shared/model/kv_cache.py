"""Per-session KV caches that grow in place and roll back to any length.

Rollback after a rejected draft is just moving `length` back: the stale rows
stay allocated and are overwritten by the next append, so repeated rollbacks
cost nothing and never copy.
"""

from __future__ import annotations

import torch


class KVCacheError(ValueError):
    """An invalid cache operation (truncate beyond length, use after free)."""


class LayerKV:
    """Keys and values of one attention layer for one session."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int = 64,
        device: torch.device | str = "cpu",
    ):
        # keys/values: [Hkv, capacity, D] on the layer's device; rows >= length are garbage
        self.keys = torch.empty(num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty(num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def _grow(self, needed: int) -> None:
        new_capacity = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], new_capacity, old.shape[2])  # same dtype and device
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


class SessionKV:
    """The KV cache of one session across a contiguous range of layers."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.layers: list[LayerKV] | None = [
            LayerKV(num_kv_heads, head_dim, dtype, device=device) for _ in range(num_layers)
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

    def fork(self, length: int) -> "SessionKV":
        """An independent copy of the first `length` positions (a speculative branch)."""
        if not 0 <= length <= self.length:
            raise KVCacheError(f"cannot fork {length} positions of a cache of length {self.length}")
        branch = SessionKV.__new__(SessionKV)
        branch.layers = []
        for layer in self._alive():
            copy = LayerKV.__new__(LayerKV)
            capacity = max(length + 16, 64)
            copy.keys = layer.keys.new_empty(layer.keys.shape[0], capacity, layer.keys.shape[2])
            copy.values = layer.values.new_empty(layer.values.shape[0], capacity, layer.values.shape[2])
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
