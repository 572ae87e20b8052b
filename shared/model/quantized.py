"""Weight-only quantization in the block formats SmolLM2's GGUF ships, in groups of 32 inputs with a scale and a
min each: int4 (Q4_1: codes 0..15, fp16 scale and min) for the decoder's projections and int8 for the LM head
(Q8_0: codes -127..127, fp16 scale, min 0); `int8` puts the projections in int8 too, each group on the 4-bit grid
it already lies on where it does (a Q4_1 block's) and Q8_0's elsewhere. Everything else (embeddings, norms, the
residual stream, KV and attention) stays float32.

Blocks from the checkpoint's own values: the f32 SmolLM2 checkpoint is the exact dequantization of the GGUF's
Q4_1 and Q8_0 tensors, and Q4_1's recipe (min and max of each group, scale (max - min) / 15 and min kept as fp16)
and Q8_0's (scale max |w| / 127 as fp16) applied to those values give back the file's own blocks: every
dequantized weight equals the checkpoint's (tests/shared/model/test_gguf_blocks.py checks every tensor against
the file). A checkpoint that did not come from such blocks (the demo model) is quantized by the same recipes, which then
lose precision.

Every product takes float32 rows and returns float32; nothing is rounded to bfloat16. Decode on a CPU reads
every weight once per token, so its speed is the bytes it reads: int4 weights are an eighth of fp32's. Each
product makes each group of 32 inputs int16 codes with its own scale (max |x| / 32767: an input within 1 / 65534
of its group's largest), so that a group's dot product is an exact integer sum, then scales in float32. Where
the C++ extension is built the products are its kernels (native/int4_matmul.h, int8_matmul.h: two 16-bit
products per 32-bit lane); elsewhere `torch_product` computes the same sums with torch ops (slower). Why int16
rows and not bfloat16 or 8-bit ones: see ACTIVATIONS.

`quantize_model` replaces the modules in place, so the HF model itself computes with the same weights as every
split submodel: the unsplit reference and the split halves stay one model at one precision.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from shared.model.invariant_attention import use_invariant_attention
from shared.model.native_build import native_module

GROUP = 32  # inputs per scale and min: the GGUF blocks' size
LEVELS = 32767.0  # the largest |code| of an activation row's int16 codes (native/int16_rows.h)
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


def _q4_1(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1's recipe on groups [out, G, 32] -> (codes 0..15 float, scales fp16 [out, G], mins fp16 [out, G])."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale, minimum = _fp16((high - low) / 15, "scale"), _fp16(low, "min")
    step = torch.where(scale > 0, scale.float(), torch.ones_like(low))
    codes = torch.round((groups - minimum.float()[..., None]) / step[..., None]).clamp(0, 15)
    return codes, scale, minimum


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 groups: weight [out, in] -> (int8 [out, in], scales and mins [out, in / 32, 2] float32 holding fp16
    values), the weight being q * scale + min. A group whose weights lie on a 4-bit grid (a GGUF's Q4_1 block)
    keeps that grid exactly (codes 0..15, its scale and min); any other is Q8_0 (scale max |w| / 127, min 0)."""
    groups = _groups(weight, 8)
    grid_codes, grid_scale, grid_min = _q4_1(groups)
    on_grid = (grid_codes * grid_scale.float()[..., None] + grid_min.float()[..., None] == groups).all(dim=-1)
    scale = _fp16(groups.abs().amax(dim=-1) / 127, "scale").float()  # [out, in / 32]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / safe[..., None]).clamp(-127, 127)
    codes = torch.where(on_grid[..., None], grid_codes, codes).to(torch.int8)
    scales = torch.stack([torch.where(on_grid, grid_scale.float(), scale), torch.where(on_grid, grid_min.float(), 0.0)])
    return codes.view(weight.shape), scales.permute(1, 2, 0).contiguous()


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1: weight [out, in] -> (packed uint8 [out, in / 2] in ATen's CPU int4 layout, scales and mins
    [in / 32, out, 2] fp16), the weight being q * scale + min with q in 0..15; a group's min is its smallest
    weight and its scale (max - min) / 15, both in fp16."""
    codes, scale, minimum = _q4_1(_groups(weight, 4))
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
    """The float32 weight [out, in] a quantized one stands for: q * scale + min."""
    if weight.dtype == torch.int8:
        rows, cols = weight.shape
        return (weight.float().view(rows, -1, GROUP) * scales[..., :1] + scales[..., 1:]).view(rows, cols)
    codes = int4_codes(weight).float()
    rows, cols = codes.shape
    wide = scales.float().transpose(0, 1)  # [out, in / 32, 2]
    return (codes.view(rows, -1, GROUP) * wide[..., :1] + wide[..., 1:]).view(rows, cols)


# weight id -> its codes as floats [out, in / 32, 32], for torch where the C++ kernels are not built: made once,
# dropped with the weight (a tensor cannot key a WeakKeyDictionary: its == is elementwise)
_CODES: dict[int, torch.Tensor] = {}


def _float_codes(weight: torch.Tensor) -> torch.Tensor:
    codes = _CODES.get(id(weight))
    if codes is None:
        # a group's int8 dot product reaches 32 * 127 * 32767 > 2^24, exact only in float64; int4's stays below
        whole = weight.double() if weight.dtype == torch.int8 else int4_codes(weight).float()
        codes = _CODES[id(weight)] = whole.view(whole.shape[0], -1, GROUP)
        weakref.finalize(weight, _CODES.pop, id(weight), None)
    return codes


def int16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """native/int16_rows.h in torch: rows x [M, K] float32 -> (codes [M, K / 32, 32] float32, scales [M, K / 32],
    scale * sum of codes [M, K / 32]); a group that is not finite gets codes 0 and a NaN scale."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    finite = torch.isfinite(groups).all(dim=-1, keepdim=True)
    largest = torch.where(finite, groups.abs(), 0.0).amax(dim=-1, keepdim=True)
    inverse = torch.where(finite & (largest > 0), LEVELS / largest, 0.0)
    codes = torch.round(torch.where(finite, groups, 0.0) * inverse).clamp(-LEVELS, LEVELS)
    scales = torch.where(finite, largest / LEVELS, torch.nan)[..., 0]
    return codes, scales, scales * codes.sum(dim=-1)


