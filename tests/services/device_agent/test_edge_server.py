"""Edge SD's draft server end to end: the real VerifierServer holding the whole target (token mode) on a
loopback WebSocket, the device agent's real client, and EdgeDraftServer batching many users' drafts.

Greedy output must be token-identical to the unsplit model whatever the batching, speculation length and
pipelining; sampled output must have the target's distribution (checked on the first token drawn through a
verification, against its exact marginal computed from the model)."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.edge_server import EdgeConfig, EdgeDraftServer, EdgeRequest
from services.verifier_cloud.token_mode import TokenModel
from shared.edge_sd.runtime import ModelShape, split_model_shapes
from shared.runtime import build_device_model
from shared.specdec.device_session import DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams, logits_to_probs
from shared.specdec.stream_session import StreamSession
from tests.mesh_tools import split_identity, verifier_on_loopback
from tests.stat_tools import assert_samples_follow

M = 2


def shapes(checkpoint) -> tuple[ModelShape, ModelShape]:
    return split_model_shapes(checkpoint.num_layers, checkpoint.hidden_size, checkpoint.config.intermediate_size, M)


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


async def serve(
    checkpoint, device_model, sessions: list[StreamSession], config: EdgeConfig, rounds: int = 1
) -> tuple[list[list[int]], EdgeDraftServer]:
    """Every session through the draft server, `rounds` rounds of equal share; returns each one's tokens."""
    async with verifier_on_loopback(checkpoint, M, token_model=TokenModel(checkpoint, M), full_model=True) as (
        server,
        url,
    ):
        cloud = WebSocketCloud(url, checkpoint.hidden_size, request_timeout_s=30, **split_identity(checkpoint, M))
        edge = EdgeDraftServer(cloud, *shapes(checkpoint), config, asyncio.to_thread)
        runner = asyncio.create_task(edge.run())

        async def one(index: int, session: StreamSession) -> list[int]:
            tokens = []
            async for emitted in edge.generate(EdgeRequest(session, index + 1, snr_db=10.0 + index % 30)):
                tokens += emitted
            return tokens

        per_round = -(-len(sessions) // rounds)
        outputs = []
        try:
            for start in range(0, len(sessions), per_round):
                outputs += await asyncio.wait_for(
                    asyncio.gather(*(one(start + i, s) for i, s in enumerate(sessions[start : start + per_round]))), 120
                )
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await cloud.close_connection()
            await asyncio.sleep(0.05)
        assert not server.scheduler.sessions  # every session closed, its KV freed
    return outputs, edge


@pytest.mark.parametrize(
    "config",
    [
        EdgeConfig(window_s=0.05),  # eq. 27 shares, Algorithm 1 batches, l by eq. 7, pipelined
        EdgeConfig(window_s=0.05, batching="max", spec_len=7),
        EdgeConfig(window_s=0.05, bandwidth="uniform", spec_len=1, pipeline=False),
        # a budget that only fits a few tasks a batch: several batches in flight at once
        EdgeConfig(window_s=0.05, memory_budget_bytes=1, spec_len=3),
    ],
    ids=["edge-sd", "max-batch-l7", "uniform-l1-serial", "small-batches"],
)
@pytest.mark.slow
def test_greedy_output_equals_the_unsplit_model(demo_checkpoint, config):
    device_model = build_device_model(demo_checkpoint, M, None)
    max_new = 20
    batch = prompts(6, demo_checkpoint.vocab_size)
    expected = [generate_full(demo_checkpoint, p, max_new).token_ids for p in batch]
    if config.memory_budget_bytes == 1:  # the draft model's weights plus the KV of two tasks
        draft, _ = shapes(demo_checkpoint)
        config = EdgeConfig(
            window_s=0.05,
            spec_len=3,
            memory_budget_bytes=draft.weight_bytes + 2 * draft.kv_bytes_per_token * (40 + max_new),
        )
    sessions = [StreamSession(device_model, p, SamplingParams(), DraftConfig(0.0, 8), max_new) for p in batch]
    outputs, edge = asyncio.run(serve(demo_checkpoint, device_model, sessions, config))
    assert outputs == expected
    (record,) = edge.rounds
    planned = sorted(i for b in record.plan["batches"] for i in b)
    assert planned == list(range(len(batch)))  # every task in exactly one batch
    if config.batching == "max":
        assert len(record.plan["batches"]) == 1
    if config.memory_budget_bytes < 1 << 30:
        assert len(record.plan["batches"]) >= 3
        assert all(len(b) <= 2 for b in record.plan["batches"])
    if config.spec_len:
        assert record.plan["spec_len"] == config.spec_len
    # every verification round of a step-2+ draft carried exactly l drafts unless the task had no room
    verdicts = [v for s in sessions for v in s.verdicts]
    assert max(d for d, _ in verdicts) == record.plan["spec_len"]
    assert any(a > 0 for _, a in verdicts), "no draft was ever accepted"
    steps = {(e["step"], e["batch"]) for e in record.stages}
    assert all("verify_s" in e for e in record.stages) and (1, 0) in steps


def test_pipelined_rounds_draft_the_next_batch_while_one_is_verified(demo_checkpoint):
    device_model = build_device_model(demo_checkpoint, M, None)
    draft, _ = shapes(demo_checkpoint)
    config = EdgeConfig(
        window_s=0.05, spec_len=4, memory_budget_bytes=draft.weight_bytes + 2 * draft.kv_bytes_per_token * 80
    )
    sessions = [
        StreamSession(device_model, p, SamplingParams(), DraftConfig(0.0, 8), 16)
        for p in prompts(6, demo_checkpoint.vocab_size, seed=1)
    ]
    _, edge = asyncio.run(serve(demo_checkpoint, device_model, sessions, config))
    stages = edge.rounds[0].stages
    # batch m+1's drafting ended before batch m's verification did, somewhere in the round (eq. 20's overlap)
    by_key = {(e["step"], e["batch"]): e for e in stages}
    overlaps = [
        (s, b)
        for (s, b), e in by_key.items()
        if (s, b + 1) in by_key and by_key[(s, b + 1)]["draft_end_s"] < e["verify_end_s"]
    ]
    assert overlaps
    # and every step waits for the step before it (the barrier of eq. 21)
    for (s, _), e in by_key.items():
        before = [x["verify_end_s"] for (s0, _), x in by_key.items() if s0 == s - 1]
        if before:
            assert e["draft_end_s"] - e["draft_s"] >= max(before) - 1e-6


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(tiny_llama_dir):
    """The second token of each answer is the first one a verification decides (accept a draft or sample the
    correction); its marginal over many seeded users must be the target's exact marginal."""
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(tiny_llama_dir)
    device_model = build_device_model(checkpoint, M, "random")
    params = [SamplingParams(1.0, 1.0, seed) for seed in range(1200)]
    prompt = [5, 17, 33, 2, 90]
    sessions = [StreamSession(device_model, prompt, p, DraftConfig(0.0, 8), 2) for p in params]
    outputs, _ = asyncio.run(
        serve(checkpoint, device_model, sessions, EdgeConfig(window_s=0.02, spec_len=3, max_tasks=60), rounds=20)
    )
    eos = checkpoint.eos_token_id
    assert all(len(o) == 2 or o == [eos] for o in outputs)
    with torch.inference_mode():
        model = checkpoint.model
        first = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1].float(), SamplingParams(1.0))  # [V]
        pairs = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = logits_to_probs(model(pairs).logits[:, -1].float(), SamplingParams(1.0))  # [V, V]
    go_on = first.clone()
    if eos is not None:
        go_on[eos] = 0.0  # an answer that began with EOS has no second token
    marginal = (go_on[:, None] * second).sum(0)  # [V], unnormalised: the test normalises
    assert_samples_follow(np.array([o[0] for o in outputs]), first)
    assert_samples_follow(np.array([o[1] for o in outputs if len(o) == 2]), marginal)


