"""Adapter distillation (tophatctl/adapter_training): the states it learns from are the split's
own, batching does not change them, training lowers eq. 4, and the held-out prompts stay out."""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from shared.model.adapter import AdapterError, AdapterSpec, DraftAdapter
from shared.model.split import InputSubmodel
from tophatctl.adapter_training import dataset
from tophatctl.adapter_training.dataset import DistillData, extract_states, sample_user_prompts
from tophatctl.adapter_training.distill import DistillConfig, batch_tensors, train_adapter
from tophatctl.adapter_training.evaluate import evaluate_accept_length, teacher_forced_agreement
from tophatctl.adapter_training.prompts import (
    HELD_OUT_CHAT_PROMPTS,
    debian_packages,
    general_prompts,
    near_held_out,
    training_prompts,
)
from tophatctl.adapter_training.unroll import head_rows, step_mask, step_valid, token_loss, unrolled_forward
from tophatctl.adapter_training.vocab import (
    answer_token_counts,
    choose_size,
    coverage,
    coverage_of,
    coverage_table,
    draft_vocabulary,
    rank_tokens,
    split_coverage_table,
)


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
    ids, shallow, deep, prev, mask, answer_start = batch_tensors(data, [0, 1, 2], m=2)
    for row, seq in enumerate(data.sequences):
        p, n = seq.prompt_len, len(seq.ids)
        assert answer_start[row] == p
        assert mask[row].nonzero().flatten().tolist() == list(range(p, n))
        assert torch.count_nonzero(prev[row, :p]) == 0 and torch.count_nonzero(prev[row, n:]) == 0
        torch.testing.assert_close(prev[row, p:n], seq.deep[p - 1 : n - 1].float())
        torch.testing.assert_close(shallow[row, :n], seq.shallow[1].float())
    *_, prev_deep, _, _ = batch_tensors(data, [0, 1, 2], m=2, prompt_features="deep")  # the what-if
    for row, seq in enumerate(data.sequences):
        n = len(seq.ids)
        assert torch.count_nonzero(prev_deep[row, 0]) == 0
        torch.testing.assert_close(prev_deep[row, 1:n], seq.deep[: n - 1].float())


@pytest.mark.parametrize("spec", [AdapterSpec("hat"), AdapterSpec("feature", mlp=True)], ids=lambda s: s.name)
def test_training_lowers_the_distillation_loss(tiny_checkpoint, spec):
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 12, seed=1), max_m=2), 2, 0.0)
    cfg = DistillConfig(split_layers=2, steps=5, batch_size=4, unroll_steps=2, bf16=False)
    _, short = train_adapter(tiny_checkpoint, data, spec, cfg, progress_every=5)
    _, longer = train_adapter(tiny_checkpoint, data, spec, replace(cfg, steps=30), progress_every=5)
    assert longer["final_loss"] < short["final_loss"]
    assert longer["draft_vocab"]["coverage"] == 1.0  # a tiny vocabulary: every answer token kept
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
    rows = [
        tokenizer.encode(text, add_special_tokens=False) + [eos]
        for text in (HELD_OUT_CHAT_PROMPTS[5], "What's the capital of France?", fine, fine, "Too short here")
    ]
    rows.append(tokenizer.encode("A question that never ends because the budget ran", add_special_tokens=False))
    monkeypatch.setattr(dataset, "_generate", lambda *args, **kwargs: rows)
    assert sample_user_prompts(smollm2, 3, batch_size=len(rows)) == [fine]  # 20 batches tried, one kept


def test_debian_descriptions_parse(tmp_path):
    status = tmp_path / "status"
    status.write_text(
        "Package: foo\nStatus: install ok\nDescription: a foo tool\n it does foo\n .\n and bar\n\n"
        "Package: nodesc\nStatus: install ok\n"
    )
    assert debian_packages(status) == [("foo", "a foo tool it does foo and bar")]
    assert debian_packages(tmp_path / "missing") == []


