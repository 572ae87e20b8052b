"""shared/model/fused.py: projections fused once, the HF modules left computing the same numbers."""

from __future__ import annotations

import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.fused import FusionError, fuse, fused_layer
from shared.model.quantized import QuantizedLinear


def test_fused_outputs_are_the_separate_outputs_side_by_side_and_the_modules_become_views():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(32, n, bias=bias) for n, bias in ((32, True), (16, False), (16, True))]
    x = torch.randn(5, 32)
    before = [linear(x) for linear in linears]
    fused = fuse(linears)
    torch.testing.assert_close(fused(x), torch.cat(before, dim=-1), atol=1e-6, rtol=1e-6)
    for linear, old in zip(linears, before):
        assert linear.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        torch.testing.assert_close(linear(x), old, atol=1e-6, rtol=1e-6)
    assert linears[1].bias is None  # a projection without a bias keeps none (its slice of the fused bias is 0)


def test_int8_projections_fuse_with_their_scales():
    torch.manual_seed(1)
    linears = [QuantizedLinear.from_linear(torch.nn.Linear(32, n)) for n in (24, 8)]
    x = torch.randn(3, 32)
    before = torch.cat([linear(x) for linear in linears], dim=-1)
    fused = fuse(linears)
    assert fused.scales is not None and fused.weight.dtype is torch.int8
    assert torch.equal(fused(x), before)  # each output its own row's sums, whatever the neighbours
    assert linears[0].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "linears",
    [
        lambda: [torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)],  # different inputs
        lambda: [torch.nn.Linear(32, 4), QuantizedLinear.from_linear(torch.nn.Linear(32, 4))],  # different kinds
        lambda: [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4, dtype=torch.bfloat16)],  # different dtypes
        lambda: [torch.nn.Conv1d(8, 4, 1)],
    ],
)
def test_what_cannot_share_a_matmul_is_refused(linears):
    with pytest.raises(FusionError):
        fuse(linears())


def test_a_layer_is_fused_once_and_again_after_its_weights_are_replaced(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    layer = checkpoint.decoder.layers[0]
    first = fused_layer(layer)
    assert fused_layer(layer) is first and first.is_current()
    layer.self_attn.q_proj.weight = torch.nn.Parameter(layer.self_attn.q_proj.weight.detach().clone() * 2)
    assert not first.is_current()
    again = fused_layer(layer)
    assert again is not first and again.is_current()
    x = torch.randn(2, checkpoint.hidden_size)
    q = again.qkv(x)[:, : again.q_size]
    torch.testing.assert_close(q, layer.self_attn.q_proj(x), atol=1e-5, rtol=1e-5)
