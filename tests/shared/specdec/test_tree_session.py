"""Draft trees through a device session (shared/specdec/tree_drafting.py): greedy output equals the unsplit
model token for token, sampled output has the target's distribution, both caches keep only the accepted
path, the cloud is told which rows to keep, and a session that loses its cloud mid-tree finishes alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from shared.model.adapter import AdapterSpec, DraftAdapter
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from tests.stat_tools import assert_matches, exact_marginals

TREES = [
    DraftConfig(max_draft=4, tree_nodes=8, tree_width=2),
    DraftConfig(max_draft=6, tree_nodes=24, tree_width=4, tree_min_prob=0.0),
    DraftConfig(max_draft=1, tree_nodes=3, tree_width=3),  # one level: siblings only
]


def _device(checkpoint, variant: str = "hat", seed: int = 0, vocab: list[int] | None = None) -> DeviceModel:
    adapter = DraftAdapter(checkpoint, 2, AdapterSpec(variant, mlp=variant == "feature")).randomize(seed)
    if vocab is not None:
        adapter.set_draft_vocab(vocab)
    return DeviceModel.from_checkpoint(checkpoint, 2, adapter)


def _identity_adapter_device(checkpoint) -> DeviceModel:
    """An adapter as built (the first middle layer, passing h through): drafts the target agrees with often,
    so paths deeper than one level get accepted."""
    return DeviceModel.from_checkpoint(checkpoint, 2, DraftAdapter(checkpoint, 2))


def _check_caches_every_round(session: DeviceSession) -> None:
    """After each verdict both device caches hold the prompt and every emitted token but the pending one."""
    on_verify_result = session.on_verify_result

    def checked(draft, deep, branches=()):
        emitted = on_verify_result(draft, deep, branches)
        if not session.is_finished:
            assert session.commit_len == len(session.prompt_ids) + len(session.generated) - 1
            assert session.adapter_cache is not None and session.adapter_cache.length == session.commit_len
        return emitted

    session.on_verify_result = checked


@pytest.mark.parametrize(
    "config,variant",
    [(TREES[0], "hat"), (TREES[1], "feature"), (TREES[2], "feature")],
    ids=["w2", "w4-deep", "siblings"],
)
def test_greedy_trees_are_token_identical(tiny_checkpoint, config, variant):
    ids = list(range(3, 17))
    expected = generate_full(tiny_checkpoint, ids, 24).token_ids
    for device in (_device(tiny_checkpoint, variant), _identity_adapter_device(tiny_checkpoint)):
        session = DeviceSession(device, ids, draft_config=config, max_new_tokens=24)
        _check_caches_every_round(session)
        result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(tiny_checkpoint, 2)), chunk_size=5))
        assert result.token_ids == expected


def test_a_tree_accepts_more_than_its_chain(tiny_llama_dir):
    """With the same adapter, a tree's rounds emit more tokens on average than a chain's (it holds the
    chain's path among others), so the same answer takes fewer rounds."""
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    device = _identity_adapter_device(checkpoint)
    ids = list(range(5, 30))
    rounds = {}
    for name, config in {"chain": DraftConfig(eta=0.0, max_draft=4), "tree": TREES[1]}.items():
        session = DeviceSession(device, ids, draft_config=config, max_new_tokens=24)
        result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(checkpoint, 2))))
        rounds[name] = result.num_rounds
    assert rounds["tree"] < rounds["chain"], rounds


def _recording(draft, drafted: list[int]):
    """draft, keeping every token it drafts in drafted."""

    def recording_draft():
        made = draft()
        drafted.extend(made.tokens)
        return made

    return recording_draft


def test_truncated_draft_vocabulary_stays_token_identical(tiny_checkpoint):
    """The draft scores a subset; the full head judges the cloud's states, so greedy output is unchanged."""
    ids = list(range(3, 17))
    expected = generate_full(tiny_checkpoint, ids, 20).token_ids
    vocab = list(range(0, tiny_checkpoint.vocab_size, 3))
    for config in (DraftConfig(max_draft=4), TREES[0]):
        session = DeviceSession(_device(tiny_checkpoint, vocab=vocab), ids, draft_config=config, max_new_tokens=20)
        drafted: list[int] = []
        session.draft = _recording(session.draft, drafted)
        result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(tiny_checkpoint, 2))))
        assert result.token_ids == expected
        assert drafted and all(token % 3 == 0 for token in drafted)  # drafts only ever come from the subset