@pytest.mark.slow
def test_training_prompts_are_the_same_in_every_process():
    """The prompts come out of a set; its iteration order follows the per-process string hash seed."""
    import os
    import subprocess
    import sys

    code = (
        "from tophatctl.adapter_training.prompts import training_prompts as t, general_prompts as g;"
        "print(t(40, seed=3) + g(40, seed=3))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1


# -- the token loss, the unrolled draft steps, the draft vocabulary ------------------------------------


def test_token_loss_is_the_teachers_top_k_over_the_scored_rows(tiny_checkpoint):
    torch.manual_seed(0)
    hidden = tiny_checkpoint.hidden_size
    student, teacher = torch.randn(6, hidden), torch.randn(6, hidden)
    vocab = torch.tensor([5, 0, 17, 3, 99, 42, 7, 150])
    rows = head_rows(tiny_checkpoint, vocab)
    loss = token_loss(tiny_checkpoint, student, teacher, rows, top_k=3)
    # by hand: the head's rows of the draft vocabulary, the teacher's 3 best of them, renormalised
    head = tiny_checkpoint.model.lm_head.weight[vocab]  # [8, H]
    norm = tiny_checkpoint.model.model.norm
    t_logp = torch.log_softmax(norm(teacher) @ head.T, -1)
    s_logp = torch.log_softmax(norm(student) @ head.T, -1)
    want = 0.0
    for i in range(6):
        best = t_logp[i].argsort(descending=True)[:3]
        p = t_logp[i, best].exp() / t_logp[i, best].exp().sum()
        want -= float((p * s_logp[i, best]).sum()) / 6
    assert torch.isfinite(loss) and abs(float(loss) - want) < 1e-4
    # a teacher row outside its top 3 does not move the loss; top_k=0 is the whole distribution
    assert float(token_loss(tiny_checkpoint, student, teacher, rows, top_k=0)) > 0
    full = token_loss(tiny_checkpoint, student, teacher, head_rows(tiny_checkpoint, None), top_k=0)
    assert torch.isfinite(full)


def test_token_loss_falls_when_the_student_learns(tiny_checkpoint):
    torch.manual_seed(1)
    hidden = tiny_checkpoint.hidden_size
    teacher = torch.randn(16, hidden)
    student = torch.randn(16, hidden, requires_grad=True)
    rows = head_rows(tiny_checkpoint, torch.arange(0, 200, 3))
    optimizer = torch.optim.Adam([student], lr=0.05)
    losses = []
    for _ in range(60):
        loss = token_loss(tiny_checkpoint, student, teacher, rows, top_k=8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.8 * losses[0]


def test_step_mask_reads_exact_context_then_its_own_earlier_drafts():
    # step 2 at position s: step 0's keys up to s-2, step 1's at s-1, its own at s
    mask = step_mask(4, 2).int()
    assert mask.tolist() == [
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
    ]
    assert torch.equal(step_mask(5, 0), torch.ones(5, 5).tril().bool())


def test_unrolled_step_j_is_the_j_th_draft_of_a_round_as_the_device_runs_it(tiny_checkpoint):
    """Step j at position t+j equals drafting at run time: positions up to t cached with exact previous
    deep states, then each draft reading the adapter's own output at the position before."""
    adapter = DraftAdapter(tiny_checkpoint, 2, AdapterSpec("feature", mlp=True)).randomize(3)
    data = DistillData(extract_states(tiny_checkpoint, [(list(range(3, 23)), 6)], max_m=2), 2, 0.0)
    ids, shallow, deep, prev, mask, answer_start = batch_tensors(data, [0], m=2)
    with torch.no_grad():
        outs = unrolled_forward(adapter, shallow, prev, answer_start, steps=3)
    assert len(outs) == 3 and not torch.allclose(outs[1][0, 8], outs[0][0, 8])
    for t in (6, 9, 14):
        cache = adapter.new_cache()
        hidden = adapter(shallow[0, : t + 1], cache, prev[0, : t + 1])[-1:]  # the round's first draft reads exact
        torch.testing.assert_close(outs[0][0, t], hidden[0], atol=1e-4, rtol=1e-4)
        for j in (1, 2):
            hidden = adapter(shallow[0, t + j : t + j + 1], cache, hidden)  # reads its own previous output
            torch.testing.assert_close(outs[j][0, t + j], hidden[0], atol=1e-4, rtol=1e-4)
    hat = DraftAdapter(tiny_checkpoint, 2, AdapterSpec("hat", mlp=True))
    assert len(unrolled_forward(hat, shallow, None, answer_start, steps=3)) == 1  # nothing of its own to read
    assert step_valid(answer_start, 20, 2)[0].nonzero().min() == 8


def test_draft_vocabulary_ranks_answer_tokens_and_measures_coverage():
    seqs = [
        SimpleNamespace(ids=torch.tensor([9, 9, 1, 1, 1, 2, 2, 3]), prompt_len=2),  # answer 1 1 1 2 2 3
        SimpleNamespace(ids=torch.tensor([4, 3, 2, 5]), prompt_len=1),  # answer 3 2 5
        SimpleNamespace(ids=torch.tensor([8, 1, 6]), prompt_len=1),  # answer 1 6
    ]
    counts = answer_token_counts(seqs)
    assert counts == {1: 4, 2: 3, 3: 2, 5: 1, 6: 1}  # the prompts' 9s, 4 and 8 are not counted
    ranked = rank_tokens(counts, always=[0])
    assert ranked == [0, 1, 2, 3, 5, 6]  # ties: the smaller id first; the end of turn leads
    assert coverage(counts, ranked, 3) == 7 / 11 and coverage(counts, ranked, 6) == 1.0
    assert coverage_table(counts, ranked, (1, 2, 4)) == {"1": 0.0, "2": round(4 / 11, 5), "4": round(9 / 11, 5)}
    # out of sample: ranked on sequences 0 + 2 (1 1 1 1 2 2 3 6 -> 1, 2, 3, 6), counted on 1 (3 2 5), and
    # ranked on 1 (3 2 5 -> 2, 3, 5), counted on 0 + 2; pooled over the 11 tokens
    split = split_coverage_table(seqs, (1, 2, 3))
    assert split == {"1": round((0 + 2) / 11, 5), "2": round((1 + 3) / 11, 5), "3": round((2 + 3) / 11, 5)}
    assert choose_size(split, 0.3, vocab_size=100) == 2 and choose_size(split, 0.9, vocab_size=100) == 3
    assert choose_size(split, 0.3, vocab_size=2) == 1  # never the whole vocabulary
    ids, report = draft_vocabulary(seqs, 0.3, eos_token_id=0, vocab_size=10, sizes=(1, 2, 3))
    assert ids.tolist() == [0, 1] and report["size"] == 2 and report["coverage"] == round(4 / 11, 5)
    assert report["coverage_out_of_sample"] == split["2"] and report["answer_tokens"] == 11
    assert coverage_of(seqs[:1], torch.tensor([1, 3])) == 4 / 6


def test_teacher_forced_agreement_counts_each_draft_steps_positions(tiny_checkpoint):
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 4, seed=2), max_m=2), 2, 0.0)
    adapter = DraftAdapter(tiny_checkpoint, 2, AdapterSpec("feature", mlp=True))
    result = teacher_forced_agreement(tiny_checkpoint, adapter, data, steps=3)
    answers = sum(len(s.ids) - s.prompt_len for s in data.sequences)
    assert result["positions"] == answers and len(result["by_step"]) == 3
    assert all(0 <= a <= 1 for a in result["by_step"] if a is not None)


