"""While another session decodes, the verifier computes a prompt in pieces bounded by its measured g(mu):
the decoding session's rounds run between the pieces, a prompt alone runs whole, outputs are unchanged."""

from __future__ import annotations

import pytest
import torch

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.scheduler import Scheduler, WorkItem
from services.verifier_cloud.session import Session
from services.verifier_cloud.settings import Settings, load_settings
from shared.model.checkpoint import load_checkpoint
from shared.planning.prefill_pieces import DECODING_WINDOW_S, DEFAULT_MAX_PREFILL_STEP_MS, MIN_PIECE_TOKENS
from shared.settings import SettingsError
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.wire import schema as wire
from tests.mesh_tools import split_identity, verifier_on_loopback

M = 2
MS_PER_ROW = 0.001  # the scheduler tests' g: 1 ms a row


def scheduler(max_step_s: float = 0.020) -> tuple[Scheduler, object]:
    sched = Scheduler(
        max_batch_tokens=256,
        max_sessions=4,
        context_length=512,
        max_prefill_step_s=max_step_s,
        step_cost=lambda rows: MS_PER_ROW * rows,
    )
    owner = object()
    for sid in (1, 2):
        sched.open(Session(sid, owner))
    return sched, owner


def run_all(sched: Scheduler) -> list[list[tuple[int, str, int]]]:
    """Every step until no work is left: (session, kind, tokens) of its items."""
    steps = []
    while sched.work_ready.is_set():
        batch = sched.schedule()
        steps.append(sorted((i.session_id, str(i.kind), i.num_tokens) for i in batch.items))
        for item in batch.items:
            if item.reply is not None:
                item.reply(item, None, None)
        sched.finish_batch(batch)
    return steps


def test_a_prompt_alone_runs_whole():
    sched, owner = scheduler()
    sched.submit(WorkItem(1, 1, "prefill", torch.zeros(60, 4), 0, is_last=True), owner)
    assert run_all(sched) == [[(1, "prefill", 60)]]


def test_a_prompt_runs_in_pieces_that_fit_the_bound_while_another_session_decodes():
    sched, owner = scheduler()
    sched.submit(WorkItem(2, 1, "verify", torch.zeros(1, 4), 3), owner)  # session 2 is decoding
    replies = []
    sched.submit(
        WorkItem(1, 1, "prefill", torch.zeros(50, 4), 0, is_last=True, reply=lambda i, o, e: replies.append(i.seq_no)),
        owner,
    )
    for seq in range(2, 5):
        sched.submit(WorkItem(2, seq, "verify", torch.zeros(1, 4), 3), owner)
    steps = run_all(sched)
    # 20 ms at 1 ms a row: pieces of 20 rows, each step beside one of session 2's verifies
    assert steps == [
        [(1, "prefill", 20), (2, "verify", 1)],
        [(1, "prefill", 20), (2, "verify", 1)],
        [(1, "prefill", 10), (2, "verify", 1)],
        [(2, "verify", 1)],
    ]
    assert replies == [1]  # one reply, for the whole prompt


def test_a_piece_is_never_below_the_minimum():
    sched, owner = scheduler(max_step_s=0.001)
    sched.submit(WorkItem(2, 1, "verify", torch.zeros(1, 4), 3), owner)
    sched.submit(WorkItem(1, 1, "prefill", torch.zeros(40, 4), 0, is_last=True), owner)
    pieces = [n for step in run_all(sched) for sid, _, n in step if sid == 1]
    assert pieces == [MIN_PIECE_TOKENS, MIN_PIECE_TOKENS, 40 - 2 * MIN_PIECE_TOKENS]


def test_a_session_that_stopped_decoding_no_longer_cuts_prompts():
    sched, owner = scheduler()
    sched.submit(WorkItem(2, 1, "verify", torch.zeros(1, 4), 3), owner)
    run_all(sched)
    session = sched.sessions[2]
    assert session.decoding_at is not None
    session.decoding_at -= DECODING_WINDOW_S + 1  # its last verify was long ago, and nothing is queued
    sched.submit(WorkItem(1, 1, "prefill", torch.zeros(50, 4), 0, is_last=True), owner)
    assert run_all(sched) == [[(1, "prefill", 50)]]


def test_fixed_server_chunks_take_precedence():
    sched = Scheduler(256, 4, 512, server_chunk_tokens=8, max_prefill_step_s=0.020, step_cost=lambda rows: 0.0)
    owner = object()
    sched.open(Session(1, owner))
    sched.submit(WorkItem(1, 1, "prefill", torch.zeros(20, 4), 0, is_last=True), owner)
    assert [n for step in run_all(sched) for _, _, n in step] == [8, 8, 4]


def test_the_setting():
    assert Settings().max_prefill_step_ms == DEFAULT_MAX_PREFILL_STEP_MS == 200.0
    assert load_settings({"TOPHAT_VERIFIER_MAX_PREFILL_STEP_MS": "0"}).max_prefill_step_ms == 0.0
    with pytest.raises(SettingsError, match="max_prefill_step_ms"):
        load_settings({"TOPHAT_VERIFIER_MAX_PREFILL_STEP_MS": "-5"})


# -- the real verifier -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


def ushape_session(checkpoint, prompt, max_new):
    device = DeviceModel.from_checkpoint(checkpoint, M, None)
    return DeviceSession(device, prompt, draft_config=DraftConfig(max_draft=0), max_new_tokens=max_new)


async def test_a_prompt_that_arrives_while_another_session_decodes_runs_in_pieces_with_outputs_unchanged(checkpoint):
    decoding_prompt, long_prompt = [5, 9, 13, 2, 7, 11], [(7 * j) % 180 + 3 for j in range(50)]
    expected = [generate_full(checkpoint, p, n).token_ids for p, n in ((decoding_prompt, 24), (long_prompt, 8))]
    # a bound under any pass: every piece is the minimum, whatever this machine's g
    async with verifier_on_loopback(checkpoint, M, max_prefill_step_ms=1e-6) as (server, url):
        cloud = WebSocketCloud(url, checkpoint.hidden_size, wire.WireDtype.F32, **split_identity(checkpoint, M))
        try:
            decoding = run_session(
                ushape_session(checkpoint, decoding_prompt, 24), cloud, 1, fixed_chunks(len(decoding_prompt), None)
            )
            first = [t for _ in range(4) for t in await anext(decoding)]  # session 1 is decoding, then pauses
            steps_before = len(server.recent_steps)
            second = [
                t
                async for emitted in run_session(
                    ushape_session(checkpoint, long_prompt, 8), cloud, 2, fixed_chunks(len(long_prompt), None)
                )
                for t in emitted
            ]
            first += [t async for emitted in decoding for t in emitted]
        finally:
            await cloud.close_connection()
        steps = list(server.recent_steps)[steps_before:]
    assert [first, second] == expected
    pieces = [n for step in steps for sid, kind, n in step.items if sid == 2 and kind == "prefill"]
    assert pieces == [16, 16, 16, 2]
