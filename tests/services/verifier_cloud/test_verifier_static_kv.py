"""The verifier's static KV layout (a preallocated slot per session) serves every mode with the outputs of
the growable layout, bit for bit; its static-shape passes (what a CUDA graph captures) agree closely and give
the same tokens; a full pool and a full budget refuse with KV_BUDGET; a real verifier in the static layout
stays lossless against the unsplit model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.runner import ModelRunner, RunItem
from services.verifier_cloud.token_mode import TokenModel
from services.verifier_cloud.work import EngineError, ErrorKind, WorkKind
from shared.model.checkpoint import load_checkpoint
from shared.model.cuda_graphs import StaticPasses
from shared.model.invariant_attention import uses_invariant_attention
from shared.model.kv_cache import KVCacheError
from shared.model.quantized import QuantizedLinear
from shared.model.split import MiddleSubmodel
from shared.model.static_kv import StaticKVPool, static_capacity
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from shared.specdec.verify_layout import VerifyLayout
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback
from tests.services.verifier_cloud.test_verifier_tree import _session

M = 2
PREFILL, VERIFY = WorkKind.PREFILL, WorkKind.VERIFY


@pytest.fixture(scope="module", params=["f32", "int8", "int4"])
def checkpoint(request, tiny_qwen2_dir):
    """f32, and int8 / int4 (batch-invariant attention and, where built, the C++ layers)."""
    quantize = None if request.param == "f32" else request.param
    return load_checkpoint(tiny_qwen2_dir, quantize=quantize, with_tokenizer=False)


def runner_for(checkpoint, layout: str, slots: int = 8) -> ModelRunner:
    """layout: dynamic (growable caches), static (a pool), or passes (a pool and its static-shape passes, eager)."""
    middle = MiddleSubmodel(checkpoint, M)
    context = checkpoint.config.max_position_embeddings
    token_model = TokenModel(checkpoint, M)
    if layout == "dynamic":
        return ModelRunner(middle, context, token_model)
    pool = StaticKVPool.for_layers(middle, static_capacity(context), slots)
    passes = StaticPasses(middle, pool, capture=False) if layout == "passes" else None
    return ModelRunner(middle, context, token_model, pool, passes)


def every_mode(runner: ModelRunner, hidden: int) -> list[torch.Tensor]:
    """Packed prefills, verify chains with rollback, a tree and its compaction, a fork, a close and a
    reopen, token sessions sharing the passes, a long prefill past the largest bucket: every output."""
    generator = torch.Generator().manual_seed(0)
    outputs: list[torch.Tensor] = []

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, hidden, generator=generator)

    def run(*items: RunItem) -> None:
        for result in runner.run(items):
            assert result.error is None, result.error
            if result.output is not None:
                outputs.append(result.output)

    def token(sid: int, position: int, ids: list[int]) -> RunItem:
        return RunItem(sid, PREFILL, position, None, torch.tensor(ids), is_last=True)

    for sid in (1, 2, 3):
        runner.open(sid)
    runner.open(9, SamplingParams())  # greedy token session
    runner.open(8, SamplingParams(temperature=0.8, seed=3))  # sampled token session
    run(
        RunItem(1, PREFILL, 0, rows(7)),
        RunItem(2, PREFILL, 0, rows(40)),
        RunItem(3, PREFILL, 0, rows(3)),
        token(9, 0, [5, 17, 33, 2]),
        token(8, 0, [8, 1, 44]),
    )
    run(
        RunItem(1, VERIFY, 7, rows(4)),
        RunItem(2, VERIFY, 40, rows(1)),
        RunItem(3, VERIFY, 3, rows(2)),
        token(9, 4, [int(outputs[-2])]),
        token(8, 3, [int(outputs[-1])]),
    )
    run(RunItem(1, VERIFY, 9, rows(3)))  # two of the four drafts were rejected: rolled back first
    run(RunItem(2, VERIFY, 41, rows(5), layout=VerifyLayout((0, 0, 1, 2))), RunItem(3, VERIFY, 5, rows(2)))
    # rows 42 and 44 of the tree (the path 41 -> 42 -> 44) move down to 42, 43, then a two-row tree
    run(RunItem(2, VERIFY, 44, rows(2), layout=VerifyLayout((0,), kept=(42, 44))), token(9, 5, [int(outputs[-4])]))
    runner.fork(4, 2, 30)
    run(RunItem(4, VERIFY, 30, rows(3)), RunItem(2, VERIFY, 46, rows(1)))
    runner.close(1)
    runner.open(5)  # the closed session's slot, zeroed
    run(RunItem(5, PREFILL, 0, rows(70)), RunItem(4, VERIFY, 33, rows(2)))  # 72 rows: past every bucket
    run(RunItem(5, VERIFY, 70, rows(16)), RunItem(3, VERIFY, 7, rows(1)), RunItem(4, VERIFY, 34, rows(4)))
    run(RunItem(5, VERIFY, 80, rows(9), layout=VerifyLayout((0, 0, 0, 1, 1, 2, 4, 4))))
    assert runner.lengths() == {2: 47, 3: 8, 4: 38, 5: 89, 8: 4, 9: 6}
    return outputs


def test_the_static_layout_gives_every_mode_the_same_bits(checkpoint):
    expected = every_mode(runner_for(checkpoint, "dynamic"), checkpoint.hidden_size)
    static = runner_for(checkpoint, "static")
    got = every_mode(static, checkpoint.hidden_size)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # the slots' tensors never moved: the pool's own memory holds every session's KV
    for caches in static.sessions.values():
        assert caches.middle.layer(0).keys.data_ptr() == static.pool.keys[0][caches.middle.slot].data_ptr()


def test_the_static_shape_passes_agree_and_give_the_same_tokens(checkpoint):
    """What a CUDA graph replays, run eagerly: each row attends over its own gathered keys, so a dense
    model's sums run in another order (states close, not equal); the tokens sampled from them are equal.
    A quantized model's batch-invariant attention sums each row alone in a fixed order: equal bits."""
    expected = every_mode(runner_for(checkpoint, "dynamic"), checkpoint.hidden_size)
    runner = runner_for(checkpoint, "passes")
    got = every_mode(runner, checkpoint.hidden_size)
    assert runner.passes.counts == {"static": 7, "eager": 2}  # the two packed prefills of 57 and 72 rows are eager
    invariant = uses_invariant_attention(list(runner.layers.layers))
    assert invariant == any(isinstance(module, QuantizedLinear) for module in checkpoint.model.modules())
    for a, b in zip(got, expected):
        if a.dtype == torch.int64 or invariant:  # sampled tokens, or batch-invariant states
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_full_pool_refuses_with_kv_budget_and_a_close_frees_a_slot(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    runner = runner_for(checkpoint, "static", slots=2)
    runner.open(1)
    runner.open(2)
    with pytest.raises(EngineError) as refused:
        runner.open(3)
    assert refused.value.kind is ErrorKind.KV_BUDGET and "slots" in refused.value.message
    with pytest.raises(EngineError) as refused_fork:
        runner.fork(3, 1)
    assert refused_fork.value.kind is ErrorKind.KV_BUDGET
    assert runner.pool.free_slots == 0
    runner.close(2)
    runner.fork(3, 1)  # the freed slot
    assert runner.pool.free_slots == 0 and 3 in runner.lengths()
    # a slot is never reallocated: more rows than its capacity are an error, not a bigger tensor
    cache = runner.sessions[1].middle
    with pytest.raises(KVCacheError):
        cache.reserve(runner.pool.capacity + 1)


def test_the_budgets_charge_a_static_session_its_whole_slot(tiny_llama_dir):
    from services.verifier_cloud.budgets import Budgets
    from services.verifier_cloud.session import Session
    from services.verifier_cloud.settings import Settings
    from services.verifier_cloud.work_item import WorkItem

    per_position, capacity = 1000, static_capacity(512)
    sessions: list[Session] = []
    room = 3 * capacity * per_position  # three slots
    budgets = Budgets(
        Settings(kv_bytes_total=room, kv_bytes_per_device=room),
        512,
        per_position,
        None,
        device_of=lambda owner: owner,
        sessions=lambda: sessions,
        static_capacity=capacity,
    )
    for sid in (1, 2):
        session = Session(sid, owner="device")
        budgets.open(session)
        sessions.append(session)
        assert session.kv_capacity == capacity  # the slot, from the start
    assert budgets.kv_bytes() == 2 * capacity * per_position
    item = WorkItem(1, 1, PREFILL, torch.zeros(500, 8), 0)
    admission = budgets.admit(item, sessions[0])
    assert admission.kv_capacity == capacity  # never grows
    admission.apply(sessions[0], item)
    fork = Session(3, owner="device")
    budgets.fork(fork, sessions[0], 10)  # a fork of 10 positions takes a whole slot too
    assert fork.kv_capacity == capacity
    sessions.append(fork)
    with pytest.raises(EngineError) as refused:
        budgets.open(Session(4, owner="device"))
    assert refused.value.kind is ErrorKind.KV_BUDGET


@pytest.mark.parametrize("graphs", ["off", "on"])
async def test_a_verifier_in_the_static_layout_is_token_identical_to_the_unsplit_model(tiny_llama_dir, graphs):
    """End to end over the wire: tree rounds against a verifier whose KV is static (and, with graphs on,
    whose verify passes are the static-shape ones, run eagerly on the CPU)."""
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    prompts = [[5, 17, 33, 2, 9], [8, 1, 44, 90, 3, 3, 12]]
    expected = [generate_full(checkpoint, p, 20).token_ids for p in prompts]
    async with verifier_on_loopback(checkpoint, M, kv_layout="static", cuda_graphs=graphs) as (server, url):
        assert server.runner.pool is not None and (server.runner.passes is not None) == (graphs == "on")
        cloud = WebSocketCloud(url, checkpoint.hidden_size, wire.WireDtype.F32, **split_identity(checkpoint, M))

        async def one(prompt, session_id):
            tokens = []
            chunks = fixed_chunks(len(prompt), 3)
            session = _session(checkpoint, prompt)
            async for emitted in run_session(session, cloud, session_id, chunks, offload=asyncio.to_thread):
                tokens += emitted
            return tokens

        got = await asyncio.gather(*(one(p, 40 + i) for i, p in enumerate(prompts)))
        await cloud.close_connection()
        if graphs == "on":
            assert server.runner.passes.counts["static"] > 0
        assert server.runner.pool.free_slots == server.runner.pool.slots  # every session's slot came back
    assert got == expected


def test_pipeline_stages_run_the_static_layout(tiny_llama_dir):
    """Each stage worker holds its own pool: two stages in the static layout give the dynamic stages' bits."""
    from services.verifier_cloud.kv_plan import KVPlan
    from services.verifier_cloud.stages import MicroBatch, SessionsOpened, StageItem, StageWorker

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    context = checkpoint.config.max_position_embeddings
    hidden = torch.randn(2, 6, checkpoint.hidden_size)

    def through(layout: str) -> list:
        plan = KVPlan(static=layout == "static")
        stages = [
            StageWorker(0, MiddleSubmodel(checkpoint, M, stage=(2, 4)), context, kv=plan),
            StageWorker(1, MiddleSubmodel(checkpoint, M, stage=(4, 5)), context, kv=plan),
        ]
        assert all((stage.runner.pool is not None) == (layout == "static") for stage in stages)
        batch = MicroBatch(1, [StageItem(sid, 1, PREFILL, 0, 6, hidden[sid - 1].numpy()) for sid in (1, 2)])
        for stage in stages:
            stage.handle(SessionsOpened([1, 2]))
            stage.handle(batch)
        return [item.hidden for item in batch.items]

    for a, b in zip(through("static"), through("dynamic")):
        assert (a == b).all()
