"""Adapter distillation (tophatctl/adapter_training): the states it learns from are the split's
own, batching does not change them, training lowers eq. 4, and the held-out prompts stay out."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model.adapter import AdapterSpec
from shared.model.split import InputSubmodel
from tophatctl.adapter_training import dataset
from tophatctl.adapter_training.dataset import DistillData, extract_states, sample_user_prompts
from tophatctl.adapter_training.distill import DistillConfig, _batch, train_adapter
from tophatctl.adapter_training.prompts import (HELD_OUT_CHAT_PROMPTS, debian_packages, general_prompts,
                                               near_held_out, training_prompts)


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
@pytest.mark.slow
def test_training_prompts_are_deterministic_and_never_held_out(build):
    prompts = build(60, seed=3)
    assert prompts == build(60, seed=3)
    assert len(set(prompts)) == 60
    assert not set(prompts) & set(HELD_OUT_CHAT_PROMPTS)
    assert not any(near_held_out(p) for p in prompts)


def test_near_copies_of_held_out_prompts_are_caught():
    assert all(near_held_out(p) for p in HELD_OUT_CHAT_PROMPTS)
    assert near_held_out("what's the capital of France")
    assert near_held_out("Why is the sky so blue?")
    assert near_held_out("What is deep learning?")  # 3 of 5 words shared with "What is machine learning?"
    assert not near_held_out("What is the capital of Peru and how big is it?")
    assert not near_held_out("Can you help me plan a budget for a small wedding?")


@pytest.fixture(scope="module")
def smollm2():
    from shared.model.checkpoint import load_checkpoint
    from tophatctl.models import resolve_model

    return load_checkpoint(resolve_model("smollm2"))


@pytest.mark.slow
def test_the_model_writes_its_own_distinct_questions_the_same_on_every_run(smollm2):
    first = sample_user_prompts(smollm2, 4, seed=5, batch_size=8, max_new_tokens=40)
    assert first == sample_user_prompts(smollm2, 4, seed=5, batch_size=8, max_new_tokens=40)
    assert len(set(first)) == 4 and all(len(p.split()) >= 4 for p in first)
    assert not any(near_held_out(p) for p in first)
    # the user's words start right after the template's user header: rendering one back gives it whole
    prefix = dataset._user_turn_prefix(smollm2)
    assert dataset.user_prompt_ids(smollm2, first[0])[: len(prefix)] == prefix


def test_self_written_questions_drop_held_out_copies_unfinished_turns_and_repeats(smollm2, monkeypatch):
    tokenizer, eos = smollm2.tokenizer, smollm2.eos_token_id
    fine = "Can you suggest a weekly plan for learning to play the guitar?"
    rows = [tokenizer.encode(text, add_special_tokens=False) + [eos] for text in
            (HELD_OUT_CHAT_PROMPTS[5], "What's the capital of France?", fine, fine, "Too short here")]
    rows.append(tokenizer.encode("A question that never ends because the budget ran", add_special_tokens=False))
    monkeypatch.setattr(dataset, "_generate", lambda *args, **kwargs: rows)
    assert sample_user_prompts(smollm2, 3, batch_size=len(rows)) == [fine]  # 20 batches tried, one kept


def test_debian_descriptions_parse(tmp_path):
    status = tmp_path / "status"
    status.write_text("Package: foo\nStatus: install ok\nDescription: a foo tool\n it does foo\n .\n and bar\n\n"
                      "Package: nodesc\nStatus: install ok\n")
    assert debian_packages(status) == [("foo", "a foo tool it does foo and bar")]
    assert debian_packages(tmp_path / "missing") == []


@pytest.mark.slow
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