class RecordingCloud(LocalCloud):
    """The in-process cloud, keeping every verify's layout (trees and the rows kept of the last one)."""

    def __init__(self, middle):
        super().__init__(middle)
        self.layouts = []

    async def verify(self, session_id, commit_len, shallow, layout=None):
        self.layouts.append((commit_len, shallow.shape[0], layout))
        return await super().verify(session_id, commit_len, shallow, layout)


def test_the_cloud_keeps_only_the_accepted_path(tiny_checkpoint):
    ids = list(range(3, 17))
    cloud = RecordingCloud(MiddleSubmodel(tiny_checkpoint, 2))
    session = DeviceSession(_identity_adapter_device(tiny_checkpoint), ids, draft_config=TREES[1], max_new_tokens=24)
    asyncio.run(generate(session, cloud))
    trees = [layout for _, _, layout in cloud.layouts if layout is not None and layout.parents is not None]
    assert trees, "no round drafted a tree"
    moved = [(commit, layout.kept) for commit, _, layout in cloud.layouts if layout is not None and layout.kept]
    for commit_len, kept in moved:  # rows move down to the positions right below commit_len
        assert kept[0] >= commit_len - len(kept) and list(kept) == sorted(set(kept))
    for (commit_len, rows, layout), (next_commit, _, _) in zip(cloud.layouts, cloud.layouts[1:]):
        if layout is not None and layout.parents is not None:
            assert len(layout.parents) == rows - 1
            assert commit_len < next_commit <= commit_len + rows  # the root and an accepted path


@pytest.mark.slow
def test_sampled_trees_have_the_target_distribution(tiny_llama_dir):
    """The first three tokens' marginals match the target's exactly summed ones: token 1 comes from the
    prefill, tokens 2 and 3 from tree rounds whose drafts are rejected at every depth in some runs and
    accepted in others."""
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    ids = [7, 1, 4]
    params = SamplingParams(temperature=0.5, top_p=0.3)
    # m = 3 of 5 layers with a fresh adapter: drafts agree with the target sometimes, not always
    adapter = DraftAdapter(checkpoint, 3)
    device = DeviceModel.from_checkpoint(checkpoint, 3, adapter)
    device.eos_token_id = None  # the exact marginals do not stop at EOS
    cloud = LocalCloud(MiddleSubmodel(checkpoint, 3))
    # growing stops early where the best path drops below 0.1: a quarter of the first trees stop at depth 1,
    # so the tree's depth depends on the draws (with 4 new tokens the first round may draft 2 levels)
    config = DraftConfig(max_draft=2, tree_nodes=5, tree_width=2, tree_min_prob=0.1)
    runs = 1500
    counts = np.zeros((3, checkpoint.vocab_size))
    accepted_depths, tree_depths = np.zeros(3, dtype=int), np.zeros(3, dtype=int)
    for seed in range(runs):
        session = DeviceSession(device, ids, SamplingParams(0.5, 0.3, seed), config, 4)
        result = asyncio.run(generate(session, cloud, session_id=seed + 1))
        for position in range(3):
            counts[position, result.token_ids[position]] += 1
        tree_depths[session.verdicts[0][0]] += 1
        accepted_depths[session.verdicts[0][1]] += 1
    for position, probs in enumerate(exact_marginals(checkpoint, ids, params, 3)):
        assert_matches(counts[position], probs)
    assert (accepted_depths > runs // 50).all(), accepted_depths  # rejected at the root, at depth 1, and not
    assert tree_depths[1] > runs // 20 and tree_depths[2] > runs // 20, tree_depths  # growing stopped early or not


def test_losing_the_cloud_mid_tree_finishes_on_the_device(tiny_checkpoint):
    class LostCloud(LocalCloud):
        calls = 0

        async def verify(self, session_id, commit_len, shallow, layout=None):
            self.calls += 1
            if self.calls > 2:
                raise ConnectionError("verifier gone")
            return await super().verify(session_id, commit_len, shallow, layout)

    ids = list(range(3, 17))
    session = DeviceSession(_device(tiny_checkpoint), ids, draft_config=TREES[0], max_new_tokens=16)
    cloud = LostCloud(MiddleSubmodel(tiny_checkpoint, 2))
    result = asyncio.run(generate(session, cloud, finish_alone_on=lambda exc: isinstance(exc, ConnectionError)))
    assert len(result.token_ids) == 16 and session.degraded


def test_bad_layouts_are_refused_by_the_in_process_cloud(tiny_checkpoint):
    from shared.specdec.verify_layout import VerifyLayout

    cloud = LocalCloud(MiddleSubmodel(tiny_checkpoint, 2))
    hidden = torch.randn(4, tiny_checkpoint.hidden_size)

    async def run():
        await cloud.open(1)
        await (await cloud.send_prefill(1, 0, torch.randn(5, tiny_checkpoint.hidden_size), True))
        for layout in (VerifyLayout((0, 0)), VerifyLayout((0, 2, 1)), VerifyLayout(None, (2, 3))):
            with pytest.raises(ValueError):
                await cloud.verify(1, 5, hidden, layout)
        assert cloud.caches[1].length == 5  # nothing was appended or moved

    asyncio.run(run())


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"]
)
def test_a_tree_drafted_by_the_target_itself_is_accepted_to_full_depth(tiny_checkpoint, params):
    """With the middle as its own draft, every round accepts a whole root-to-leaf path of the tree's depth:
    a tree mask, a position or a kept row out of place on either side would make some round stop short."""
    from tests.shared.specdec.test_engine import MiddleAsDraft

    device = DeviceModel.from_checkpoint(tiny_checkpoint, 2, MiddleAsDraft(MiddleSubmodel(tiny_checkpoint, 2)))
    device.eos_token_id = None  # run the whole budget
    config = DraftConfig(max_draft=3, tree_nodes=21, tree_width=3, tree_min_prob=0.0)  # every node grown is kept
    session = DeviceSession(device, [3, 4, 5], params, config, 33)
    cloud = RecordingCloud(MiddleSubmodel(tiny_checkpoint, 2))
    result = asyncio.run(generate(session, cloud, chunk_size=2))
    assert result.accept_lengths == [4] * 8  # 3 levels accepted + the bonus, every round
    assert any(layout is not None and layout.kept for _, _, layout in cloud.layouts)  # paths not in place moved
    if params.is_greedy:
        assert result.token_ids == generate_full(tiny_checkpoint, [3, 4, 5], 33).token_ids