def torch_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The C++ kernels' product in torch ops, for where they are not built: x [M, K] float32 -> [M, N] float32.
    The same int16 rows; each group's dot product a matmul of integer codes whose every partial sum is exact (below
    2^24 in float32 at int4, float64 at int8), so the same in any order; then the scales, elementwise. Every step
    is exact or elementwise, so a row's output does not depend on the other rows of its call (batch-invariant, as
    the kernels are)."""
    codes, row_scales, row_sums = int16_rows(x)  # [M, G, 32], [M, G], [M, G]
    weights = _float_codes(weight)  # [N, G, 32]
    if weight.dtype == torch.int8:
        step, low = scales[..., 0], scales[..., 1]  # [N, G]
    else:
        step, low = scales[..., 0].float().T, scales[..., 1].float().T
    dots = torch.bmm(codes.transpose(0, 1).to(weights.dtype), weights.permute(1, 2, 0)).permute(1, 2, 0).float()
    terms = step[None] * row_scales[:, None] * dots + low[None] * row_sums[:, None]  # [M, N, G]
    return terms.sum(dim=-1)


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
        out = torch_product(flat, weight, scales)
    out = out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    return out if bias is None else out + bias


class QuantizedLinear(torch.nn.Module):
    """An nn.Linear whose weight is int8 or packed int4 in groups of 32 inputs with a scale and a min each (Q8_0 /
    Q4_1 blocks; buffers: not trainable)."""

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        int8 = (
            weight.dtype == torch.int8
            and weight.dim() == 2
            and scales.dtype == torch.float32
            and scales.shape == (weight.shape[0], weight.shape[1] // GROUP, 2)
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
                f"int8 weight [out, in] with float32 scales and mins [out, in / {GROUP}, 2], or packed int4 "
                f"[out, in / 2] with fp16 scales and mins [in / {GROUP}, out, 2] expected, got {weight.dtype} "
                f"{tuple(weight.shape)} "
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
def quantize_linears(module: torch.nn.Module, bits: int = 8) -> torch.nn.Module:
    """Every nn.Linear under `module` whose weight the kernels take -> a QuantizedLinear of `bits` (in place)."""
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            if fits(child.weight, bits):
                setattr(module, name, QuantizedLinear.from_linear(child, bits))
        else:
            quantize_linears(child, bits)
    return module


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
