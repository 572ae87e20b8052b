"""Separate rejection sampling: the cloud sees q(x_i) only, the device resamples the correction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.specdec.separate_rejection import (
    SeparateRejectionShapeError,
    accepted_prefix_length,
    correction_distribution,
    correction_token,
    downlink_bytes,
    make_payload,
    residual_tv_distance,
    uplink_bytes,
    verify_drafts,
)
from tests.stat_tools import assert_samples_follow

VOCAB = 8
TRIALS = 30_000


def random_dist(generator: torch.Generator, zero_mask: list[int] = ()) -> torch.Tensor:
    probs = torch.rand(VOCAB, generator=generator) + 0.05
    probs[list(zero_mask)] = 0.0
    return probs / probs.sum()


def first_tokens_of_rounds(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> tuple[np.ndarray, float]:
    """The first token each of `trials` independent rounds emits (accepted draft or correction), downlink
    "full"; vectorised over trials with the module's own accept rule and correction distribution."""
    # p: [k+1, V] target rows, q: [k, V] draft rows (position-dependent toy model)
    generator = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    drafted = torch.stack(
        [torch.multinomial(q[i], trials, replacement=True, generator=generator) for i in range(k)], -1
    )  # [T, k]
    positions = torch.arange(k)
    p_of_drafted = p[positions, drafted]  # [T, k]
    q_of_drafted = q[positions, drafted]  # [T, k]
    uniforms = torch.rand(trials, k, generator=generator)  # [T, k]
    num_accepted = accepted_prefix_length(p_of_drafted, q_of_drafted, uniforms)  # [T]
    first = drafted[:, 0].clone()  # [T]
    rejected_first = num_accepted == 0  # [T]
    # Every round rejected at position 0 gets the same payload (p[0] in full), so one residual serves all.
    residual = correction_distribution(make_payload(p[0], 0, "full"), q[0])  # [V]
    num_rejected = int(rejected_first.sum())
    if num_rejected:  # draft == target: nothing is ever rejected
        first[rejected_first] = torch.multinomial(residual, num_rejected, replacement=True, generator=generator)
    return first.numpy(), float(num_accepted.float().mean()) / k


@pytest.mark.parametrize("case", ["draft_equals_target", "random_draft", "draft_mass_where_target_has_none"])
def test_full_downlink_emits_the_target_distribution(case):
    generator = torch.Generator().manual_seed(7)
    k = 3
    if case == "draft_equals_target":
        p = torch.stack([random_dist(generator) for _ in range(k + 1)])
        q = p[:k].clone()
    elif case == "random_draft":
        p = torch.stack([random_dist(generator) for _ in range(k + 1)])
        q = torch.stack([random_dist(generator) for _ in range(k)])
    else:
        p = torch.stack([random_dist(generator, zero_mask=[0, 1, 2]) for _ in range(k + 1)])
        q = torch.stack([random_dist(generator, zero_mask=[5, 6, 7]) for _ in range(k)])
        q[:, :3] *= 5.0  # most of the draft's mass where the target has none
        q = q / q.sum(-1, keepdim=True)
    samples, acceptance = first_tokens_of_rounds(p, q, TRIALS, seed=11)
    assert_samples_follow(samples, p[0])
    if case == "draft_equals_target":
        assert acceptance == 1.0
    else:
        assert 0.0 < acceptance < 0.9


def test_the_round_functions_themselves_emit_the_target_distribution():
    """The per-round API end to end (verify_drafts on the cloud, correction_token on the device)."""
    generator = torch.Generator().manual_seed(3)
    p = torch.stack([random_dist(generator, zero_mask=[4]) for _ in range(3)])  # [k+1, V]
    q = torch.stack([random_dist(generator) for _ in range(2)])  # [k, V]
    samples = np.zeros(6_000, dtype=np.int64)
    for trial in range(len(samples)):
        drafted = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(2)]
        verdict = verify_drafts(p, drafted, q[[0, 1], drafted], generator, downlink="full")
        if verdict.num_accepted > 0:
            samples[trial] = drafted[0]
        else:
            samples[trial] = correction_token(verdict.rejection, q[0], generator)
    assert_samples_follow(samples, p[0])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 4).flatmap(
        lambda k: st.tuples(
            st.lists(st.lists(st.floats(-20, 20), min_size=VOCAB, max_size=VOCAB), min_size=k + 1, max_size=k + 1),
            st.lists(st.tuples(st.booleans(), st.integers(0, VOCAB - 1)), min_size=k, max_size=k),
        )
    )
)
def test_greedy_is_exactly_the_argmax_rule(logits_and_drafts):
    rows, draft_choices = logits_and_drafts
    p = torch.softmax(torch.tensor(rows), -1)  # [k+1, V]
    argmax = p.argmax(-1).tolist()
    # Each draft copies the target's argmax or is an arbitrary token, so long prefixes do occur.
    drafted = [argmax[i] if copy else other for i, (copy, other) in enumerate(draft_choices)]
    k = len(drafted)
    expected_accepted = 0
    while expected_accepted < k and drafted[expected_accepted] == argmax[expected_accepted]:
        expected_accepted += 1
    verdict = verify_drafts(p, drafted, torch.full((k,), 0.5), None, greedy=True)
    assert verdict.num_accepted == expected_accepted
    if expected_accepted == k:
        assert verdict.bonus_token == argmax[k] and verdict.rejection is None
    else:
        assert verdict.bonus_token is None
        assert verdict.rejection.kind == "token" and verdict.rejection.position == expected_accepted
        assert correction_token(verdict.rejection, torch.full((VOCAB,), 1 / VOCAB), None) == argmax[expected_accepted]
        assert downlink_bytes(verdict.rejection) == 4


