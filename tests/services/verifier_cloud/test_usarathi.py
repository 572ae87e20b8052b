"""Server-side chunking (HAT's U-Sarathi baseline): the verifier computes a long prefill in pieces.

The device uploads the whole prompt at once (prompt_chunking=false) and the
verifier's scheduler takes it `server_chunk_tokens` at a time, one piece per
step, so other sessions' verify steps run between the pieces. Outputs must be
identical with and without it; P = 1 in-process and P = 2 stage workers.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from websockets.asyncio.client import ClientConnection, connect

from services.device_agent.cloud_client import WebSocketCloud
from services.device_agent.token_mode import token_decode
from services.verifier_cloud.scheduler import Scheduler, WorkItem
from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.session import Session
from services.verifier_cloud.settings import Settings, load_settings
from services.verifier_cloud.token_mode import TokenModel
from services.verifier_cloud.work import EngineError, ErrorKind
from shared.model.checkpoint import load_checkpoint
from shared.settings import SettingsError
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.specdec.sampling import SamplingParams
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
F32 = wire.WireDtype.F32
CHUNK = 8


def running_verifier(checkpoint, **overrides):
    return verifier_on_loopback(checkpoint, M, token_model=TokenModel(checkpoint, M), **overrides)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


PROMPTS = [[(17 * i + 3 * j) % 200 + 1 for j in range(19 + 7 * i)] for i in range(3)]  # 19, 26, 33 tokens


async def usarathi_generate(checkpoint, cloud, prompt, session_id, max_new=12):
    """The device side of U-Sarathi: speculative=false, prompt_chunking=false (one upload)."""
    device = DeviceModel.from_checkpoint(checkpoint, M, None)
    session = DeviceSession(device, prompt, draft_config=DraftConfig(max_draft=0), max_new_tokens=max_new)
    return [
        t
        async for emitted in run_session(
            session, cloud, session_id, fixed_chunks(len(prompt), None), offload=asyncio.to_thread
        )
        for t in emitted
    ]


async def generate_all(checkpoint, url, token_mode=True):
    """U-Sarathi generations of PROMPTS, then (token_mode) cloud-mode ones, all concurrently."""
    cloud = WebSocketCloud(url, checkpoint.hidden_size, F32, **split_identity(checkpoint, M))
    jobs = [usarathi_generate(checkpoint, cloud, p, 10 + i) for i, p in enumerate(PROMPTS)]
    if token_mode:
        jobs += [_tokens(token_decode(cloud, 20 + i, p, SamplingParams(), 12, 0)) for i, p in enumerate(PROMPTS)]
    try:
        return await asyncio.gather(*jobs)
    finally:
        await cloud.close_connection()


async def _tokens(rounds):
    return [t async for emitted in rounds for t in emitted]


# -- the scheduling rule, without a model ------------------------------------------------------


def test_a_long_prefill_is_taken_in_pieces_between_other_work():
    sched = Scheduler(max_batch_tokens=64, max_sessions=4, context_length=512, server_chunk_tokens=CHUNK)
    owner, replies = object(), []
    record = lambda item, out, err: replies.append((item.session_id, item.seq_no, err))  # noqa: E731
    for sid in (1, 2):
        sched.open(Session(sid, owner))
    sched.submit(WorkItem(1, 5, "prefill", torch.zeros(20, 4), 0, is_last=True, reply=record), owner)
    for seq in range(3):
        sched.submit(WorkItem(2, seq, "verify", torch.zeros(1, 4), 0, reply=record), owner)
    taken = []
    while sched.work_ready.is_set():
        batch = sched.schedule()
        taken.append(sorted((i.session_id, i.num_tokens, i.position) for i in batch.items))
        for item in batch.items:
            if item.reply is not None:
                item.reply(item, None, None)
        sched.finish_batch(batch)
    assert taken == [[(1, 8, 0), (2, 1, 0)], [(1, 8, 8), (2, 1, 0)], [(1, 4, 16), (2, 1, 0)]]
    assert [r[:2] for r in replies if r[0] == 1] == [(1, 5)]  # one reply for the whole item


def test_a_failed_piece_fails_the_item_once_and_drops_the_rest():
    sched = Scheduler(max_batch_tokens=64, max_sessions=4, context_length=512, server_chunk_tokens=CHUNK)
    owner, replies = object(), []
    sched.open(Session(1, owner))
    sched.submit(
        WorkItem(
            1,
            7,
            "prefill",
            torch.zeros(20, 4),
            0,
            is_last=True,
            reply=lambda item, out, err: replies.append((item.seq_no, err)),
        ),
        owner,
    )
    batch = sched.schedule()
    piece = batch.items[0]
    assert piece.num_tokens == CHUNK and sched.sessions[1].queue[0].num_tokens == 12
    error = EngineError(ErrorKind.INTERNAL, "boom", 1, 7)
    sched.finish_batch(batch)
    piece.reply(piece, None, error)
    assert replies == [(7, error)] and not sched.sessions[1].queue
    # An item that overflows the context is not split: it is refused whole, before touching the KV.
    sched.submit(WorkItem(1, 8, "prefill", torch.zeros(600, 4), 0, is_last=True), owner)
    assert sched.schedule().items[0].num_tokens == 600


def test_server_chunk_setting():
    assert Settings().server_chunk_tokens == 0  # off by default
    assert load_settings({"TOPHAT_VERIFIER_SERVER_CHUNK_TOKENS": "128"}).server_chunk_tokens == 128
    with pytest.raises(SettingsError, match="server_chunk_tokens"):
        load_settings({"TOPHAT_VERIFIER_SERVER_CHUNK_TOKENS": "-1"})


# -- in-process verifier (P = 1) ---------------------------------------------------------------


async def test_outputs_are_identical_with_and_without_server_chunking(checkpoint):
    expected = [generate_full(checkpoint, p, 12).token_ids for p in PROMPTS]
    got = {}
    for chunk in (0, CHUNK):
        async with running_verifier(checkpoint, server_chunk_tokens=chunk) as (server, url):
            got[chunk] = await generate_all(checkpoint, url)
            steps = list(server.recent_steps)
        longest = max(n for s in steps for _, kind, n in s.items if kind == "prefill")
        assert longest == (max(map(len, PROMPTS)) if chunk == 0 else CHUNK)
    assert got[0] == got[CHUNK] == expected + expected  # hidden-state sessions, then token sessions


async def roundtrip(ws: ClientConnection, message: wire.Message) -> wire.Message:
    await ws.send(wire.encode(message, wire_dtype=F32))
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


async def test_another_sessions_verify_steps_run_between_the_pieces(checkpoint):
    hidden, long_prompt, verifies = checkpoint.hidden_size, 40, 4
    async with running_verifier(checkpoint, server_chunk_tokens=CHUNK) as (server, url):
        async with connect(url) as ws:
            for sid in (1, 2):
                opened = await roundtrip(ws, wire.OpenSession(sid, hidden, F32, **split_identity(checkpoint, M)))
                assert isinstance(opened, wire.SessionOpened)
            assert isinstance(
                await roundtrip(ws, wire.PrefillChunk(2, 1, 0, True, torch.randn(3, hidden))), wire.DeepHidden
            )
            # Hold the engine at its next step until all the work below is queued, so the steps'
            # contents depend on the policy, not on how fast frames happen to arrive.
            gate, execute = threading.Event(), server.engine.execute
            server.engine.execute = lambda batch: (gate.wait(10), execute(batch))[1]
            first_step = len(server.recent_steps)
            await ws.send(
                wire.encode(wire.PrefillChunk(1, 10, 0, True, torch.randn(long_prompt, hidden)), wire_dtype=F32)
            )
            for i in range(verifies):
                await ws.send(wire.encode(wire.VerifyRequest(2, 11 + i, 3 + i, torch.randn(1, hidden)), wire_dtype=F32))
            queue = server.scheduler.sessions[2].queue
            for _ in range(200):
                if len(queue) >= verifies - 1:
                    break
                await asyncio.sleep(0.01)
            gate.set()
            replies = [wire.decode(await asyncio.wait_for(ws.recv(), 10)) for _ in range(verifies + 1)]
        steps = list(server.recent_steps)[first_step:]
    assert sorted(type(r).__name__ for r in replies) == ["DeepHidden"] + ["VerifyResult"] * verifies
    long_steps = [i for i, s in enumerate(steps) for sid, kind, n in s.items if sid == 1]
    assert len(long_steps) == math.ceil(long_prompt / CHUNK)  # one piece per step, successive steps
    assert all(n == CHUNK for s in steps for sid, _, n in s.items if sid == 1)
    verify_steps = [i for i, s in enumerate(steps) if (2, "verify", 1) in s.items]
    assert len(verify_steps) == verifies
    assert any(long_steps[0] < i < long_steps[-1] for i in verify_steps)  # interleaved, not queued behind


# -- pipeline path (P = 2 stage workers) -------------------------------------------------------


@pytest.mark.slow
async def test_server_chunking_through_pipeline_stages(tiny_llama_dir, checkpoint):
    expected = [generate_full(checkpoint, p, 12).token_ids for p in PROMPTS]
    server = VerifierServer.from_settings(
        Settings(port=0, split_layers=M, model_dir=str(tiny_llama_dir), pipeline_stages=2, server_chunk_tokens=CHUNK)
    )
    prefills: list[int] = []
    submit = server.pipeline.submit

    def recording_submit(batch):
        prefills.extend(item.num_tokens for item in batch.items if item.kind == "prefill")
        submit(batch)

    server.pipeline.submit = recording_submit
    stop, started = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve_forever(stop, started))
    try:
        port = await asyncio.wait_for(started, 120)
        got = await generate_all(checkpoint, f"ws://127.0.0.1:{port}/ws", token_mode=False)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert got == expected
    assert max(prefills) == CHUNK and len(prefills) == sum(math.ceil(len(p) / CHUNK) for p in PROMPTS)
