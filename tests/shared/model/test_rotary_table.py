"""shared/model/rotary_table.py: a pass's cos and sin rows from the table are the rotary module's own, bit for bit."""

from __future__ import annotations

import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.rotary_table import TABLE_START, RotaryTables
from tests.conftest import DEMO_MODEL_DIR


def demo_rotary() -> torch.nn.Module:
    return load_checkpoint(DEMO_MODEL_DIR, with_tokenizer=False).decoder.rotary_emb


def module_rows(rotary: torch.nn.Module, like: torch.Tensor, positions: torch.Tensor):
    cos, sin = rotary(like, positions[None, :])
    return cos[0], sin[0]


@torch.inference_mode()
def test_rows_from_the_table_are_the_modules_own():
    rotary, tables = demo_rotary(), RotaryTables()
    like = torch.zeros(1, 8)
    for positions in (
        torch.tensor([0]),  # a first decode row
        torch.tensor([4095]),  # the table's last
        torch.arange(100, 170),  # a prefill chunk
        torch.tensor([37, 38, 38, 39, 40, 39]),  # tree nodes at base + depth
        torch.arange(3, 11),
    ):
        cos, sin = tables.rows(rotary, like, positions, int(positions.max()) + 1)
        expected_cos, expected_sin = module_rows(rotary, like, positions)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


@torch.inference_mode()
def test_the_table_grows_as_passes_reach_further_and_keeps_its_dtypes_apart():
    rotary, tables = demo_rotary(), RotaryTables()
    far = torch.tensor([TABLE_START + 10, 5])
    cos, _ = tables.rows(rotary, torch.zeros(1, 8), far, TABLE_START + 11)
    assert torch.equal(cos, module_rows(rotary, torch.zeros(1, 8), far)[0])
    half, _ = tables.rows(rotary, torch.zeros(1, 8, dtype=torch.bfloat16), far, TABLE_START + 11)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, module_rows(rotary, torch.zeros(1, 8, dtype=torch.bfloat16), far)[0])


class CallDependentRotary(torch.nn.Module):
    """Says it is the default rope, but its rows depend on how many the call asks for: no table may stand in."""

    rope_type = "default"

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        angles = position_ids[0, :, None].float() * torch.ones(4) / position_ids.shape[1]  # [T, 4]
        return angles.cos()[None].to(x.dtype), angles.sin()[None].to(x.dtype)


class CountedRotary(CallDependentRotary):
    """Another rope type: read through the module on every call."""

    rope_type = "dynamic"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        self.calls += 1
        return super().forward(x, position_ids)


@torch.inference_mode()
def test_a_module_whose_rows_depend_on_the_call_keeps_computing_them():
    tables, like = RotaryTables(), torch.zeros(1, 8)
    positions = torch.tensor([3, 4])
    rotary = CallDependentRotary()
    cos, sin = tables.rows(rotary, like, positions, 5)
    assert torch.equal(cos, module_rows(rotary, like, positions)[0])
    assert torch.equal(sin, module_rows(rotary, like, positions)[1])
    counted = CountedRotary()
    for _ in range(3):
        tables.rows(counted, like, positions, 5)
    assert counted.calls == 3  # no table made: one call of the module per pass
