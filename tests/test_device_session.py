"""DeviceSession's greedy verdict: how many rows of the target's LM head it computes (the tokens are covered by
the lossless tests: tests/test_split.py, tests/test_tree_session.py, tests/test_quantized_exactness.py)."""

from __future__ import annotations

import pytest
import torch

from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig


def _rows_the_head_computes(checkpoint) -> tuple[int, list[int], int]:
    """(draft tokens sent, rows per head call while the verdict is made, tokens accepted) for one chain round
    whose deep states are noise (so the target most likely disagrees with the first draft)."""
    device = DeviceModel.from_checkpoint(checkpoint, 2, DraftAdapter(checkpoint, 2).randomize(0))
    device.eos_token_id = None  # a random checkpoint's drafts may hit its EOS: the round must carry 4 drafts
    session = DeviceSession(device, list(range(3, 20)), draft_config=DraftConfig(eta=0.0, max_draft=4),
                            max_new_tokens=16)
    session.prefill_chunk(17)
    session.on_prefill_result(torch.randn(1, checkpoint.hidden_size, generator=torch.Generator().manual_seed(0)))
    draft = session.draft()
    calls: list[int] = []
    head = device.output.forward

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return head(hidden)

    device.output.forward = counted  # type: ignore[method-assign]
    deep = torch.randn(len(draft.tokens) + 1, checkpoint.hidden_size, generator=torch.Generator().manual_seed(1))
    session.on_verify_result(draft, deep)
    return len(draft.tokens), calls, session.verdicts[-1][1]


def test_a_dense_head_takes_every_row_in_one_call(tiny_llama_dir):
    drafted, calls, _ = _rows_the_head_computes(load_checkpoint(tiny_llama_dir, with_tokenizer=False))
    assert drafted == 4
    assert calls == [drafted + 1]  # it reads its weights once for any number of rows


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_head_computes_rows_only_up_to_the_first_disagreement(tiny_llama_dir, kind):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False, quantize=kind)
    drafted, calls, accepted = _rows_the_head_computes(checkpoint)
    assert drafted == 4 and accepted < drafted  # noise for deep states: the target disagrees somewhere
    assert calls == [1] * (accepted + 1)  # one row per call, none after the first disagreement
