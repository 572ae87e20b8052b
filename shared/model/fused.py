"""Each decoder layer's projections fused once: q/k/v as one matmul, gate/up as another.

A decode step of one row is a chain of small matmuls; fusing them reads the same bytes in
fewer calls (7 per layer become 4). The fused weight is one new tensor and the HF modules'
own weights become views of it, so nothing is held twice and the HF model (the unsplit
reference) computes with exactly the same numbers. Dense and int8 weights fuse alike.

`fused_layer` caches the result per layer and rebuilds it when the layer's weights are no
longer views of it (the module was moved to another device, or its weights were replaced).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.model.attention import AttentionWeights
from shared.model.quantized import QuantizedLinear, project


class FusionError(ValueError):
    """Projections that cannot share one matmul (different kinds, inputs, dtypes or devices)."""


@dataclass(frozen=True, eq=False)
class Projection:
    """y = x @ weight.T (+ bias), the weight dense or quantized blocks with their scales."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None  # [out]
    scales: torch.Tensor | None = None  # int8: [out, in / 32]; int4: [in / 32, out, 2]; dense: None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.scales)


def _parts(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if isinstance(linear, QuantizedLinear):
        return linear.weight, linear.bias, linear.scales
    if isinstance(linear, torch.nn.Linear):
        return linear.weight, linear.bias, None
    raise FusionError(f"cannot fuse a {type(linear).__name__}: an nn.Linear or QuantizedLinear is expected")


def _rebind(linear: Any, weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor | None) -> None:
    """Point a module's tensors at slices of the fused ones (same values, no copy kept)."""
    if isinstance(linear, QuantizedLinear):
        assert scales is not None  # int8 weights fuse with their scales
        linear.weight, linear.scales = weight, scales  # buffers: plain assignment keeps them registered
        if bias is not None:
            linear.bias = bias
        return
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)


@torch.no_grad()
def fuse(linears: Sequence[Any]) -> Projection:
    """One projection computing the outputs of `linears` side by side; their modules become views of it."""
    parts = [_parts(linear) for linear in linears]
    weights = [weight for weight, _, _ in parts]
    kinds = {(w.dtype, w.device, w.shape[1], scales is not None) for w, _, scales in parts}
    if len(kinds) != 1:
        raise FusionError(f"projections differ in dtype, device, input size or kind: {sorted(map(str, kinds))}")
    if len(linears) == 1:
        return Projection(*parts[0])
    sizes = [weight.shape[0] for weight in weights]
    weight = torch.cat(weights)  # [sum(out), in]
    quantized = parts[0][2] is not None
    # int8 scales are [out, groups]; int4's scales and mins [groups, out, 2]: both join along their out axis
    out_axis = 1 if weight.dtype == torch.uint8 else 0
    scales = torch.cat([s for _, _, s in parts], dim=out_axis) if quantized else None  # type: ignore[misc]
    biases = [b for _, b, _ in parts if b is not None]
    bias = (  # a projection without a bias contributes zeros, in the others' dtype
        torch.cat([b if b is not None else biases[0].new_zeros(n) for (_, b, _), n in zip(parts, sizes)])
        if biases
        else None
    )
    start = 0
    for linear, (_, own_bias, _), size in zip(linears, parts, sizes):
        stop = start + size
        own_scales = None
        if scales is not None:  # int4's per-module slice would not be contiguous: each module keeps its own
            own_scales = scales[start:stop] if out_axis == 0 else linear.scales
        _rebind(
            linear,
            weight[start:stop],
            bias[start:stop] if bias is not None and own_bias is not None else None,
            own_scales,
        )
        start = stop
    return Projection(weight, bias, scales)


@dataclass(frozen=True, eq=False)
class FusedLayer:
    """One decoder layer as the runner computes it (norms and activation stay the HF modules')."""

    layer: Any  # the HF decoder layer: input_layernorm, post_attention_layernorm, mlp.act_fn
    qkv: Projection  # [T, H] -> [T, (Hq + 2 Hkv) D]
    o: Projection
    gate_up: Projection  # [T, H] -> [T, 2 I]
    down: Projection
    q_size: int  # Hq * D
    kv_size: int  # Hkv * D
    head_dim: int
    scaling: float

    attention: AttentionWeights = field(init=False, repr=False)  # the fused q/k/v split per head group

    def __post_init__(self) -> None:
        sizes = [self.q_size + self.kv_size, self.kv_size]

        def project_qkv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qk, v = self.qkv(x).split(sizes, dim=-1)
            return qk, v

        weights = AttentionWeights(project_qkv, self.o, self.q_size // self.head_dim, self.head_dim, self.scaling)
        object.__setattr__(self, "attention", weights)

    def weight_addresses(self) -> list[int]:
        """The fused weights' addresses in is_current's order (q/k/v, gate/up, o, down): what the HF modules'
        q_proj, gate_proj, o_proj and down_proj weights start at while the fusion is current."""
        return [projection.weight.data_ptr() for projection in (self.qkv, self.gate_up, self.o, self.down)]

    def is_current(self) -> bool:
        """Whether the HF modules still compute with this fusion's tensors (checked on every pass: it reads
        the modules' own dicts, as nn.Module.__getattr__ would, without its cost of about 1.5 us a lookup)."""
        attn, mlp = _member(self.layer, "self_attn"), _member(self.layer, "mlp")
        return (
            _member(_member(attn, "q_proj"), "weight").data_ptr() == self.qkv.weight.data_ptr()
            and _member(_member(mlp, "gate_proj"), "weight").data_ptr() == self.gate_up.weight.data_ptr()
            and _member(_member(attn, "o_proj"), "weight").data_ptr() == self.o.weight.data_ptr()
            and _member(_member(mlp, "down_proj"), "weight").data_ptr() == self.down.weight.data_ptr()
        )


def _member(module: Any, name: str) -> Any:
    """module.<name> for a submodule, parameter or buffer: the dicts nn.Module.__getattr__ searches, in its
    order, after the instance's own attributes."""
    members = module.__dict__
    found = members.get(name)
    if found is None:
        found = members["_parameters"].get(name)
    if found is None:
        found = members["_buffers"].get(name)
    if found is None:
        found = members["_modules"].get(name)
    return found if found is not None else getattr(module, name)  # else (a property): the ordinary lookup


_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, FusedLayer] = weakref.WeakKeyDictionary()


def fused_layer(layer: Any) -> FusedLayer:
    """The layer's fused projections, made on first use (and again if its weights moved)."""
    cached = _FUSED.get(layer)
    if cached is not None and cached.is_current():
        return cached
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    q_size = attn.q_proj.weight.shape[0]
    fused = FusedLayer(
        layer=layer,
        qkv=qkv,
        o=fuse([attn.o_proj]),
        gate_up=fuse([mlp.gate_proj, mlp.up_proj]),
        down=fuse([mlp.down_proj]),
        q_size=q_size,
        kv_size=attn.k_proj.weight.shape[0],
        head_dim=head_dim,
        scaling=attn.scaling,
    )
    _FUSED[layer] = fused
    return fused