@pytest.mark.parametrize(
    "answer",
    [
        {"batches": [[0], [0]], "spec_len": 2, "upload_s": [0.1, 0.1], "sources": {}},  # a task twice, one missing
        {"batches": [[0, 1]], "spec_len": 0, "upload_s": [0.1, 0.1], "sources": {}},
        {"batches": [[0, 1]], "spec_len": 2, "upload_s": [0.1, float("nan")], "sources": {}},
        {"batches": [[0, 1]], "spec_len": 2, "upload_s": [0.1], "sources": {}},
        {"batches": [[0, True]], "spec_len": 2, "upload_s": [0.1, 0.1], "sources": {}},
        ["not", "a", "plan"],
    ],
    ids=["duplicate", "zero-l", "nan-upload", "short-uploads", "bool-index", "list"],
)
def test_a_planner_answer_that_does_not_fit_the_round_is_not_run(demo_checkpoint, answer):
    import httpx

    from services.device_agent.edge_planning import plan_fits

    assert not plan_fits(answer, 2)
    assert plan_fits({"batches": [[1], [0]], "spec_len": 2, "upload_s": [0.1, 0.0], "sources": {}}, 2)
    device_model = build_device_model(demo_checkpoint, M, None)
    sessions = [StreamSession(device_model, p, SamplingParams(), DraftConfig(0.0, 8), 4) for p in ([5, 6, 7], [8, 9])]

    async def main():
        # a planner gone wrong (json.dumps writes NaN as the bare token a JSON parser may still accept)
        transport = httpx.MockTransport(
            lambda request: httpx.Response(
                200, content=json.dumps(answer).encode(), headers={"content-type": "application/json"}
            )
        )
        async with httpx.AsyncClient(transport=transport) as http:
            edge = EdgeDraftServer(
                None, *shapes(demo_checkpoint), EdgeConfig(), asyncio.to_thread, http, planner_url="http://planner"
            )
            return await edge.plan([EdgeRequest(s, i + 1, None) for i, s in enumerate(sessions)])

    plan = asyncio.run(main())
    assert plan["sources"]["planner"] == "default:planner-bad-answer"
    assert sorted(i for b in plan["batches"] for i in b) == [0, 1]
