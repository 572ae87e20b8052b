"""SmolLM2 at int4 and int8, on real chat prompts: the split runner's logits are the unsplit model's, bit for bit.

Quantized matmuls once rounded their inputs to bfloat16, so attention whose last bits depended on how many
rows a pass holds changed greedy answers where two logits are close (12 of 24 held-out chat prompts at int4);
any rounding of their inputs (int16 rows now) can still turn a near tie. Quantized models run batch-invariant
attention (shared/model/invariant_attention.py) in HF's forward and in the runner alike, so:
- the unsplit model scoring a whole answer in one pass gives the logits it gave decoding it row by row;
- the split halves (device layers, cloud layers, head) verifying many rows per pass, as a chain or as
  tree nodes, give those same logits;
- HAT rounds with the committed adapter, chains and trees, answer exactly the unsplit model's greedy answer.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel, SplitModel
from shared.model.tree_rows import TreeRows, ancestor_mask_from_parents
from shared.runtime import build_device_model
from shared.specdec.decode_loop import LocalCloud, generate
from shared.specdec.device_session import DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from tophatctl.adapter_training.dataset import user_prompt_ids
from tophatctl.adapter_training.prompts import HELD_OUT_CHAT_PROMPTS
from tophatctl.models import resolve_model

M = 2  # the committed adapter's split
NEW_TOKENS = 32
PROMPTS = 3  # the first held-out chat prompts whose answers run the whole NEW_TOKENS


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request):
    checkpoint = load_checkpoint(resolve_model("smollm2"), quantize=request.param)
    prompts, answers = [], []
    for prompt in HELD_OUT_CHAT_PROMPTS:
        ids = user_prompt_ids(checkpoint, prompt)
        answer = generate_full(checkpoint, ids, NEW_TOKENS).token_ids
        if len(answer) == NEW_TOKENS:
            prompts.append(ids)
            answers.append(answer)
        if len(prompts) == PROMPTS:
            break
    assert len(prompts) == PROMPTS
    logits = [stepwise_logits(checkpoint, ids, answer) for ids, answer in zip(prompts, answers)]
    return checkpoint, prompts, answers, logits


@torch.inference_mode()
def stepwise_logits(checkpoint, ids: list[int], answer: list[int]) -> torch.Tensor:
    """[N, V]: the logits each answer token was chosen from, decoding one row per pass (as generate_full)."""
    out = checkpoint.model(input_ids=torch.tensor([ids]), use_cache=True)
    rows = [out.logits[0, -1]]
    for token in answer[:-1]:
        out = checkpoint.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def test_the_unsplit_model_scores_an_answer_in_one_pass_as_it_decoded_it(quantized):
    checkpoint, prompts, answers, logits = quantized
    for ids, answer, expected in zip(prompts, answers, logits):
        assert expected.argmax(-1).tolist() == answer  # the logits generate_full chose from
        with torch.inference_mode():
            one_pass = checkpoint.model(input_ids=torch.tensor([ids + answer])).logits[0].float()
        assert torch.equal(one_pass[len(ids) - 1 : -1], expected)


def test_the_split_runner_verifies_chains_and_trees_with_the_unsplit_logits(quantized):
    checkpoint, prompts, answers, logits = quantized
    split = SplitModel.from_checkpoint(checkpoint, M)

    def run(tokens: list[int], shallow_cache, deep_cache, tree: TreeRows | None = None) -> torch.Tensor:
        shallow = split.input(torch.tensor(tokens), shallow_cache, tree)
        trees = None if tree is None else [tree]
        return split.output(split.middle.forward_packed(shallow, [deep_cache], [len(tokens)], trees))

    for ids, answer, expected in zip(prompts, answers, logits):  # expected[k]: the logits answer[k] came from
        shallow_cache, deep_cache = split.input.new_cache(), split.middle.new_cache()
        # the prompt and 8 answer tokens in one pass, the next 8 as one verified chain
        first = run(ids + answer[:8], shallow_cache, deep_cache)
        chain = run(answer[8:16], shallow_cache, deep_cache)
        assert torch.equal(torch.cat([first[len(ids) - 1 :], chain])[:16], expected[:16])
        # answer[16..21] as one branch of a tree with a wrong sibling beside it at every depth (drawn first,
        # so the path's ancestors are not contiguous rows of the cache)
        path = answer[16:22]
        tokens, parents = [path[0]], [-1]
        for depth, token in enumerate(path[1:], start=1):
            tokens += [(token + 1) % checkpoint.config.vocab_size, token]
            parents += [0 if depth == 1 else 2 * depth - 2] * 2
        tree = TreeRows.for_new_tree(len(ids) + 16, ancestor_mask_from_parents(parents))
        tree_logits = run(tokens, shallow_cache, deep_cache, tree)
        on_path = [0] + [2 * depth for depth in range(1, len(path))]
        assert torch.equal(tree_logits[on_path], expected[17:23])


@pytest.mark.parametrize(
    "config",
    [DraftConfig(eta=0.0, max_draft=4), DraftConfig(max_draft=4, tree_nodes=12, tree_width=3)],
    ids=["chain", "tree"],
)
def test_hat_with_the_committed_adapter_answers_the_unsplit_greedy_answer(quantized, config):
    checkpoint, prompts, answers, _ = quantized
    device = build_device_model(checkpoint, M, None)
    cloud = MiddleSubmodel(checkpoint, M)
    for ids, answer in zip(prompts, answers):
        session = DeviceSession(device, ids, SamplingParams(), config, NEW_TOKENS)
        result = asyncio.run(generate(session, LocalCloud(cloud)))
        assert result.token_ids == answer
