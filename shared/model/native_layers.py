"""The runner's quantized decoder layers in C++ (shared/model/native/layers.cpp), where it is built.

At int4 a decode token is about half matmul and half small operations, each paying 2-3 us of Python
and dispatch between the kernels. The C++ file keeps ATen's calls where the result depends on the kernel
(matmuls, reductions, softmax, SiLU) and runs the elementwise steps between them as loops of the same
float operations, so its results are the bits of layers.py / attention.py / invariant_attention.py
(tests check it); the interpreter and most dispatches between the kernels go.

It covers what decode and verification run: packed sessions' causal rows and draft-tree rows through
int4/int8 layers with batch-invariant attention, on the CPU in float32. Dense weights and other
devices stay on the Python runner, which is also the fallback where the extension was not built
(`make install` builds it, as does the cpu image's build stage for its build host's CPU).

native_build.py builds and loads the extension.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from shared.model.attention import PassPlan
from shared.model.fused import FusedLayer, Projection, fused_layer
from shared.model.kv_cache import SessionKV
from shared.model.native_build import native_module
from shared.model.quantized import QuantizedLinear

_disabled = 0  # python_runner() depth


@contextlib.contextmanager
def python_runner() -> Iterator[None]:
    """Within it, every pass runs on the Python runner (benches compare the two side by side)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


_HANDLES: weakref.WeakKeyDictionary[FusedLayer, Any | None] = weakref.WeakKeyDictionary()
_UNKNOWN = object()


def _projection_parts(projection: Projection) -> list[torch.Tensor | None]:
    return [projection.weight, projection.scales, projection.bias]


def _is_silu(act_fn: Any) -> bool:
    """Whether the layer's activation computes F.silu's bits (the C++ file calls at::silu): nn.SiLU and
    transformers' own SiLU module both do; a probe tells, whatever the class."""
    probe = torch.linspace(-8, 8, 257)
    with torch.no_grad():
        return bool(torch.equal(act_fn(probe), torch.nn.functional.silu(probe)))


def native_layer(module: ModuleType, layer: Any) -> Any | None:
    """The C++ handle of one decoder layer, or None if it is not one the C++ file computes."""
    fused = fused_layer(layer)
    known = _HANDLES.get(fused, _UNKNOWN)
    if known is not _UNKNOWN:
        return known  # a handle, or None: a layer found unfit once is not probed again
    projections = (fused.qkv, fused.o, fused.gate_up, fused.down)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        any(p.scales is None or p.weight.device.type != "cpu" for p in projections)
        or not _is_silu(layer.mlp.act_fn)
        or any(getattr(norm, "variance_epsilon", None) is None for norm in norms)
    ):
        _HANDLES[fused] = None
        return None
    handle = module.Layer(
        norms[0].weight,
        float(norms[0].variance_epsilon),
        norms[1].weight,
        float(norms[1].variance_epsilon),
        [part for p in projections for part in _projection_parts(p)],
        fused.q_size // fused.head_dim,
        fused.kv_size // fused.head_dim,
        fused.head_dim,
        float(fused.scaling),
    )
    _HANDLES[fused] = handle
    return handle


@dataclass(frozen=True)
class _RangeHandles:
    """A layer range's C++ handles (None: a layer the C++ file does not compute) and the weights they were made
    from: each layer's FusedLayer.weight_addresses (the order weights_at checks them in)."""

    handles: list[Any] | None
    addresses: list[int]


# per first layer (weakly, so a model's entries go with it), per layer range (their ids)
_RANGES: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, ...], _RangeHandles]] = weakref.WeakKeyDictionary()


def range_handles(module: ModuleType, layers: Sequence[torch.nn.Module]) -> list[Any] | None:
    """The C++ handles of a layer range, or None if a layer is not one the C++ file computes. Made once and
    reused while every layer's weights are still the ones fused (checked in one C++ call per pass: the same
    check as FusedLayer.is_current, which costs a cold decode step about 0.3 ms in Python)."""
    if not layers:
        return []
    key = tuple(map(id, layers))
    known = _RANGES.get(layers[0], {}).get(key)
    if known is not None and module.weights_at(layers, known.addresses):
        return known.handles
    handles = [native_layer(module, layer) for layer in layers]
    # native_layer's own fusions, cached: made or checked just now
    addresses = [address for layer in layers for address in fused_layer(layer).weight_addresses()]
    made = _RangeHandles(None if any(handle is None for handle in handles) else handles, addresses)
    _RANGES.setdefault(layers[0], {})[key] = made
    return made.handles


def run_native(
    layers: Sequence[torch.nn.Module], plan: PassPlan, hidden: torch.Tensor, caches: Sequence[SessionKV]
) -> torch.Tensor | None:
    """The pass on the C++ layers, or None where they do not apply (the caller runs the Python runner)."""
    # hidden: [T, H]
    module = None if _disabled else native_module()
    invariant = plan.invariant
    if module is None or invariant is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu":
        return None
    if any(cache.layer(0).keys.dtype != torch.float32 for cache in caches if layers):
        return None
    handles = range_handles(module, layers)
    if handles is None:
        return None
    sessions = []
    for layout, cache, past, (start, stop) in zip(invariant.layouts, caches, plan.pasts, invariant.bounds):
        blocks = layout.blocks
        if blocks:  # a chain's blocks read up to their padded width; tree rows gather rows below the new length
            cache.reserve(past + layout.rows if layout.tails is not None else max(past + layout.rows, blocks[-1].width))
        sessions.append(
            module.SessionRows(
                start,
                stop,
                past,
                [block.bias for block in blocks],
                [block.start for block in blocks],
                [block.stop for block in blocks],
                [block.width for block in blocks],
                layout.shared,
                layout.tails,
            )
        )
    count = len(layers)
    keys = [cache.layer(index).keys for index in range(count) for cache in caches]
    values = [cache.layer(index).values for index in range(count) for cache in caches]
    out = module.run_layers(handles, hidden, keys, values, sessions, plan.cos, plan.sin)
    for cache, n in zip(caches, plan.lengths):
        cache.advance(n)
    return out


# per LM head (weakly): the norm and weight a probe found the C++ head to compute bit for bit, or found it not to
_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Module, torch.Tensor, bool]] = (
    weakref.WeakKeyDictionary()
)


def run_native_head(norm: torch.nn.Module, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """split.OutputSubmodel's pass (final norm, int8 LM head, float logits) in C++, or None where it does not
    apply: the C++ file assumes an HF RMSNorm, so one probe row per norm and head checks it gives their bits."""
    # hidden: [T, H] -> logits [T, V] float
    module = None if _disabled else native_module()
    if module is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu" or hidden.dim() != 2:
        return None
    if not isinstance(lm_head, QuantizedLinear) or lm_head.bits != 8 or lm_head.bias is not None:
        return None
    gain, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(gain, torch.Tensor) or gain.dtype != torch.float32 or eps is None:
        return None
    known = _HEADS.get(lm_head)
    if known is None or known[0] is not norm or known[1] is not lm_head.weight:
        probe = torch.randn(2, hidden.shape[1], generator=torch.Generator().manual_seed(0))
        native = module.head_forward(probe, gain, float(eps), lm_head.weight, lm_head.scales)
        known = (norm, lm_head.weight, bool(torch.equal(native, lm_head(norm(probe)).float())))
        _HEADS[lm_head] = known
    return module.head_forward(hidden, gain, float(eps), lm_head.weight, lm_head.scales) if known[2] else None
