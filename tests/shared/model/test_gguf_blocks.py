"""The quantized SmolLM2 computes the model that ships: its int4 projections and int8 head are the GGUF's own
Q4_1 and Q8_0 blocks (the same fp16 scales and mins as the file), so every dequantized tensor equals the f32
checkpoint's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.quantized import QuantizedLinear, dequantize, quantize_model
from tophatctl.models import resolve_model, smollm2_gguf_path


@pytest.fixture
def smollm2_copy():  # each test quantizes its own copy in place
    return load_checkpoint(resolve_model("smollm2"), with_tokenizer=False)


@pytest.fixture(scope="module")
def file_blocks() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each Q4_1 / Q8_0 tensor's fp16 (scales, mins) as the file stores them, by GGUF name: [rows, groups] each."""
    from gguf import GGUFReader

    blocks = {}
    for tensor in GGUFReader(str(smollm2_gguf_path())).tensors:
        kind, raw = tensor.tensor_type.name, np.asarray(tensor.data)
        if kind == "Q4_1":  # 20 bytes a block: fp16 d, fp16 m, 16 bytes of codes
            block = raw.reshape(raw.shape[0], -1, 20)
            halves = block[..., :4].copy().view(np.float16)  # [rows, groups, 2]
            blocks[tensor.name] = (torch.from_numpy(halves[..., 0].copy()), torch.from_numpy(halves[..., 1].copy()))
        elif kind == "Q8_0":  # 34 bytes a block: fp16 d, 32 int8 codes
            block = raw.reshape(raw.shape[0], -1, 34)
            blocks[tensor.name] = (torch.from_numpy(block[..., :2].copy().view(np.float16)[..., 0]), None)
    return blocks


def _gguf_name(name: str) -> str:
    parts = name.split(".")  # model.layers.N.<self_attn|mlp>.<x>_proj
    short = {
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
    }[parts[4]]
    return f"blk.{parts[2]}.{short}.weight"


def _row_order(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """The row of `theirs` each row of `ours` is (transformers permutes q and k rows for its rotary layout)."""
    index = {row.numpy().tobytes(): i for i, row in enumerate(theirs)}
    return torch.tensor([index[row.numpy().tobytes()] for row in ours])


def test_every_quantized_tensor_is_the_f32_checkpoints_exactly_with_the_files_own_scales(smollm2_copy, file_blocks):
    reference = {name: tensor.clone() for name, tensor in smollm2_copy.model.state_dict().items()}
    model = quantize_model(smollm2_copy.model, "int4")
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        weight = dequantize(module.weight, module.scales)
        if name == "lm_head":  # tied: the embeddings' Q8_0 blocks
            assert module.bits == 8 and torch.equal(weight, reference["model.embed_tokens.weight"])
            scales, _ = file_blocks["token_embd.weight"]
            assert torch.equal(module.scales[..., 0], scales.float()) and not module.scales[..., 1].any()
        else:
            assert module.bits == 4 and torch.equal(weight, reference[f"{name}.weight"]), name
            scales, mins = file_blocks[_gguf_name(name)]
            ours = module.scales.transpose(0, 1)  # [out, groups, 2]
            order = _row_order(
                torch.stack([ours[..., 0], ours[..., 1]], -1).view(ours.shape[0], -1),
                torch.stack([scales, mins], -1).view(scales.shape[0], -1),
            )
            assert torch.equal(ours[..., 0], scales[order]) and torch.equal(ours[..., 1], mins[order]), name
        checked += 1
    assert checked == 7 * smollm2_copy.num_layers + 1


def test_at_int8_every_projection_keeps_its_4_bit_grid_so_the_model_is_the_same(smollm2_copy):
    reference = {name: tensor.clone() for name, tensor in smollm2_copy.model.state_dict().items()}
    model = quantize_model(smollm2_copy.model, "int8")
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            key = "model.embed_tokens.weight" if name == "lm_head" else f"{name}.weight"
            assert module.bits == 8 and torch.equal(dequantize(module.weight, module.scales), reference[key]), name
