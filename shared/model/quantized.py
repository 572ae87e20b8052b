"""Weight-only quantization in the block formats SmolLM2's GGUF ships: int4 in groups of 32 inputs with an
fp16 scale and min each (Q4_1) for the decoder's projections, int8 in groups of 32 with one scale each (Q8_0) for
the LM head; everything else (embeddings, norms, the residual stream, KV and attention) stays float32.

Blocks from the checkpoint's own values: the f32 SmolLM2 checkpoint is the exact dequantization of the GGUF's
Q4_1 and Q8_0 tensors, and Q4_1's recipe (min and max of each group, scale (max - min) / 15 and min kept as fp16)
and Q8_0's (scale max |w| / 127 as fp16) applied to those values give back the file's own blocks: every
dequantized weight equals the checkpoint's (tests/test_quantized.py checks every tensor). A checkpoint that did
not come from such blocks (the demo model) is quantized by the same recipes, which then lose precision.

Every product takes float32 rows and returns float32; nothing is rounded to bfloat16. Decode on a CPU reads
every weight once per token, so its speed is the bytes it reads: int4 weights are an eighth of fp32's. Where
the C++ extension is built, both products are its own kernels (native/int4_matmul.h, int8_matmul.h): they
quantize each group of 32 inputs to int16 codes with its own scale (max |x| / 32767: an input within 1 / 65534
of its group's largest), so that a group's dot product is an exact integer sum (two 16-bit products per 32-bit
lane), then scale in float32. Elsewhere torch multiplies the float32 rows by the dequantized weights (float32's
speed, the same model). Why int16 and not bfloat16 or 8-bit rows: see ACTIVATIONS.

`quantize_model` replaces the modules in place, so the HF model itself computes with the same weights as every
split submodel: the unsplit reference and the split halves stay one model at one precision.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from shared.model.invariant_attention import use_invariant_attention
from shared.model.native_build import native_module

GROUP = 32  # inputs per scale (and per min at int4): the GGUF blocks' size
INT4_ROW_BLOCK = 64  # the int4 kernels' rows per packed block: a weight's outputs come in whole blocks
# What each quantized product takes its rows in; the C++ kernels then make them int16 per group of 32. Chosen by
# measurement (make bench-engine's quality table against f32, docs/benchmarks/): rows rounded to bfloat16 (the
# AVX512-BF16 kernel of before) changed greedy chat answers against f32's beyond the quality gate; float32 rows
# multiplied as floats pass it, at half the int4 kernel's speed; int16 codes pass it (their error is a few
# hundred times smaller than bfloat16's) at the bfloat16 kernel's speed, the products being exact integer sums.
# 8-bit rows (llama.cpp's Q8) would be coarser than bfloat16.
ACTIVATIONS = torch.float32


class QuantizationError(ValueError):
    """A tensor or a quantization kind that cannot be quantized, or multiplied as quantized weights."""


def _groups(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [out, in] float -> [out, in / GROUP, GROUP] float32, or QuantizationError where it does not fit."""
    if not fits(weight, bits):
        outputs = f"outputs a multiple of {INT4_ROW_BLOCK} and " if bits == 4 else ""
        raise QuantizationError(
            f"int{bits} takes a 2-D float weight with {outputs}inputs a multiple of {GROUP}, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    return weight.detach().float().view(rows, cols // GROUP, GROUP)


def _fp16(values: torch.Tensor, what: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not torch.isfinite(half).all():
        raise QuantizationError(f"a group's {what} is beyond float16's range")
    return half


def fits(weight: torch.Tensor, bits: int) -> bool:
    """Whether the int4 or int8 kernels take this weight (int4's packing wants outputs in whole 64-row blocks)."""
    rows_fit = bits == 8 or weight.shape[0] % INT4_ROW_BLOCK == 0
    return weight.dim() == 2 and weight.is_floating_point() and rows_fit and weight.shape[1] % GROUP == 0


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0: weight [out, in] -> (int8 [out, in], scales [out, in / 32] float32 holding fp16 values), the weight
    being q * scale; the scale of a group is max |w| / 127 in fp16."""
    groups = _groups(weight, 8)
    scales = _fp16(groups.abs().amax(dim=-1) / 127, "scale").float()  # [out, in / 32]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.view(weight.shape), scales


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1: weight [out, in] -> (packed uint8 [out, in / 2] in ATen's CPU int4 layout, scales and mins
    [in / 32, out, 2] fp16), the weight being q * scale + min with q in 0..15; a group's min is its smallest
    weight and its scale (max - min) / 15, both in fp16."""
    groups = _groups(weight, 4)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, in / 32]
    scale, minimum = _fp16((high - low) / 15, "scale"), _fp16(low, "min")
    step = torch.where(scale > 0, scale.float(), torch.ones_like(low))
    codes = torch.round((groups - minimum.float()[..., None]) / step[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(weight.shape).to(torch.int32), 1)
    return packed, torch.stack([scale, minimum], dim=-1).transpose(0, 1).contiguous()


def int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """ATen's packed int4 rows [out, in / 2] -> codes [out, in] uint8 (each 64-row block holds, per input, 32
    bytes: row j in byte j's low nibble, row j + 32 in its high one)."""
    rows, half = packed.shape
    blocks = packed.view(torch.uint8).reshape(rows // INT4_ROW_BLOCK, 2 * half, INT4_ROW_BLOCK // 2)
    both = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [blocks, in, 64]
    return both.transpose(1, 2).reshape(rows, 2 * half)


def dequantize(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] a quantized one stands for: q * scale (int8) or q * scale + min (int4)."""
    if weight.dtype == torch.int8:
        rows, cols = weight.shape
        return (weight.float().view(rows, -1, GROUP) * scales[..., None]).view(rows, cols)
    codes = int4_codes(weight).float()
    rows, cols = codes.shape
    wide = scales.float().transpose(0, 1)  # [out, in / 32, 2]
    return (codes.view(rows, -1, GROUP) * wide[..., :1] + wide[..., 1:]).view(rows, cols)


# (weight, scales) ids -> the dequantized float32 weight, for torch where the C++ kernels are not built: made once,
# dropped with the weight (a tensor cannot key a WeakKeyDictionary: its == is elementwise)
_DENSE: dict[tuple[int, int], torch.Tensor] = {}


def _dense(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    key = (id(weight), id(scales))
    dense = _DENSE.get(key)
    if dense is None:
        dense = _DENSE[key] = dequantize(weight, scales)
        weakref.finalize(weight, _DENSE.pop, key, None)
    return dense


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias): a dense weight, or quantized blocks with their scales (the product summed and
    returned in float32, then in x's dtype)."""
    # x: [..., in], weight: [out, in] -> [..., out]
    if scales is None:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).to(ACTIVATIONS)
    native = native_module() if flat.device.type == "cpu" else None  # native/int8_matmul.h, int4_matmul.h
    if native:
        out = (
            native.int8_matmul(flat, weight, scales)
            if weight.dtype == torch.int8
            else native.int4_matmul(flat, weight, scales)
        )
    else:
        out = F.linear(flat.float(), _dense(weight, scales))
    out = out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


class QuantizedLinear(torch.nn.Module):
    """An nn.Linear whose weight is int8 with a float scale per group of 32 inputs (Q8_0), or packed int4 with an
    fp16 scale and min per group (Q4_1) (buffers: not trainable)."""

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        int8 = (
            weight.dtype == torch.int8
            and weight.dim() == 2
            and scales.dtype == torch.float32
            and scales.shape == (weight.shape[0], weight.shape[1] // GROUP)
            and weight.shape[1] % GROUP == 0
        )
        int4 = (
            weight.dtype == torch.uint8
            and weight.dim() == 2
            and scales.dtype == torch.float16
            and scales.shape == (2 * weight.shape[1] // GROUP, weight.shape[0], 2)
            and weight.shape[0] % INT4_ROW_BLOCK == 0
        )
        if not (int8 or int4):
            raise QuantizationError(
                f"int8 weight [out, in] with float32 scales [out, in / {GROUP}], or packed int4 [out, in / 2] with "
                f"fp16 scales and mins [in / {GROUP}, out, 2] expected, got {weight.dtype} {tuple(weight.shape)} "
                f"and {scales.dtype} {tuple(scales.shape)}"
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
        return cls(*(quantize_q4 if bits == 4 else quantize_q8)(linear.weight), bias)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight this module multiplies by."""
        return dequantize(self.weight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


QUANTIZATIONS = {"int8": 8, "int4": 4}


@torch.no_grad()
def quantize_model(model: torch.nn.Module, kind: str = "int8") -> torch.nn.Module:
    """A *ForCausalLM loaded in float32 -> int8 (Q8_0) or int4 (Q4_1) projections, an int8 (Q8_0) LM head; the rest,
    and any projection whose shape the kernels do not take, stays float32."""
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
            # one kind per block, so its projections still fuse (fused.py): int8 where int4 cannot pack a shape
            widths = [
                bits for bits in (QUANTIZATIONS[kind], 8) if all(fits(lin.weight, bits) for lin in linears.values())
            ]
            for name, linear in linears.items():
                if widths:
                    setattr(parent, name, QuantizedLinear.from_linear(linear, widths[0]))
    head = model.lm_head
    if isinstance(head, torch.nn.Linear) and fits(head.weight, 8):
        # a tied head keeps the embeddings (float32, looked up) and gets its own int8 copy to multiply
        model.lm_head = QuantizedLinear.from_linear(head)
    # the quantized kernels sum in their own fixed order whatever the batch; with batch-invariant attention too,
    # decoding one row per pass and verifying many give the same bits, so the same tokens
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