def test_top_k_residual_is_exact_when_k_covers_the_vocabulary():
    generator = torch.Generator().manual_seed(2)
    p, q = random_dist(generator), random_dist(generator)
    assert residual_tv_distance(p, q, VOCAB) == pytest.approx(0.0, abs=1e-6)
    assert residual_tv_distance(p, q, VOCAB + 5) == pytest.approx(0.0, abs=1e-6)


def test_top_k_residual_loses_the_mass_outside_the_top_k():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.3, 0.4, 0.3, 0.0])
    # exact residual [0.1, 0, 0, 0.1] -> [0.5, 0, 0, 0.5]; top-2 sees only token 0 -> [1, 0, 0, 0]
    assert residual_tv_distance(p, q, 2) == pytest.approx(0.5, abs=1e-6)
    assert residual_tv_distance(p, q, 4) == pytest.approx(0.0, abs=1e-6)


def test_top_k_residual_with_no_mass_falls_back_to_the_top_k_target():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.6, 0.3, 0.1])  # residual lives only on token 2, outside the top-2
    approx = correction_distribution(make_payload(p, 0, "topk", 2), q)
    assert torch.allclose(approx, torch.tensor([0.625, 0.375, 0.0]))


def test_rejection_payloads_have_the_shapes_and_bytes_of_the_wire():
    vocab = 50
    p = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)), -1)  # [k+1, V]
    drafted = [int(p[0].argmin()), int(p[1].argmax())]
    impossible = torch.tensor([1.0, 1.0])  # q = 1 > p: the argmin draft is rejected almost surely
    generator = torch.Generator().manual_seed(1)
    topk = verify_drafts(p, drafted, impossible, generator).rejection
    assert topk.position == 0 and topk.kind == "topk" and topk.vocab_size == vocab
    assert topk.values.shape == (10,) and topk.values.dtype == torch.float32
    assert topk.indices.shape == (10,) and topk.indices.dtype == torch.int32
    assert torch.equal(topk.values, p[0][topk.indices.long()]) and bool((topk.values.diff() <= 0).all())
    assert downlink_bytes(topk) == 80
    full = verify_drafts(p, drafted, impossible, generator, downlink="full").rejection
    assert full.kind == "full" and torch.equal(full.values, p[0]) and downlink_bytes(full) == 4 * vocab
    assert verify_drafts(p, drafted, impossible, generator, top_k=3).rejection.values.shape == (3,)
    assert uplink_bytes(4) == 32 and uplink_bytes(0) == 0  # under PicoSpec's 50 bytes per round
    assert downlink_bytes(None) == 0


def test_rejection_at_the_last_position_and_bonus_when_all_accepted():
    p = torch.zeros(4, VOCAB)
    p[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0  # a deterministic target: 1, 2, 3, then 4
    sure = torch.full((3,), 0.5)  # p(x) = 1 >= q(x): accepted whatever u is
    generator = torch.Generator().manual_seed(0)
    last = verify_drafts(p, [1, 2, 5], sure, generator)
    assert last.num_accepted == 2 and last.bonus_token is None and last.rejection.position == 2
    assert correction_token(last.rejection, torch.full((VOCAB,), 1 / VOCAB), generator) == 3
    first = verify_drafts(p, [0, 2, 3], sure, generator)
    assert first.num_accepted == 0 and first.rejection.position == 0
    all_in = verify_drafts(p, [1, 2, 3], sure, generator)
    assert all_in.num_accepted == 3 and all_in.bonus_token == 4 and all_in.rejection is None
    empty = verify_drafts(p[:1], [], torch.zeros(0), generator)
    assert empty.num_accepted == 0 and empty.bonus_token == 1


def test_bad_shapes_raise_a_typed_error():
    p = torch.full((3, VOCAB), 1 / VOCAB)
    q2 = torch.full((2,), 0.5)
    bad_calls = [
        lambda: verify_drafts(p[0], [1, 2], q2, None),  # p not [k+1, V]
        lambda: verify_drafts(p, [1], q2[:1], None),  # k+1 rows expected, 3 given
        lambda: verify_drafts(p, [1, 2], q2[:1], None),  # q_drafted not [k]
        lambda: verify_drafts(p, [1, VOCAB], q2, None),  # token outside the vocabulary
        lambda: verify_drafts(p, [1, 2], q2, None, downlink="sparse"),
        lambda: make_payload(p[0], 0, "topk", top_k=0),
        lambda: correction_token(make_payload(p[0], 0, "topk"), torch.ones(VOCAB + 1), None),
        lambda: residual_tv_distance(p[0], torch.ones(VOCAB - 1), 2),
        lambda: uplink_bytes(-1),
    ]
    for call in bad_calls:
        with pytest.raises(SeparateRejectionShapeError):
            call()
    assert issubclass(SeparateRejectionShapeError, ValueError)
