"""shared/model/quantized.py: Q8_0 / Q4_1 blocks, the float32 products, the in-place quantized model."""

from __future__ import annotations

import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.quantized import (
    GROUP,
    QuantizationError,
    QuantizedLinear,
    dequantize,
    dequantize_linears,
    int4_codes,
    is_quantized,
    project,
    quantize_linears,
    quantize_q4,
    quantize_q8,
)


def test_q8_groups_round_trip_within_half_a_step():
    weight = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scales
    weight[5, :32] = 0.0  # an all-zero group must not divide by zero
    codes, scales = quantize_q8(weight)
    assert codes.dtype is torch.int8 and int(codes.abs().max()) <= 127 and scales.shape == (48, 64 // GROUP, 2)
    assert torch.equal(scales, scales.half().float())  # fp16 values, as GGUF blocks store them
    assert torch.equal(scales[..., 1], torch.zeros(48, 2))  # random weights: Q8_0 groups, min 0
    restored = dequantize(codes, scales)
    steps = scales[..., 0].repeat_interleave(GROUP, dim=1)
    assert torch.all((restored - weight).abs() <= steps / 2 + 1e-7)
    assert torch.equal(restored[5, :32], torch.zeros(32))


def test_q4_groups_round_trip_within_half_a_step_and_unpack_to_their_codes():
    weight = torch.randn(128, 96)
    weight[3, :32] = 0.25  # a constant group: scale 0, every weight its min
    packed, scales = quantize_q4(weight)
    assert packed.dtype is torch.uint8 and scales.dtype is torch.float16 and scales.shape == (3, 128, 2)
    restored = dequantize(packed, scales)
    steps = scales[..., 0].float().T.repeat_interleave(GROUP, dim=1)  # [out, in]: each input's group step
    assert torch.all((restored - weight).abs() <= steps / 2 + 1e-3 * weight.abs().max())
    assert torch.equal(restored[3, :32], torch.full((32,), 0.25))
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32)
    assert torch.equal(int4_codes(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)).int(), codes)


