"""Draft trees through the real verifier: a tree verify frame runs the middle once with tree attention,
the rows a device kept of the last tree move down before the rollback, bad layouts are typed errors that
harm nothing, and a session that loses its verifier mid-tree is replayed and stays token-identical."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from websockets.asyncio.client import connect

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.runner import ModelRunner, RunItem
from services.verifier_cloud.work import ErrorKind, WorkKind
from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel
from shared.specdec.decode_loop import LocalCloud, fixed_chunks, generate, run_session
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.replay import ReplayingCloud
from shared.specdec.sampling import SamplingParams
from shared.specdec.verify_layout import VerifyLayout
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback
from tests.shared.model.test_replay import DyingCloud, VerifierLost

M = 2
TREE = DraftConfig(max_draft=4, tree_nodes=10, tree_width=3, tree_min_prob=0.0)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


def _session(checkpoint, prompt, max_new=20) -> DeviceSession:
    device = DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M))
    return DeviceSession(device, prompt, draft_config=TREE, max_new_tokens=max_new)


async def test_tree_rounds_over_the_wire_are_token_identical(checkpoint):
    prompts = [[5, 17, 33, 2, 9], [8, 1, 44, 90, 3, 3, 12]]
    expected = [generate_full(checkpoint, p, 20).token_ids for p in prompts]
    async with verifier_on_loopback(checkpoint, M) as (server, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size, wire.WireDtype.F32, **split_identity(checkpoint, M))

        async def one(prompt, session_id):
            session = _session(checkpoint, prompt)
            tokens = []
            chunks = fixed_chunks(len(prompt), 3)
            async for emitted in run_session(session, cloud, session_id, chunks, offload=asyncio.to_thread):
                tokens += emitted
            return tokens

        got = await asyncio.gather(*(one(p, 40 + i) for i, p in enumerate(prompts)))
        await cloud.close_connection()
        assert not server.scheduler.sessions
    assert got == expected


async def _roundtrip(ws, frame: bytes) -> wire.Message:
    await ws.send(frame)
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


async def test_bad_tree_frames_are_typed_errors_that_change_nothing(checkpoint):
    hidden = checkpoint.hidden_size
    async with verifier_on_loopback(checkpoint, M) as (_, url):
        async with connect(url) as ws:
            await _roundtrip(ws, wire.encode(wire.OpenSession(1, hidden, **split_identity(checkpoint, M))))
            deep = await _roundtrip(ws, wire.encode(wire.PrefillChunk(1, 1, 0, True, torch.randn(5, hidden))))
            assert isinstance(deep, wire.DeepHidden)
            tree = wire.VerifyRequest(1, 2, 5, torch.randn(4, hidden), parents=(0, 0, 1))
            first = await _roundtrip(ws, wire.encode(tree))
            assert isinstance(first, wire.VerifyResult) and first.hidden.shape == (4, hidden)
            # kept rows beyond what the session holds (5 committed + 4 tree rows = 9)
            beyond = wire.VerifyRequest(1, 3, 7, torch.randn(1, hidden), kept=(8, 12))
            reply = await _roundtrip(ws, wire.encode(beyond))
            assert isinstance(reply, wire.ErrorFrame) and reply.code is wire.ErrorCode.BAD_SHAPE
            assert (reply.session_id, reply.seq_no) == (1, 3)
            # a bad parent array never reaches the engine (the decoder refuses it)
            raw = msgpack.unpackb(wire.encode(wire.VerifyRequest(1, 4, 5, torch.randn(3, hidden))))
            raw["pa"] = wire.encode_tokens((0, 2))  # row 2's parent is itself
            reply = await _roundtrip(ws, msgpack.packb(raw, use_bin_type=True))
            assert isinstance(reply, wire.ErrorFrame) and reply.code is wire.ErrorCode.BAD_SHAPE
            # the session is intact: the same tree again, after keeping path 0 -> 2 of the first, runs
            again = wire.VerifyRequest(1, 5, 7, torch.randn(2, hidden), parents=(0,), kept=(7,))
            ok = await _roundtrip(ws, wire.encode(again))
            assert isinstance(ok, wire.VerifyResult) and ok.hidden.shape == (2, hidden)


def test_the_runner_runs_trees_as_the_in_process_cloud_does(checkpoint):
    """Same states in, same deep states out, whether the runner or LocalCloud runs a tree, keeps a path
    of it and runs the next round; a layout that does not fit is BAD_SHAPE and touches nothing."""
    torch.manual_seed(0)
    hidden = checkpoint.hidden_size
    runner = ModelRunner(MiddleSubmodel(checkpoint, M), checkpoint.config.max_position_embeddings)
    local = LocalCloud(MiddleSubmodel(checkpoint, M))
    prompt, tree, after = torch.randn(6, hidden), torch.randn(5, hidden), torch.randn(2, hidden)
    first = VerifyLayout((0, 0, 1, 2))
    second = VerifyLayout((0,), kept=(8, 10))  # rows 2 and 4 of the tree: the path 0 -> 2 -> 4

    async def in_process():
        await local.open(1)
        await (await local.send_prefill(1, 0, prompt, True))
        a = await local.verify(1, 6, tree, first)
        b = await local.verify(1, 9, after, second)
        return a, b

    expected = asyncio.run(in_process())
    runner.open(1)
    assert runner.run([RunItem(1, WorkKind.PREFILL, 0, prompt)])[0].error is None
    got_first = runner.run([RunItem(1, WorkKind.VERIFY, 6, tree, layout=first)])[0]
    refused = runner.run([RunItem(1, WorkKind.VERIFY, 9, after, layout=VerifyLayout((0,), kept=(10, 12)))])[0]
    assert refused.error is not None and refused.error.kind is ErrorKind.BAD_SHAPE
    assert runner.lengths()[1] == 11  # untouched by the refusal
    got_second = runner.run([RunItem(1, WorkKind.VERIFY, 9, after, layout=second)])[0]
    torch.testing.assert_close(got_first.output, expected[0])
    torch.testing.assert_close(got_second.output, expected[1])


class DyingTreeCloud(DyingCloud):
    async def verify(self, session_id, commit_len, shallow, layout=None):
        self._tick()
        return await self.local.verify(session_id, commit_len, shallow, layout)


@pytest.mark.parametrize("die_at", [{7}, {8, 11}])
def test_a_verifier_lost_mid_tree_is_replayed_and_token_identical(checkpoint, die_at):
    ids = [9, 3, 77, 41, 5, 6, 100, 12, 2]
    expected = generate_full(checkpoint, ids, 24).token_ids
    cloud = DyingTreeCloud(MiddleSubmodel(checkpoint, M), die_at)
    replaying = ReplayingCloud(cloud, lambda exc: isinstance(exc, VerifierLost), backoff_s=0.001)
    session = _session(checkpoint, ids, 24)
    result = asyncio.run(generate(session, replaying, chunk_size=4))
    assert result.token_ids == expected
    assert cloud.deaths == len(die_at)


def test_sampled_tree_rounds_over_a_replaying_cloud_follow_their_seed(checkpoint):
    """A replay re-runs the same tree on the same committed rows: a seeded sampled session makes the same
    tokens whether or not its verifier was lost."""
    ids = [9, 3, 77, 41, 5, 6]
    params = SamplingParams(temperature=0.8, seed=11)
    outputs = []
    for die_at in (set(), {7}):
        cloud = DyingTreeCloud(MiddleSubmodel(checkpoint, M), die_at)
        replaying = ReplayingCloud(cloud, lambda exc: isinstance(exc, VerifierLost), backoff_s=0.001)
        device = DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M))
        session = DeviceSession(device, ids, params, TREE, 20)
        outputs.append(asyncio.run(generate(session, replaying, chunk_size=3)).token_ids)
    assert outputs[0] == outputs[1]
