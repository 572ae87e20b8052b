"""Inversion attacks on the hidden states the cloud sees (issue 17): the attacker's data, the attacks'
outputs and the budgets they report. Accuracy claims here are loose floors on the demo model, not
measurements (those are `tophat privacy`'s job)."""

from __future__ import annotations

import pytest
import torch

from shared.model.split import InputSubmodel
from tophatctl.demo_model.corpus import iter_corpus_files, split_corpus
from tophatctl.privacy.attacks import (
    AttackError,
    ContextInverter,
    LinearInverter,
    MLPInverter,
    NearestEmbedding,
    TrainBudget,
    recovery,
)
from tophatctl.privacy.states import StatesError, dataset, hidden_states


@pytest.fixture(scope="module")
def corpus():
    train, held_out = split_corpus(iter_corpus_files())
    return [f.text for f in train[:40]], [f.text for f in held_out[:10]]


@pytest.fixture(scope="module")
def demo_m1(demo_checkpoint, corpus):
    train_texts, eval_texts = corpus
    train = dataset(demo_checkpoint, train_texts, split_layers=1, seq_len=64, max_tokens=3000)
    evaluation = dataset(demo_checkpoint, eval_texts, split_layers=1, seq_len=64, max_tokens=600)
    return train, evaluation


def _table(checkpoint):
    return checkpoint.model.model.embed_tokens.weight


def test_hidden_states_are_what_the_device_sends(tiny_checkpoint):
    ids = [5, 17, 3, 99, 42, 7]
    states = hidden_states(tiny_checkpoint, ids, split_layers=2)
    submodel = InputSubmodel(tiny_checkpoint, 2)
    expected = submodel(torch.tensor(ids), submodel.new_cache())
    assert states.dtype == torch.float32 and states.shape == (len(ids), tiny_checkpoint.hidden_size)
    assert torch.equal(states, expected.float())
    # m = 0 is the embedding rows themselves
    assert torch.equal(hidden_states(tiny_checkpoint, ids, 0), _table(tiny_checkpoint)[ids].float())


def test_hidden_states_refuse_bad_input(tiny_checkpoint):
    with pytest.raises(StatesError):
        hidden_states(tiny_checkpoint, [1, 2], split_layers=tiny_checkpoint.num_layers)
    with pytest.raises(StatesError):
        hidden_states(tiny_checkpoint, [1, tiny_checkpoint.vocab_size], split_layers=1)
    with pytest.raises(StatesError):
        hidden_states(tiny_checkpoint, [], split_layers=1)


def test_dataset_cuts_texts_into_sequences_and_caps_tokens(demo_checkpoint, corpus):
    train_texts, _ = corpus
    data = dataset(demo_checkpoint, train_texts, split_layers=1, seq_len=32, max_tokens=500)
    assert sum(ids.numel() for _, ids in data) == 500
    assert all(2 <= ids.numel() <= 32 and states.shape == (ids.numel(), 256) for states, ids in data)
    first_ids = demo_checkpoint.tokenizer(train_texts[0], add_special_tokens=False)["input_ids"][:32]
    assert data[0][1].tolist() == first_ids


def test_nearest_embedding_recovers_everything_at_m0(demo_checkpoint, corpus):
    _, eval_texts = corpus
    evaluation = dataset(demo_checkpoint, eval_texts, split_layers=0, seq_len=64, max_tokens=600)
    result = recovery(NearestEmbedding(_table(demo_checkpoint)), evaluation)
    assert result["tokens"] == 600
    assert result["top1"] >= 0.99 and result["top5"] >= result["top1"]


def test_linear_inverter_generalises_to_other_text_at_m1(demo_checkpoint, demo_m1):
    train, evaluation = demo_m1
    table = _table(demo_checkpoint)
    nearest = recovery(NearestEmbedding(table), evaluation)
    linear = LinearInverter(table)
    report = linear.fit(train)
    result = recovery(linear, evaluation)
    chance = 5 / demo_checkpoint.vocab_size
    assert result["top1"] > 0.3 > 100 * chance  # far above chance on text it never saw
    assert result["top1"] > nearest["top1"] + 0.2  # and far above reading the state as an embedding
    assert report["tokens"] == 3000 and report["steps"] == 0 and report["ridge_lambda"] in LinearInverter.LAMBDAS


def test_topk_shapes_and_ordering(demo_checkpoint, demo_m1):
    train, evaluation = demo_m1
    states, _ = evaluation[0]
    linear = LinearInverter(_table(demo_checkpoint))
    linear.fit(train)
    top5 = linear.topk(states, k=5)
    top1 = linear.topk(states, k=1)
    assert top5.shape == (states.shape[0], 5) and top5.dtype == torch.long
    assert torch.equal(top1[:, 0], top5[:, 0])  # the best guess heads the list
    assert all(len(set(row)) == 5 for row in top5.tolist())  # five distinct guesses


@pytest.mark.parametrize("attack_class", [MLPInverter, ContextInverter])
def test_learned_attack_budget_report_is_honest(demo_checkpoint, demo_m1, attack_class):
    train, evaluation = demo_m1
    attack = attack_class(_table(demo_checkpoint))
    budget = TrainBudget(steps=4, batch_tokens=128, candidates=512, max_tokens=1000)
    report = attack.fit(train, budget)
    assert report["steps"] == 4
    assert report["tokens"] == 1000  # max_tokens honoured and counted
    if attack_class is MLPInverter:
        assert report["tokens_seen"] == 4 * 128
    else:  # whole sequences (of at most 64 tokens) until each batch holds 128 tokens
        assert 4 * 128 <= report["tokens_seen"] < 4 * (128 + 64)
    assert report["epochs"] == pytest.approx(report["tokens_seen"] / 1000)
    assert report["parameters"] == sum(p.numel() for p in attack.net.parameters()) + 1
    assert report["wall_s"] > 0
    top = attack.topk(evaluation[0][0], k=5)
    assert top.shape == (evaluation[0][0].shape[0], 5)


@pytest.mark.parametrize("attack_class", [MLPInverter, ContextInverter])
def test_learned_attack_starts_from_the_ridge_solution(demo_checkpoint, demo_m1, attack_class):
    train, evaluation = demo_m1
    table = _table(demo_checkpoint)
    linear, learned = LinearInverter(table), attack_class(table)
    linear.fit(train)
    learned.fit(train, TrainBudget(steps=0))  # no steps: exactly the ridge map, read out by cosine
    states = evaluation[0][0]
    assert torch.equal(learned.topk(states, k=5), linear.topk(states, k=5))


def test_bad_shapes_are_refused(demo_checkpoint, demo_m1):
    train, evaluation = demo_m1
    table = _table(demo_checkpoint)
    nearest = NearestEmbedding(table)
    states = evaluation[0][0]
    with pytest.raises(AttackError):
        nearest.topk(states[None])  # a batch, not one sequence
    with pytest.raises(AttackError):
        nearest.topk(states[:, :100])  # wrong hidden size
    with pytest.raises(AttackError):
        nearest.topk(states, k=0)
    with pytest.raises(AttackError):
        LinearInverter(table).topk(states)  # not fitted
    with pytest.raises(AttackError):
        LinearInverter(table).fit([(states, torch.zeros(3, dtype=torch.long))])  # ids do not match states
    with pytest.raises(AttackError):
        MLPInverter(table).fit([])