def test_the_draft_vocabulary_counts_chat_answers_not_teacher_forced_passages(smollm2):
    prompt = dataset.user_prompt_ids(smollm2, "Can you name a few rivers in Europe?")
    chat = SimpleNamespace(ids=torch.tensor(prompt + [5, 6]), prompt_len=len(prompt))
    passage = SimpleNamespace(ids=torch.tensor(list(range(100, 140))), prompt_len=8)
    assert dataset.chat_answers(smollm2, [chat, passage]) == [chat]


def test_unrolled_steps_on_the_rows_that_matter_only_give_the_same_outputs(tiny_checkpoint):
    adapter = DraftAdapter(tiny_checkpoint, 2, AdapterSpec("feature", mlp=True)).randomize(4)
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 3, seed=5), max_m=2), 2, 0.0)
    ids, shallow, deep, prev, mask, answer_start = batch_tensors(data, [0, 1, 2], m=2)
    lengths = torch.tensor([len(s.ids) for s in data.sequences])
    with torch.no_grad():
        dense = unrolled_forward(adapter, shallow, prev, answer_start, steps=3)
        sparse = unrolled_forward(adapter, shallow, prev, answer_start, steps=3, lengths=lengths)
    for j in range(3):
        rows = mask & step_valid(answer_start, ids.shape[1], j)  # the positions each step's loss reads
        torch.testing.assert_close(sparse[j][rows], dense[j][rows], atol=1e-5, rtol=1e-5)