def test_a_greedy_tree_expands_only_paths_likely_enough_and_stays_token_identical(tiny_checkpoint):
    """Each expanded node costs a row through the input layers, the adapter and the draft head: a greedy tree
    grows only nodes whose path's draft probability reaches tree_min_prob, and its output does not move."""
    import math

    ids = list(range(3, 17))
    expected = generate_full(tiny_checkpoint, ids, 24).token_ids
    probabilities = {}
    for bar in (0.0, 0.02):  # the tiny model's paths: ~1e-8 .. ~0.07
        config = DraftConfig(max_draft=6, tree_nodes=24, tree_width=4, tree_min_prob=bar)
        session = DeviceSession(_identity_adapter_device(tiny_checkpoint), ids, draft_config=config, max_new_tokens=24)
        expand, expanded = session._expand, []

        def recorded(tree, nodes, round_start, expand=expand, expanded=expanded):
            expanded.extend(math.exp(tree.log_q[node]) for node in nodes if node != 0)
            return expand(tree, nodes, round_start)

        session._expand = recorded
        result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(tiny_checkpoint, 2)), chunk_size=5))
        assert result.token_ids == expected
        probabilities[bar] = expanded
    assert min(probabilities[0.0]) < 0.02  # without the bar, unlikely paths are grown too
    assert probabilities[0.02] and min(probabilities[0.02]) >= 0.02


def test_a_trial_round_drafts_one_round_in_its_shape_then_the_session_s_own(tiny_checkpoint):
    from shared.specdec.trial_round import TrialRound

    ids = list(range(3, 17))
    expected = generate_full(tiny_checkpoint, ids, 24).token_ids
    chain, tree = DraftConfig(max_draft=4), DraftConfig(max_draft=4, tree_nodes=8, tree_width=2, tree_min_prob=0.0)
    session = DeviceSession(_identity_adapter_device(tiny_checkpoint), ids, draft_config=chain, max_new_tokens=24)
    session.trial = TrialRound("tree8", tree)
    draft, shapes = session.draft, []

    def recorded():
        made = draft()
        shapes.append("tree" if made.layout is not None and made.layout.parents is not None else "chain")
        return made

    session.draft = recorded
    result = asyncio.run(generate(session, LocalCloud(MiddleSubmodel(tiny_checkpoint, 2)), chunk_size=5))
    assert result.token_ids == expected
    assert shapes[0] == "tree" and set(shapes[1:]) == {"chain"} and session.draft_config is chain
    accept, rows, draft_s = session.trial.measured(session.accept_lengths, session.round_rows)
    assert (accept, rows) == (session.accept_lengths[0], session.round_rows[0]) and rows > 2 and draft_s > 0
