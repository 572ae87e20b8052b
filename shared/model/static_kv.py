"""The static KV layout: one preallocated pool per layer range, one fixed slot per session.

Why: a CUDA graph replays kernels on the addresses it was captured with, so a pass that should be captured
once and replayed for any sessions must read their KV from tensors that never move, and find each
session's rows by index (a slot number, a position) rather than by address. The growable caches of
kv_cache.py reallocate as they double; these never do.

Per layer the pool holds keys and values [slots + 1, Hkv, capacity, D]: a session's cache (`SlotKV`) is a
`SessionKV` whose layers are views of one slot, so every eager path (attention.py, invariant_attention.py,
the C++ layers, rollback, tree compaction) runs on it unchanged and computes the same bits as on a growable
cache. The last slot is scratch: the padding rows of a static-shape pass write there (static_pass.py).

The pool is allocated empty (on the CPU its pages are committed only when written) and a slot is zeroed
when a session takes it: rows past a cache's length must be finite (batch-invariant attention weights them
by exactly 0), and a slot must not show its last session's keys to the next.

Memory: a session holds its whole slot (capacity rows in every layer) from open to close, so whoever
admits sessions charges that, not the positions reached (services/verifier_cloud/budgets.py). With no slot
left, `acquire` raises `KVSlotsExhausted`.
"""

from __future__ import annotations

import threading

import torch

from shared.model.invariant_attention import padded_length
from shared.model.kv_cache import KVCacheError, LayerKV, SessionKV
from shared.model.split import LayerRange


class KVSlotsExhausted(KVCacheError):
    """Every slot of a static pool is held."""


def static_capacity(context_length: int) -> int:
    """Rows of one slot for a verifier of `context_length` positions: batch-invariant attention reads a
    cache up to the next multiple of its CHUNK, so that many (the padded rows stay zeros or stale)."""
    return padded_length(context_length)


class SlotKV(SessionKV):
    """A session's KV in one slot of a `StaticKVPool`: freeing it gives the slot back."""

    def __init__(self, pool: "StaticKVPool", slot: int):
        self.pool, self.slot = pool, slot
        self.layers = []
        for keys, values in zip(pool.keys, pool.values):
            layer = LayerKV.__new__(LayerKV)
            layer.fixed, layer.length = True, 0
            layer.keys, layer.values = keys[slot], values[slot]  # [Hkv, capacity, D] views: never reallocated
            self.layers.append(layer)

    @torch.inference_mode()  # the pool's tensors are inference tensors
    def fork(self, length: int) -> "SlotKV":
        """A copy of the first `length` positions in a slot of its own (raises KVSlotsExhausted)."""
        if not 0 <= length <= self.length:
            raise KVCacheError(f"cannot fork {length} positions of a cache of length {self.length}")
        branch = self.pool.acquire()
        for own, copy in zip(self._alive(), branch._alive()):
            copy.keys[:, :length] = own.keys[:, :length]
            copy.values[:, :length] = own.values[:, :length]
            copy.length = length
        return branch

    def free(self) -> None:
        if self.layers is not None:
            self.layers = None
            self.pool.release(self.slot)


class StaticKVPool:
    """`slots` sessions' KV for `num_layers` layers, `capacity` rows each, allocated once."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int,
        slots: int,
    ):
        if slots < 1 or capacity < 1:
            raise ValueError(f"a static KV pool needs at least one slot and one row, got {slots} x {capacity}")
        self.capacity, self.slots = capacity, slots
        self.scratch = slots  # the padding rows' slot (static_pass.py); never handed to a session
        shape = (slots + 1, num_kv_heads, capacity, head_dim)
        # Zeros, not torch.empty: every row a pass may read beyond a session's length (padding, the scratch slot)
        # is a finite number, never leftover memory that could hold a NaN; the pool is preallocated anyway.
        with torch.inference_mode():  # as the growable caches are: inference tensors, written in inference mode
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._lock = threading.Lock()  # sessions open and close on the event loop and in worker threads

    @classmethod
    def for_layers(cls, layers: LayerRange, capacity: int, slots: int) -> "StaticKVPool":
        """A pool for a LayerRange's layers (their KV shape, dtype and device)."""
        return cls(
            len(layers.layers), layers.num_kv_heads, layers.head_dim, layers.dtype, layers.device, capacity, slots
        )

    @staticmethod
    def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int) -> int:
        """Bytes one slot takes: keys and values of `capacity` rows in every layer."""
        return 2 * num_layers * num_kv_heads * capacity * head_dim * dtype.itemsize

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def _zero(self, slot: int) -> None:
        with torch.inference_mode():
            for keys, values in zip(self.keys, self.values):
                keys[slot].zero_()
                values[slot].zero_()

    def acquire(self) -> SlotKV:
        """A zeroed slot for a new session (raises KVSlotsExhausted)."""
        with self._lock:
            if not self._free:
                raise KVSlotsExhausted(f"all {self.slots} static KV slots of {self.capacity} positions are held")
            slot = self._free.pop()
        self._zero(slot)
        return SlotKV(self, slot)

    def release(self, slot: int) -> None:
        with self._lock:
            if slot in self._free or not 0 <= slot < self.slots:
                raise KVCacheError(f"static KV slot {slot} released twice or never held")
            self._free.append(slot)