def test_a_time_budget_fits_the_schedule_to_the_measured_step_time():
    from tophatctl.adapter_training.distill import BUDGET_PROBE_STEPS, is_budget_probe, planned_steps

    cfg = DistillConfig(steps=5000, time_budget_s=100.0)
    assert planned_steps(cfg, 0.05) == BUDGET_PROBE_STEPS + 2000  # 100 s at 50 ms a step, after the probe
    assert planned_steps(cfg, 0.05, spent=40.0) == BUDGET_PROBE_STEPS + 1200  # what the probe spent is gone
    assert planned_steps(cfg, 0.001) == 5000  # never more than asked for
    assert planned_steps(cfg, 200.0) == BUDGET_PROBE_STEPS  # never fewer than the steps already run
    assert planned_steps(cfg, 0.05, spent=500.0) == BUDGET_PROBE_STEPS
    assert planned_steps(replace(cfg, time_budget_s=0.0), 0.05) == 5000  # no budget: the steps asked for
    # later plans count the steps already run and the time already spent
    assert planned_steps(cfg, 0.05, spent=20.0, done=960) == 960 + 1600
    assert planned_steps(cfg, 0.01, spent=20.0, done=960) == 5000
    assert planned_steps(cfg, 0.05, spent=60.0, done=960) == 960 + 800
    # it plans again at each doubling, so a slow start (a GPU's) does not fix the schedule
    assert [s for s in range(2000) if is_budget_probe(s)] == [30, 60, 120, 240, 480, 960, 1920]
    with pytest.raises(ValueError, match="time_budget_s"):
        DistillConfig(time_budget_s=-1.0)


def test_a_budgeted_training_runs_the_steps_it_planned(tiny_checkpoint):
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 8, seed=2), max_m=2), 2, 0.0)
    cfg = DistillConfig(split_layers=2, steps=10_000, batch_size=4, unroll_steps=1, bf16=False, time_budget_s=1e-6)
    _, report = train_adapter(tiny_checkpoint, data, AdapterSpec("hat"), cfg, progress_every=10)
    assert report["steps_run"] == 30  # the probe's steps: the budget was spent before it ended
    assert report["device"] == "cpu"


def test_an_adapter_file_is_measured_again_where_it_lands(tiny_checkpoint, tmp_path, monkeypatch):
    from tophatctl.adapter_training import run

    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 8, seed=3), max_m=2), 2, 0.0)
    cfg = DistillConfig(split_layers=2, steps=3, batch_size=4, unroll_steps=1, bf16=False)
    adapter, report = train_adapter(tiny_checkpoint, data, AdapterSpec("feature", mlp=True), cfg, progress_every=3)
    path = tmp_path / "draft_adapter.safetensors"
    adapter.save(path, extra_metadata=report)
    held_out = DistillData(
        extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 3, seed=4), max_m=2), 2, 0.0
    )
    monkeypatch.setattr(run, "load_or_build_held_out", lambda checkpoint, m: held_out)
    measured = run.evaluate_adapter_file(tiny_checkpoint, path, eval_prompts=0)
    assert measured["teacher_forced"]["sequences"] == 3
    assert measured["steps_run"] == 3  # the training's own report is kept
    saved = json.loads((tmp_path / "adapter_report.json").read_text())
    assert saved["teacher_forced"] == measured["teacher_forced"]
    again = DraftAdapter.load(path, tiny_checkpoint, 2)  # the re-saved file still loads, with its vocabulary
    assert torch.equal(again.draft_vocab, adapter.draft_vocab)


