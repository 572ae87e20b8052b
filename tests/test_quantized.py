"""shared/model/quantized.py: per-row int8 weights, the matmul, the in-place quantized model."""

from __future__ import annotations

import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.quantized import (
    MATMUL_DTYPE,
    QuantizationError,
    QuantizedLinear,
    dequantize_linears,
    is_quantized,
    project,
    quantize_rows,
)


def test_rows_round_trip_within_half_a_step():
    weight = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scales
    weight[5] = 0.0  # an all-zero row must not divide by zero
    quantized, scales = quantize_rows(weight)
    assert quantized.dtype is torch.int8 and int(quantized.abs().max()) <= 127
    restored = quantized.float() * scales[:, None]
    assert torch.all((restored - weight).abs() <= scales[:, None] / 2 + 1e-7)
    assert torch.equal(restored[5], torch.zeros(64))


@pytest.mark.parametrize("bad", [torch.randn(4), torch.randint(0, 9, (4, 4)), torch.randn(2, 3, 4)])
def test_only_2d_float_weights_quantize(bad):
    with pytest.raises(QuantizationError, match="2-D float"):
        quantize_rows(bad)


def test_int8_linear_refuses_mismatched_scales():
    with pytest.raises(QuantizationError, match="scales"):
        QuantizedLinear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))
    with pytest.raises(QuantizationError, match="int8"):
        QuantizedLinear(torch.zeros(4, 8), torch.ones(4))


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_product_is_the_dequantized_matmul_on_bfloat16_inputs_returned_in_the_input_dtype(rows):
    linear = torch.nn.Linear(64, 40, bias=True)
    int8 = QuantizedLinear.from_linear(linear)
    x = torch.randn(rows, 64)
    got = int8(x)
    assert got.dtype is torch.float32 and got.shape == (rows, 40)
    dequantized = int8.weight.float() * int8.scales.float()[:, None]
    expected = x.to(MATMUL_DTYPE).float() @ dequantized.T + linear.bias
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # bf16 output rounding
    torch.testing.assert_close(got, linear(x), atol=0.1, rtol=0.05)  # and near the float layer
    assert torch.equal(project(x, int8.weight, int8.bias, int8.scales), got)


def test_a_row_computes_the_same_alone_or_in_a_batch():
    """The verifier packs rows of many sessions: a row's output must not depend on its neighbours."""
    int8 = QuantizedLinear.from_linear(torch.nn.Linear(64, 96))
    x = torch.randn(9, 64)
    together = int8(x)
    for i in range(9):
        assert torch.equal(int8(x[i : i + 1])[0], together[i])


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
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # close to the float model, not equal


def test_dequantized_copies_are_dense_and_trainable(int8_llama):
    import copy

    attn = dequantize_linears(copy.deepcopy(int8_llama.decoder.layers[1].self_attn))
    source = int8_llama.decoder.layers[1].self_attn.q_proj
    assert type(attn.q_proj) is torch.nn.Linear and attn.q_proj.weight.dtype is torch.float32
    torch.testing.assert_close(attn.q_proj.weight, source.weight.float() * source.scales.float()[:, None])


def test_int4_groups_round_trip_within_half_a_step_and_the_kernel_multiplies_what_was_kept():
    from shared.model.quantized import INT4_GROUP

    linear = torch.nn.Linear(96, 48, bias=False)
    int4 = QuantizedLinear.from_linear(linear, bits=4)
    assert int4.bits == 4 and int4.in_features == 96 and int4.weight.dtype is torch.uint8
    kept = int4.dequantized()  # [out, in], read back through the kernel
    steps = int4.scales[..., 0].float().T.repeat_interleave(INT4_GROUP, dim=1)  # [out, in]: each input's group step
    assert torch.all((kept - linear.weight).abs() <= steps / 2 + 2e-2 * linear.weight.abs().max())
    x = torch.randn(5, 96)
    torch.testing.assert_close(int4(x), x.to(MATMUL_DTYPE).float() @ kept.T, atol=3e-2, rtol=3e-2)


def test_int4_holds_weights_already_on_a_sixteen_level_grid_almost_exactly():
    """A Q4_1 GGUF's weights (SmolLM2's): every group of 32 holds d * q + m with q in 0..15."""
    torch.manual_seed(2)
    q = torch.randint(0, 16, (32, 64)).float()
    q[:, ::32] = 0.0
    q[:, 1::32] = 15.0  # each group spans the whole grid, as a quantizer's output does
    weight = q * 0.01 + 0.003
    kept = QuantizedLinear.from_linear(_linear_with(weight), bits=4).dequantized()
    assert (kept - weight).abs().max() < 0.1 * 0.01  # bf16 scales and zeros: not bit-exact, a tenth of a grid step


def _linear_with(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_unknown_quantizations_are_refused(tiny_llama_dir):
    from shared.model.quantized import quantize_model

    with pytest.raises(QuantizationError, match="int8, int4"):
        quantize_model(load_checkpoint(tiny_llama_dir, with_tokenizer=False).model, "int3")


def test_int4_refuses_shapes_its_kernel_cannot_pack_and_the_model_keeps_those_in_int8():
    from shared.model.quantized import quantize_groups

    with pytest.raises(QuantizationError, match="multiple of 16"):
        quantize_groups(torch.randn(40, 64))


def test_a_block_with_a_shape_int4_cannot_pack_stays_int8_whole_so_its_projections_still_fuse():
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model.fused import fused_layer
    from shared.model.quantized import quantize_model

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=1)  # k/v: 8 outputs, not a multiple of 16
    model = quantize_model(LlamaForCausalLM(config).eval(), "int4")
    layer = model.model.layers[0]
    assert {getattr(layer.self_attn, f"{p}_proj").bits for p in "qkvo"} == {8}
    assert {getattr(layer.mlp, f"{p}_proj").bits for p in ("gate", "up", "down")} == {4}
    fused = fused_layer(layer)
    assert fused.qkv.weight.dtype is torch.int8 and fused.gate_up.weight.dtype is torch.uint8