def test_weights_already_in_q4_1_and_q8_0_blocks_are_kept_bit_for_bit():
    """A GGUF's Q4_1 group holds q * d + m (q in 0..15, fp16 d and m), the min at q = 0 and the max at 15; a
    Q8_0 group q * d with max |q| = 127: requantized from those values, they are the same weights exactly."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 128), generator=generator).float()
    q[:, ::32], q[:, 1::32] = 0.0, 15.0
    d = (torch.rand(64, 4, 1, generator=generator) / 40).half().float()
    m = (-8 * d - torch.rand(64, 4, 1, generator=generator) / 100).half().float()
    weight = (q.view(64, 4, 32) * d + m).view(64, 128)
    assert torch.equal(dequantize(*quantize_q4(weight)), weight)
    assert torch.equal(dequantize(*quantize_q8(weight)), weight)  # int8 keeps a 4-bit grid's group on that grid
    signed = torch.randint(-127, 128, (64, 128), generator=generator).float()
    signed[:, ::32] = 127.0
    scale = (torch.rand(64, 4, 1, generator=generator) / 40).half().float()
    weight = (signed.view(64, 4, 32) * scale).view(64, 128)
    assert torch.equal(dequantize(*quantize_q8(weight)), weight)


@pytest.mark.parametrize("bad", [torch.randn(4), torch.randint(0, 9, (4, 32)), torch.randn(2, 3, 32)])
def test_only_2d_float_weights_quantize(bad):
    with pytest.raises(QuantizationError, match="2-D float"):
        quantize_q8(bad)


def test_a_group_beyond_float16_is_refused():
    with pytest.raises(QuantizationError, match="float16"):
        quantize_q8(torch.full((4, 32), 1e9))


def test_quantized_linear_refuses_mismatched_scales():
    with pytest.raises(QuantizationError, match="scales"):
        QuantizedLinear(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2))
    with pytest.raises(QuantizationError, match="scales"):
        QuantizedLinear(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2, 2).half())
    with pytest.raises(QuantizationError, match="int8"):
        QuantizedLinear(torch.zeros(4, 64), torch.ones(4, 2, 2))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_product_sums_and_returns_float32_with_no_bfloat16_rounding(bits, rows):
    linear = torch.nn.Linear(64, 128, bias=True)
    quantized = QuantizedLinear.from_linear(linear, bits)
    x = torch.randn(rows, 64)
    got = quantized(x)
    assert got.dtype is torch.float32 and got.shape == (rows, 128)
    expected = x.double() @ quantized.dequantized().double().T + linear.bias.double()
    # the C++ kernels multiply int16 rows (a group's inputs to 1 / 65534 of its largest), torch the float32 rows
    torch.testing.assert_close(got.double(), expected, atol=2e-4, rtol=2e-4)
    assert not torch.equal(got, got.bfloat16().float())  # an output rounded to bfloat16 would equal its rounding
    assert torch.equal(project(x, quantized.weight, quantized.bias, quantized.scales), got)


@pytest.mark.parametrize("native", ["on", "off"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_computes_the_same_alone_or_in_a_batch(bits, native, monkeypatch):
    """The verifier packs rows of many sessions: a row's output must not depend on its neighbours, with the C++
    kernels and with torch_product where they are not built (the container images)."""
    from shared.model import native_build

    if native == "off":
        monkeypatch.setenv(native_build.SWITCH_ENV, "off")
    quantized = QuantizedLinear.from_linear(torch.nn.Linear(64, 128), bits)
    if bits == 8:
        quantized.weight.fill_(127)  # a group's integer sum past 2^24: exact in torch_product only in float64
    x = torch.randn(9, 64)
    together = quantized(x)
    for i in range(9):
        assert torch.equal(quantized(x[i : i + 1])[0], together[i])


@pytest.fixture(scope="module")
def int8_llama(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, quantize="int8", with_tokenizer=False)


def test_the_model_is_quantized_in_place_and_everything_else_stays_float32(int8_llama, tiny_llama_dir):
    model = int8_llama.model
    assert is_quantized(model)
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, "qkvo"), (layer.mlp, ("gate", "up", "down"))):
            for name in names:
                assert isinstance(getattr(parent, f"{name}_proj"), QuantizedLinear)
        assert layer.input_layernorm.weight.dtype is torch.float32
    assert model.model.embed_tokens.weight.dtype is torch.float32 and model.dtype is torch.float32
    dense = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    ids = torch.tensor([[3, 50, 7, 120, 9]])
    with torch.inference_mode():
        got, want = model(input_ids=ids).logits, dense.model(input_ids=ids).logits
    assert got.dtype is torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # close to the float model, not equal


def test_dequantized_copies_are_dense_and_trainable(int8_llama):
    import copy

    attn = dequantize_linears(copy.deepcopy(int8_llama.decoder.layers[1].self_attn))
    source = int8_llama.decoder.layers[1].self_attn.q_proj
    assert type(attn.q_proj) is torch.nn.Linear and attn.q_proj.weight.dtype is torch.float32
    assert torch.equal(attn.q_proj.weight, dequantize(source.weight, source.scales))


def test_unknown_quantizations_are_refused(tiny_llama_dir):
    from shared.model.quantized import quantize_model

    with pytest.raises(QuantizationError, match="int8, int4"):
        quantize_model(load_checkpoint(tiny_llama_dir, with_tokenizer=False).model, "int3")


def test_int4_refuses_shapes_its_kernel_cannot_pack():
    with pytest.raises(QuantizationError, match="multiple of 64"):
        quantize_q4(torch.randn(40, 64))


def test_a_block_with_a_shape_int4_cannot_pack_stays_int8_whole_so_its_projections_still_fuse():
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model.fused import fused_layer
    from shared.model.quantized import quantize_model

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=1,
    )  # k/v: 8 outputs, not a multiple of 64
    model = quantize_model(LlamaForCausalLM(config).eval(), "int4")
    layer = model.model.layers[0]
    assert {getattr(layer.self_attn, f"{p}_proj").bits for p in "qkvo"} == {8}
    assert {getattr(layer.mlp, f"{p}_proj").bits for p in ("gate", "up", "down")} == {4}
    fused = fused_layer(layer)
    assert fused.qkv.weight.dtype is torch.int8 and fused.gate_up.weight.dtype is torch.uint8


def test_quantize_linears_swaps_every_nested_linear_that_fits_and_keeps_the_rest():
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 96, bias=False))
    )
    odd = torch.nn.Linear(30, 8)  # 30 inputs: not whole groups of 32, stays float
    block.append(odd)
    x = torch.randn(3, 64)
    expected = block[1](block[0](x))
    quantize_linears(block, 8)
    assert isinstance(block[0], QuantizedLinear) and isinstance(block[1][1], QuantizedLinear)
    assert isinstance(block[1][0], torch.nn.LayerNorm) and block[2] is odd
    torch.testing.assert_close(block[1](block[0](x)), expected, atol=0.05, rtol=0.05)  # Q8_0 blocks: close, not equal
