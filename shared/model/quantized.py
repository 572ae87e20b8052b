"""Weight-only quantization: int8 (one scale per output row) or int4 (groups of 32 inputs, a scale
and a zero each) for the decoder's projections, int8 for the LM head; everything else (embeddings,
norms, the residual stream, KV and attention) stays float32, and each matmul's input is rounded to
bfloat16 on its way in.

Decode on a CPU reads every weight once per token, so its speed is the bytes it reads: int8
weights are a quarter of fp32's, int4 an eighth. torch's own `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` (the kernels gpt-fast uses) multiply bfloat16 activations by the
packed rows without dequantizing a copy (int8's float32-input path is ten times slower); where the
C++ extension is built, both use its own kernels instead (native/int8_matmul.h, int4_matmul.h: the same
rounding of input and output, their own fixed order of sums, faster from memory). SmolLM2's
decoder weights come from a Q4_1 GGUF (groups of 32, 16 levels each), so int4 in groups of 32
holds them almost exactly; its embeddings are finer, so the head stays int8. Keeping the rest in
float32 is also the faster choice on this CPU: a one-row attention is 17 us in float32 against 94 us
in bfloat16.

`quantize_model` replaces the modules in place, so the HF model itself computes with the same
int8 weights as every split submodel: the unsplit reference and the split halves stay one
model at one precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.model.invariant_attention import use_invariant_attention
from shared.model.native_build import native_module

MATMUL_DTYPE = torch.bfloat16  # what each quantized matmul takes its input in (and keeps its scales in)
INT4_GROUP = 32  # inputs per int4 scale and zero


class QuantizationError(ValueError):
    """A tensor or a quantization kind that cannot be quantized, or multiplied as quantized weights."""


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight [out, in] float -> (int8 [out, in], scales [out] float32)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationError(f"int8 quantization takes a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    wide = weight.detach().float()
    scales = wide.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
    quantized = torch.round(wide / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


def fits_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
    """Whether the int4 kernel takes this weight (its packing wants outputs in 16s, inputs in groups)."""
    return (
        weight.dim() == 2 and weight.is_floating_point() and weight.shape[0] % 16 == 0 and weight.shape[1] % group == 0
    )


def quantize_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs: weight [out, in] -> (packed uint8 [out, in / 2], scales
    and zeros [in / group, out, 2] bfloat16), dequantized as (q - 8) * scale + zero."""
    if not fits_int4(weight, group):
        raise QuantizationError(
            f"int4 takes a 2-D float weight with outputs a multiple of 16 and inputs of {group}, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    groups = weight.detach().float().view(rows, cols // group, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, in / group]
    scale = ((high - low) / 15).clamp(min=1e-8).to(MATMUL_DTYPE)
    zero = (low + 8 * scale.float()).to(MATMUL_DTYPE)  # rounded first: the codes are chosen against what is kept
    codes = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(rows, cols).to(torch.int32), 1)
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias): a dense weight, or int8 rows with their scales (x rounded to the scales'
    dtype for the product, which comes back in x's dtype)."""
    # x: [..., in], weight: [out, in] -> [..., out]
    if scales is None:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    native = native_module() if flat.device.type == "cpu" else None  # native/int8_matmul.h, int4_matmul.h
    if native:  # they round the input to bfloat16 themselves
        out = (
            native.int8_matmul(flat, weight, scales)
            if weight.dtype == torch.int8
            else native.int4_matmul(flat, weight, scales)
        )
    elif weight.dtype == torch.int8:
        out = torch._weight_int8pack_mm(flat.to(scales.dtype), weight, scales)
    else:  # int4: scales [in / group, out, 2]
        groups = scales.shape[0]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(scales.dtype), weight, x.shape[-1] // groups, scales)
    out = out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
    return out if bias is None else out + bias


class QuantizedLinear(torch.nn.Module):
    """An nn.Linear whose weight is int8 rows with per-row scales, or packed int4 rows with per-group
    scales and zeros (buffers: not trainable)."""

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        int8 = weight.dtype == torch.int8 and scales.shape == weight.shape[:1]
        int4 = weight.dtype == torch.uint8 and scales.dim() == 3 and scales.shape[1:] == (weight.shape[0], 2)
        if not (int8 or int4):
            raise QuantizationError(
                f"int8 weight [out, in] with scales [out], or packed int4 [out, in / 2] with scales "
                f"[groups, out, 2] expected, got {weight.dtype} {tuple(weight.shape)} and {tuple(scales.shape)}"
            )
        self.in_features = weight.shape[1] * (1 if int8 else 2)
        self.out_features = weight.shape[0]
        self.bits = 8 if int8 else 4
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, bits: int = 8) -> "QuantizedLinear":
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if bits == 4:
            return cls(*quantize_groups(linear.weight), bias)
        weight, scales = quantize_rows(linear.weight)
        return cls(weight, scales.to(MATMUL_DTYPE), bias)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight this module multiplies by."""
        if self.bits == 8:
            return self.weight.float() * self.scales.float()[:, None]
        eye = torch.eye(self.in_features, dtype=self.scales.dtype)
        return project(eye, self.weight, None, self.scales).float().T  # each input's column, through the kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


QUANTIZATIONS = {"int8": 8, "int4": 4}


@torch.no_grad()
def quantize_model(model: torch.nn.Module, kind: str = "int8") -> torch.nn.Module:
    """A *ForCausalLM loaded in float32 -> int8 or int4 projections, an int8 LM head; the rest stays float32."""
    if kind not in QUANTIZATIONS:
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    decoder: torch.nn.Module = model.model  # type: ignore[assignment]
    for layer in decoder.layers:  # type: ignore[union-attr]
        for parent in (layer.self_attn, layer.mlp):
            linears = {
                name: getattr(parent, name)
                for name in PROJECTIONS
                if isinstance(getattr(parent, name, None), torch.nn.Linear)
            }
            # one width per block, so its projections still fuse (fused.py): int8 where int4 cannot pack a shape
            fits = all(fits_int4(linear.weight) for linear in linears.values())
            bits = QUANTIZATIONS[kind] if fits else 8
            for name, linear in linears.items():
                setattr(parent, name, QuantizedLinear.from_linear(linear, bits))
    head = model.lm_head
    if isinstance(head, torch.nn.Linear):
        # a tied head keeps the embeddings (float32, looked up) and gets its own int8 copy to multiply
        model.lm_head = QuantizedLinear.from_linear(head)
    # bfloat16 inputs make every quantized matmul magnify attention's batch-shape-dependent last bits; with
    # batch-invariant attention, decoding one row per pass and verifying many give the same tokens
    use_invariant_attention(model)
    return model


@torch.no_grad()
def dequantize_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Every QuantizedLinear inside `module` back to a dense float32 nn.Linear (a trainable copy, such as a draft
    adapter initialised from an int8 layer, must be dense)."""
    for name, child in list(module.named_children()):
        if isinstance(child, QuantizedLinear):
            dense = torch.nn.Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                dtype=torch.float32,
                device=child.weight.device,
            )
            dense.weight.copy_(child.dequantized())
            if child.bias is not None:
                dense.bias.copy_(child.bias)
            setattr(module, name, dense)
        else:
            dequantize_linears(child)
    return module


def is_quantized(model: torch.nn.Module) -> bool:
    return isinstance(model.lm_head, QuantizedLinear)
