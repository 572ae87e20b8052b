"""Weight-only int8: every decoder projection and the LM head stored as int8 with one scale per
output channel; everything else (embeddings, norms, the residual stream, KV and attention) stays
float32, and each matmul's input is rounded to bfloat16 on its way in.

Decode on a CPU reads every weight once per token, so its speed is the bytes it reads: int8
weights are a quarter of fp32's. torch's own `_weight_int8pack_mm` (the kernel gpt-fast uses)
multiplies bfloat16 activations by int8 rows and their scales without dequantizing a copy (its
float32-input path is ten times slower). Keeping the rest in float32 is also the faster choice on
this CPU: a one-row attention is 17 us in float32 against 94 us in bfloat16 (make bench-engine).

`quantize_model` replaces the modules in place, so the HF model itself computes with the same
int8 weights as every split submodel: the unsplit reference and the split halves stay one
model at one precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MATMUL_DTYPE = torch.bfloat16  # what each int8 matmul takes its input in (and keeps its scales in)


class Int8Error(ValueError):
    """A tensor that cannot be quantized or multiplied as int8 weights."""


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight [out, in] float -> (int8 [out, in], scales [out] float32)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise Int8Error(f"int8 quantization takes a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    wide = weight.detach().float()
    scales = wide.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
    quantized = torch.round(wide / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias): a dense weight, or int8 rows with their scales (x rounded to the scales'
    dtype for the product, which comes back in x's dtype)."""
    # x: [..., in], weight: [out, in] -> [..., out]
    if scales is None:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).to(scales.dtype)
    out = torch._weight_int8pack_mm(flat, weight, scales).view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    return out if bias is None else out + bias


class Int8Linear(torch.nn.Module):
    """An nn.Linear whose weight is int8 rows with per-row scales (buffers: not trainable)."""

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.int8 or scales.shape != weight.shape[:1]:
            raise Int8Error(
                f"int8 weight [out, in] and scales [out] expected, got {weight.dtype} "
                f"{tuple(weight.shape)} and {tuple(scales.shape)}"
            )
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Int8Linear":
        weight, scales = quantize_rows(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scales.to(MATMUL_DTYPE), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def quantize_model(model: torch.nn.Module) -> torch.nn.Module:
    """A *ForCausalLM loaded in float32 -> int8 projections and LM head; everything else stays float32."""
    decoder: torch.nn.Module = model.model  # type: ignore[assignment]
    for layer in decoder.layers:  # type: ignore[union-attr]
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                linear = getattr(parent, name, None)
                if isinstance(linear, torch.nn.Linear):
                    setattr(parent, name, Int8Linear.from_linear(linear))
    head = model.lm_head
    if isinstance(head, torch.nn.Linear):
        # a tied head keeps the embeddings (float32, looked up) and gets its own int8 copy to multiply
        model.lm_head = Int8Linear.from_linear(head)
    return model


@torch.no_grad()
def dequantize_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Every Int8Linear inside `module` back to a dense float32 nn.Linear (a trainable copy, such as a draft
    adapter initialised from an int8 layer, must be dense)."""
    for name, child in list(module.named_children()):
        if isinstance(child, Int8Linear):
            dense = torch.nn.Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                dtype=child.scales.dtype,
                device=child.weight.device,
            )
            dense.weight.copy_(child.weight.to(child.scales.dtype) * child.scales[:, None])
            if child.bias is not None:
                dense.bias.copy_(child.bias)
            setattr(module, name, dense)
        else:
            dequantize_linears(child)
    return module


def is_quantized(model: torch.nn.Module) -> bool:
    return isinstance(model.lm_head, Int8Linear)
