"""Decoder layers over a packed batch of sessions, each with its own KV: the one model runner.

The verifier, its pipeline stages, the device's layers and the unsplit benches all run their
layer ranges through `run_layers`: per pass it plans positions, rotary tables and the
attention layout once (`PassPlan`), then runs each layer with its projections fused (q/k/v and
gate/up, `fused_layer`), in the checkpoint's precision (fp32, bf16, or int8 weights).

An int4/int8 pass on the CPU runs the same operations in C++ where that was built (`native_layers.py`:
the same bits, without the Python between the kernels); this file stays its reference and fallback.

The HF modules supply the norms, the activation and the rotary embedding, so any Llama-family
checkpoint works; this file owns the order of operations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shared.model.attention import AttentionWeights, PassPlan, attention
from shared.model.fused import fused_layer
from shared.model.invariant_attention import uses_invariant_attention
from shared.model.kv_cache import LayerKV, SessionKV
from shared.model.native_layers import run_native
from shared.model.tree_rows import TreeRows


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm in one kernel, bit for bit: normalised in float32, rounded to x's dtype, then scaled."""
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], None, norm.variance_epsilon).to(x.dtype)


def decoder_layer_forward(
    layer: Any,  # an HF decoder layer: its norms and mlp.act_fn are used as they are
    hidden: torch.Tensor,
    layer_caches: Sequence[LayerKV],
    plan: PassPlan,
) -> torch.Tensor:
    # hidden: [T, H]
    return layer_with_attention(layer, hidden, lambda weights, x: attention(weights, x, layer_caches, plan))


def layer_with_attention(
    layer: Any, hidden: torch.Tensor, attend: Callable[[AttentionWeights, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """One decoder layer whose attention is `attend(weights, normed [T, H]) -> [T, H]` (the packed pass's,
    or a static-shape pass's: shared/model/static_pass.py); norms and MLP as they are."""
    # hidden: [T, H]
    fused = fused_layer(layer)
    normed = rms_norm(layer.input_layernorm, hidden)
    hidden = hidden + attend(fused.attention, normed)
    gate, up = fused.gate_up(rms_norm(layer.post_attention_layernorm, hidden)).chunk(2, dim=-1)  # [T, I] each
    return hidden + fused.down(layer.mlp.act_fn(gate) * up)


def run_layers(
    layers: Iterable[torch.nn.Module],
    rotary_emb: torch.nn.Module,
    hidden: torch.Tensor,
    caches: Sequence[SessionKV],
    lengths: Sequence[int],
    trees: Sequence[TreeRows | None] | None = None,
) -> torch.Tensor:
    """Run a contiguous range of decoder layers over packed sessions (trees[i]: session i's tree rows, or None)."""
    # hidden: [T, H]; sum(lengths) == T
    layers = list(layers)
    plan = PassPlan.build(rotary_emb, hidden, caches, lengths, trees, invariant=uses_invariant_attention(layers))
    native = run_native(layers, plan, hidden, caches)  # the same bits, in C++, where it is built and applies
    if native is not None:
        return native
    for index, layer in enumerate(layers):
        hidden = decoder_layer_forward(layer, hidden, [c.layer(index) for c in caches], plan)
    return hidden
