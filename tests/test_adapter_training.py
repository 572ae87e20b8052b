"""Adapter distillation (tophatctl/adapter_training): the states it learns from are the split's
own, batching does not change them, training lowers eq. 4, and the held-out prompts stay out."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.adapter import AdapterSpec
from shared.model.split import InputSubmodel
from tophatctl.adapter_training.dataset import DistillData, extract_states
from tophatctl.adapter_training.distill import DistillConfig, _batch, train_adapter
from tophatctl.adapter_training.prompts import (HELD_OUT_CHAT_PROMPTS, debian_packages, general_prompts,
                                               training_prompts)


def _random_sequences(checkpoint, count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(6, 24)
        out.append(([rng.randrange(1, checkpoint.vocab_size) for _ in range(n)], rng.randint(1, n - 2)))
    return out


def test_extracted_states_are_the_splits_own_whatever_the_batch(tiny_checkpoint):
    sequences = _random_sequences(tiny_checkpoint, 5)
    batched = extract_states(tiny_checkpoint, sequences, max_m=3, batch_size=4)
    alone = extract_states(tiny_checkpoint, sequences, max_m=3, batch_size=1)
    by_ids = {tuple(s.ids.tolist()): s for s in alone}
    for seq in batched:
        single = by_ids[tuple(seq.ids.tolist())]
        torch.testing.assert_close(seq.deep, single.deep, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(seq.shallow, single.shallow, atol=2e-3, rtol=1e-3)
    seq = batched[0]
    for m in (1, 3):
        submodel = InputSubmodel(tiny_checkpoint, m)
        want = submodel(seq.ids, submodel.new_cache())  # [L, H]
        torch.testing.assert_close(seq.shallow[m - 1].float(), want, atol=2e-3, rtol=1e-3)


def test_batch_feeds_previous_deep_states_only_inside_the_answer(tiny_checkpoint):
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 3), max_m=2), 2, 0.0)
    ids, shallow, deep, prev, mask, answer_start = _batch(data, [0, 1, 2], m=2)
    for row, seq in enumerate(data.sequences):
        p, n = seq.prompt_len, len(seq.ids)
        assert answer_start[row] == p
        assert mask[row].nonzero().flatten().tolist() == list(range(p, n))
        assert torch.count_nonzero(prev[row, :p]) == 0 and torch.count_nonzero(prev[row, n:]) == 0
        torch.testing.assert_close(prev[row, p:n], seq.deep[p - 1 : n - 1].float())
        torch.testing.assert_close(shallow[row, :n], seq.shallow[1].float())


@pytest.mark.parametrize("spec", [AdapterSpec("hat"), AdapterSpec("feature", mlp=True)], ids=lambda s: s.name)
def test_training_lowers_the_distillation_loss(tiny_checkpoint, spec):
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 12, seed=1), max_m=2), 2, 0.0)
    _, short = train_adapter(tiny_checkpoint, data, spec, DistillConfig(split_layers=2, steps=5, batch_size=4),
                             progress_every=5)
    _, longer = train_adapter(tiny_checkpoint, data, spec, DistillConfig(split_layers=2, steps=60, batch_size=4),
                              progress_every=10)
    assert longer["final_loss"] < short["final_loss"]
    with pytest.raises(ValueError, match="m = 1..2"):
        train_adapter(tiny_checkpoint, data, spec, DistillConfig(split_layers=3, steps=1))


@pytest.mark.parametrize("build", [training_prompts, general_prompts], ids=lambda f: f.__name__)
def test_training_prompts_are_deterministic_and_never_held_out(build):
    prompts = build(60, seed=3)
    assert prompts == build(60, seed=3)
    assert len(set(prompts)) == 60
    assert not set(prompts) & set(HELD_OUT_CHAT_PROMPTS)


def test_debian_descriptions_parse(tmp_path):
    status = tmp_path / "status"
    status.write_text("Package: foo\nStatus: install ok\nDescription: a foo tool\n it does foo\n .\n and bar\n\n"
                      "Package: nodesc\nStatus: install ok\n")
    assert debian_packages(status) == [("foo", "a foo tool it does foo and bar")]
    assert debian_packages(tmp_path / "missing") == []


def test_training_prompts_are_the_same_in_every_process():
    """The prompts come out of a set; its iteration order follows the per-process string hash seed."""
    import os
    import subprocess
    import sys

    code = ("from tophatctl.adapter_training.prompts import training_prompts as t, general_prompts as g;"
            "print(t(40, seed=3) + g(40, seed=3))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