def test_accept_lengths_per_round_for_chains_and_trees_with_the_rows_they_sent(demo_checkpoint):
    from tests.conftest import DEMO_MODEL_DIR

    adapter = DraftAdapter.load(DEMO_MODEL_DIR / "draft_adapter.safetensors", demo_checkpoint, 2)
    prompts = list(HELD_OUT_CHAT_PROMPTS[:2])
    for nodes in (0, 8):
        report = evaluate_accept_length(demo_checkpoint, adapter, prompts, max_new_tokens=16, tree_nodes=nodes)
        by_rows = report["by_rows"]
        assert sum(sum(counts.values()) for counts in by_rows.values()) == report["rounds"]
        assert {r: sum(c.values()) for r, c in by_rows.items()} == report["rows_distribution"]
        tokens: dict[int, int] = {}
        for rows, counts in by_rows.items():
            assert max(counts) <= rows  # a round yields at most the rows it sent (the root's token + drafts)
            for n, count in counts.items():
                tokens[n] = tokens.get(n, 0) + count
        assert tokens == report["distribution"]
        assert max(report["rows_distribution"]) <= (nodes + 1 if nodes else 9)  # a tree's nodes, a chain's K = 8
        assert ("tree_nodes" in report) == (nodes > 0) and ("full_accept_rate" in report) == (nodes == 0)


def test_training_goes_on_from_an_adapter_file_with_its_draft_vocabulary(tiny_checkpoint, tmp_path):
    data = DistillData(extract_states(tiny_checkpoint, _random_sequences(tiny_checkpoint, 8, seed=5), max_m=2), 2, 0.0)
    spec = AdapterSpec("feature", mlp=True)
    cfg = DistillConfig(split_layers=2, steps=6, batch_size=4, unroll_steps=2, bf16=False)
    first, report = train_adapter(tiny_checkpoint, data, spec, cfg, progress_every=3)
    first.set_draft_vocab(first.draft_vocab[: max(2, first.draft_vocab.numel() // 2)])  # unlike this data's own
    path = tmp_path / "first.safetensors"
    first.save(path, extra_metadata=report)

    again, again_report = train_adapter(
        tiny_checkpoint, data, spec, replace(cfg, steps=1, learning_rate=1e-12, init_adapter=str(path)), 1
    )
    assert torch.equal(again.draft_vocab, first.draft_vocab)  # kept, not chosen again from the data
    for name, weight in first.state_dict().items():  # one step at a vanishing rate: the file's weights
        assert torch.allclose(again.state_dict()[name], weight, atol=1e-6), name
    assert again_report["draft_vocab"]["initial_adapter"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert again_report["config"]["init_adapter"] == str(path)

    moved, _ = train_adapter(tiny_checkpoint, data, spec, replace(cfg, steps=4, init_adapter=str(path)), 2)
    assert any(not torch.equal(moved.state_dict()[k], w) for k, w in first.state_dict().items())
    with pytest.raises(AdapterError, match="feature\\+mlp adapter"):
        train_adapter(tiny_checkpoint, data, AdapterSpec("feature"), replace(cfg, init_adapter=str(path)))
    with pytest.raises(AdapterError, match="not found"):
        train_adapter(tiny_checkpoint, data, spec, replace(cfg, init_adapter=str(tmp_path / "none.safetensors")))


def test_another_data_seed_samples_its_questions_from_other_generator_seeds(monkeypatch):
    seeds = []

    def fake_generate(checkpoint, rows, *args, **kwargs):
        seeds.append(torch.initial_seed())
        return []  # nothing finished: every batch is tried

    monkeypatch.setattr(dataset, "_generate", fake_generate)
    monkeypatch.setattr(dataset, "_user_turn_prefix", lambda checkpoint: [1])
    fake = SimpleNamespace(eos_token_id=0)
    sample_user_prompts(fake, 4, seed=0, batch_size=4)
    first = set(seeds)
    seeds.clear()
    sample_user_prompts(fake, 4, seed=1, batch_size=4)
    assert len(first) == len(seeds) == 40 and not first & set(seeds)
    assert min(first) == 0  # seed 0 keeps the generator seeds (and prompts) it always had


def test_data_of_self_written_questions_alone_needs_no_docs_part(monkeypatch):
    from tophatctl.adapter_training import run

    made = []
    monkeypatch.setattr(run, "has_chat_template", lambda tokenizer: True)
    monkeypatch.setattr(run, "_part", lambda checkpoint, name, *args: made.append(name) or DistillData([], 2, 1.0))
    cfg = run.DataConfig(prompts=0, texts=0, general=0, self_written=8, seed=3)
    assert run.load_or_build_data(SimpleNamespace(tokenizer=None), cfg).build_seconds == 1.0
    assert made == ["self-p8"]
    with pytest.raises(ValueError, match="all four counts are 0"):
        run.load_or_build_data(SimpleNamespace(tokenizer=None), replace(cfg, self_written=0))
