"""verifier-cloud with P pipeline stages (HAT §4.5): worker processes, real loopback WebSockets.

Each stage is a spawned process that loads the tiny checkpoint itself, so
starting a server costs seconds: the P=2 and P=3 servers start once for the
whole module (concurrently), in the module's event loop. The last test kills a
worker of the P=3 server on purpose (the server restarts its stages), so it
stays last in this file.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio
import torch
from websockets.asyncio.client import ClientConnection, connect

from services.device_agent.cloud_client import WebSocketCloud
from services.verifier_cloud.scheduler import Scheduler, WorkItem
from services.verifier_cloud.server import VerifierServer
from services.verifier_cloud.session import Session
from services.verifier_cloud.settings import Settings, load_settings
from services.verifier_cloud.work import ErrorKind
from shared.model.adapter import DraftAdapter
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel, SplitError
from shared.settings import SettingsError
from shared.specdec.decode_loop import fixed_chunks, run_session
from shared.specdec.device_session import DeviceModel, DeviceSession, DraftConfig
from shared.specdec.reference import generate_full
from shared.wire import schema as wire
from tests.mesh_tools import split_identity

pytestmark = pytest.mark.asyncio(loop_scope="module")

M = 2  # the tiny model has 5 layers: the cloud runs layers 2, 3, 4
F32 = wire.WireDtype.F32


@dataclass
class Running:
    server: VerifierServer
    url: str
    http: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def verifiers(tiny_llama_dir):
    """{2: Running, 3: Running}: both servers started concurrently, stopped at module end."""
    stops, tasks, started = {}, {}, {}
    loop = asyncio.get_running_loop()
    for p in (2, 3):
        server = VerifierServer.from_settings(
            Settings(port=0, split_layers=M, model_dir=str(tiny_llama_dir), pipeline_stages=p, stage_timeout_s=30.0)
        )
        stops[p], started[p] = asyncio.Event(), loop.create_future()
        tasks[p] = (server, asyncio.create_task(server.serve_forever(stops[p], started[p])))
    try:
        ports = {p: await asyncio.wait_for(started[p], 120) for p in started}
        yield {
            p: Running(tasks[p][0], f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}")
            for p, port in ports.items()
        }
    finally:
        for p, (server, task) in tasks.items():
            stops[p].set()
            await asyncio.wait_for(task, 30)
            assert all(not proc.is_alive() for proc in server.pipeline.workers.processes)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir):
    return load_checkpoint(tiny_llama_dir, with_tokenizer=False)


async def generate_over_ws(checkpoint, cloud, prompt, session_id, max_new=12, chunk=4):
    device = DeviceModel.from_checkpoint(checkpoint, M, DraftAdapter(checkpoint, M))
    session = DeviceSession(device, prompt, draft_config=DraftConfig(eta=0.3, max_draft=4), max_new_tokens=max_new)
    tokens = []
    async for emitted in run_session(
        session, cloud, session_id, fixed_chunks(len(prompt), chunk), offload=asyncio.to_thread
    ):
        tokens += emitted
    return tokens


async def roundtrip(ws: ClientConnection, message: wire.Message) -> wire.Message:
    await ws.send(wire.encode(message, wire_dtype=F32))
    return wire.decode(await asyncio.wait_for(ws.recv(), 20))


async def open_sessions(ws: ClientConnection, checkpoint, *session_ids: int) -> None:
    for sid in session_ids:
        identity = split_identity(checkpoint, M)
        opened = await roundtrip(ws, wire.OpenSession(sid, checkpoint.hidden_size, F32, **identity))
        assert isinstance(opened, wire.SessionOpened)


# -- the scheduler's ordering rule, without a model ------------------------------------------


async def test_a_session_in_flight_is_not_scheduled_again():
    sched = Scheduler(max_batch_tokens=64, max_sessions=4, context_length=512)
    owner = object()
    for sid in (1, 2):
        sched.open(Session(sid, owner))
        for seq in (1, 2):
            sched.submit(WorkItem(sid, seq, "prefill", torch.zeros(2, 8), 0), owner)
    first = sched.schedule()
    assert [(i.session_id, i.seq_no) for i in first.items] == [(1, 1), (2, 1)]
    assert not sched.schedule().items and not sched.work_ready.is_set()  # both sessions are in flight
    sched.finish_batch(first)
    assert sched.work_ready.is_set()
    # With two free pipeline slots the ready work is spread over two micro-batches.
    assert [i.session_id for i in sched.schedule(parts=2).items] == [1]
    assert [i.session_id for i in sched.schedule(parts=1).items] == [2]


async def test_prefill_chunks_of_one_session_pipeline_but_a_verify_waits():
    sched = Scheduler(max_batch_tokens=64, max_sessions=4, context_length=512, prefill_pipelining=True)
    owner = object()
    sched.open(Session(1, owner))
    for seq, (kind, pos) in enumerate([("prefill", 0), ("prefill", 2), ("verify", 4)], start=1):
        sched.submit(WorkItem(1, seq, kind, torch.zeros(2, 8), pos), owner)
    first, second = sched.schedule(), sched.schedule()
    assert [i.seq_no for i in first.items] == [1] and [i.seq_no for i in second.items] == [2]  # both in flight
    assert not sched.schedule().items  # the verify needs both chunks' results
    sched.finish_batch(first)
    assert not sched.schedule().items
    sched.finish_batch(second)
    assert [i.seq_no for i in sched.schedule().items] == [3]
    # Without pipelining (P = 1 or switched off) the second chunk waits for the first.
    plain = Scheduler(max_batch_tokens=64, max_sessions=4, context_length=512)
    plain.open(Session(1, owner))
    for seq in (1, 2):
        plain.submit(WorkItem(1, seq, "prefill", torch.zeros(2, 8), 2 * (seq - 1)), owner)
    assert len(plain.schedule().items) == 1 and not plain.schedule().items


# -- correctness through the stages ----------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.slow
async def test_greedy_generation_equals_the_full_model(verifiers, checkpoint, stages):
    running = verifiers[stages]
    prompts = [[(11 * i + j) % 200 + 1 for j in range(6 + 3 * i)] for i in range(4)]
    expected = [generate_full(checkpoint, p, 12).token_ids for p in prompts]
    cloud = WebSocketCloud(running.url, checkpoint.hidden_size, F32, **split_identity(checkpoint, M))
    got = await asyncio.gather(*(generate_over_ws(checkpoint, cloud, p, 500 + i) for i, p in enumerate(prompts)))
    await cloud.close_connection()
    assert got == expected
    assert all(not lengths for lengths in await running.server.pipeline.probe())  # every stage freed them
    assert 1 <= running.server.pipeline.max_in_flight_seen <= stages


async def test_rollback_is_exact_on_every_stage(verifiers, checkpoint):
    """A rolled-back verify leaves every stage as if the rejected positions had never been appended."""
    running, hidden = verifiers[3], checkpoint.hidden_size
    torch.manual_seed(1)
    prefix, drafts, redo = torch.randn(10, hidden), torch.randn(4, hidden), torch.randn(3, hidden)
    async with connect(running.url) as ws:
        await open_sessions(ws, checkpoint, 21, 22)
        # 21: append 4 drafts, then keep 2 of them (commit_len 12 < 14 cached) and append 3 more.
        assert isinstance(await roundtrip(ws, wire.PrefillChunk(21, 1, 0, True, prefix)), wire.DeepHidden)
        a1 = await roundtrip(ws, wire.VerifyRequest(21, 2, 10, drafts))
        assert [d[21] for d in await running.server.pipeline.probe()] == [14, 14, 14]
        a2 = await roundtrip(ws, wire.VerifyRequest(21, 3, 12, redo))
        # 22: never sees the 2 rejected drafts.
        await roundtrip(ws, wire.PrefillChunk(22, 1, 0, True, prefix))
        b1 = await roundtrip(ws, wire.VerifyRequest(22, 2, 10, drafts[:2]))
        b2 = await roundtrip(ws, wire.VerifyRequest(22, 3, 12, redo))
        lengths = await running.server.pipeline.probe()
    assert [(d[21], d[22]) for d in lengths] == [(15, 15)] * 3
    assert torch.allclose(a1.hidden[:2], b1.hidden, atol=1e-5)
    assert torch.allclose(a2.hidden, b2.hidden, atol=1e-5)
    # And both equal the unsplit middle submodel run over the kept sequence in one pass.
    middle = MiddleSubmodel(checkpoint, M)
    whole = middle.forward_batch([(middle.new_cache(), torch.cat([prefix, drafts[:2], redo]))])[0]
    assert torch.allclose(a2.hidden, whole[-3:], atol=1e-4)


async def test_close_and_disconnect_free_kv_in_every_stage(verifiers, checkpoint):
    running, hidden = verifiers[2], checkpoint.hidden_size
    ws = await connect(running.url)
    await open_sessions(ws, checkpoint, 31, 32)
    for sid in (31, 32):
        assert isinstance(
            await roundtrip(ws, wire.PrefillChunk(sid, 1, 0, False, torch.randn(5, hidden))), wire.ChunkAck
        )
    assert [(d[31], d[32]) for d in await running.server.pipeline.probe()] == [(5, 5), (5, 5)]
    assert isinstance(await roundtrip(ws, wire.CloseSession(31)), wire.SessionClosed)
    assert [sorted(d) for d in await running.server.pipeline.probe()] == [[32], [32]]
    ws.transport.abort()  # the device vanishes without a close handshake
    for _ in range(100):
        if not running.server.scheduler.sessions:
            break
        await asyncio.sleep(0.05)
    assert not running.server.scheduler.sessions
    assert await running.server.pipeline.probe() == [{}, {}]


async def test_a_stage_error_is_typed_and_hits_only_its_item(verifiers, checkpoint):
    running, hidden = verifiers[2], checkpoint.hidden_size
    async with connect(running.url) as ws:
        await open_sessions(ws, checkpoint, 41, 42)
        await roundtrip(ws, wire.PrefillChunk(41, 1, 0, True, torch.randn(4, hidden)))
        # Back to back, so they usually share a micro-batch: a bad rollback and a good prefill.
        await ws.send(wire.encode(wire.VerifyRequest(41, 2, 9, torch.randn(2, hidden)), wire_dtype=F32))
        await ws.send(wire.encode(wire.PrefillChunk(42, 1, 0, True, torch.randn(3, hidden)), wire_dtype=F32))
        replies = {m.session_id: m for m in [wire.decode(await asyncio.wait_for(ws.recv(), 20)) for _ in range(2)]}
        assert isinstance(replies[41], wire.ErrorFrame)
        assert (replies[41].code, replies[41].seq_no) == (wire.ErrorCode.MALFORMED, 2)
        assert isinstance(replies[42], wire.DeepHidden)
        # The refused session is intact on every stage and keeps working.
        assert [d[41] for d in await running.server.pipeline.probe()] == [4, 4]
        ok = await roundtrip(ws, wire.VerifyRequest(41, 3, 4, torch.randn(2, hidden)))
        assert isinstance(ok, wire.VerifyResult) and ok.hidden.shape == (2, hidden)


async def test_two_micro_batches_are_in_flight_at_once(verifiers, checkpoint):
    """Worker timestamps show stage 0 computing one micro-batch while stage 1 computes another."""
    running, hidden = verifiers[2], checkpoint.hidden_size
    pipeline = running.server.pipeline
    seen_before = max((step.batch_id for step in pipeline.recent), default=0)

    def overlapped() -> bool:
        # With P = 2 only consecutive micro-batches can be in flight together.
        steps = sorted((step for step in pipeline.recent if step.batch_id > seen_before), key=lambda s: s.batch_id)
        return any(
            sa != sb and max(a0, b0) < min(a1, b1)
            for i, first in enumerate(steps)
            for second in steps[i + 1 : i + 2]
            for sa, a0, a1 in first.spans
            for sb, b0, b1 in second.spans
        )

    async def device(sid: int, stop: asyncio.Event) -> None:
        # Independent devices, each re-verifying 96 positions from commit_len 0 (a full rollback) in a loop.
        async with connect(running.url) as ws:
            await open_sessions(ws, checkpoint, sid)
            seq = 0
            while not stop.is_set():
                seq += 1
                reply = await roundtrip(ws, wire.VerifyRequest(sid, seq, 0, torch.randn(96, hidden)))
                assert isinstance(reply, wire.VerifyResult)

    emitted: list[tuple[int, float]] = []  # one verifier_step per micro-batch: (mu_hat, eta_hat)
    telemetry = running.server.telemetry
    original_emit = telemetry.emit_verifier_step
    reported_stages: set[int | None] = set()  # P, as the planner will read it from telemetry

    def record(tokens, compute_s, *rest, pipeline_stages=None, **kw):
        emitted.append((tokens, compute_s))
        reported_stages.add(pipeline_stages)

    telemetry.emit_verifier_step = record
    stop = asyncio.Event()
    devices = [asyncio.create_task(device(60 + i, stop)) for i in range(3)]
    try:
        for _ in range(200):
            if overlapped() or any(d.done() for d in devices):
                break
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*devices), 30)
        telemetry.emit_verifier_step = original_emit
    assert overlapped()
    assert reported_stages == {running.server.settings.pipeline_stages}
    assert pipeline.max_in_flight_seen == 2
    # eta_hat is the micro-batch's summed stage compute (its whole trip through the middle layers).
    steps = [step for step in pipeline.recent if step.batch_id > seen_before]
    assert emitted[-len(steps) :] == [(step.batched_tokens, step.compute_s) for step in steps]


async def test_a_reopened_session_id_never_gets_its_predecessors_result_or_rollback(verifiers, checkpoint):
    """Session 81 is closed and opened again under its id while its old verify is in flight, and that verify
    comes back failed INTERNAL from a stage: the old batch's finish must not answer the new session, free its
    in-flight slot, nor roll its KV back in the stages."""
    running, hidden = verifiers[2], checkpoint.hidden_size
    pipeline = running.server.pipeline
    torch.manual_seed(8)
    old_prefix, old_draft = torch.randn(4, hidden), torch.randn(2, hidden)
    new_prefix, new_draft = torch.randn(6, hidden), torch.randn(3, hidden)
    middle = MiddleSubmodel(checkpoint, M)
    expected = middle.forward_batch([(middle.new_cache(), torch.cat([new_prefix, new_draft]))])[0]

    async def results_held(count: int) -> None:
        for _ in range(400):
            if len(held) >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{count} micro-batch result(s) never came back from the stages")

    async with connect(running.url) as ws:
        await open_sessions(ws, checkpoint, 81)
        assert isinstance(await roundtrip(ws, wire.PrefillChunk(81, 1, 0, True, old_prefix)), wire.DeepHidden)
        # The collector keeps what the last stage sends back: those micro-batches stay in flight for the engine.
        held, deliver = [], pipeline._deliver
        pipeline._deliver = held.append
        try:
            await ws.send(wire.encode(wire.VerifyRequest(81, 2, 4, old_draft), wire_dtype=F32))
            await results_held(1)
            failed = held[0].items[0]  # as if stage 1 had failed it after stage 0 appended it
            failed.error, failed.hidden = (int(ErrorKind.INTERNAL), "stage 1: injected fault"), None
            assert isinstance(await roundtrip(ws, wire.CloseSession(81)), wire.SessionClosed)
            await open_sessions(ws, checkpoint, 81)
            await ws.send(wire.encode(wire.PrefillChunk(81, 1, 0, True, new_prefix), wire_dtype=F32))
            await results_held(2)
        finally:
            pipeline._deliver = deliver
        for message in held:
            deliver(message)
        reply = wire.decode(await asyncio.wait_for(ws.recv(), 20))
        assert isinstance(reply, wire.DeepHidden) and reply.seq_no == 1
        assert torch.allclose(reply.hidden, expected[5:6], atol=1e-4)
        with pytest.raises(TimeoutError):  # the old verify's error never reaches the new session
            await asyncio.wait_for(ws.recv(), 0.3)
        assert [d[81] for d in await pipeline.probe()] == [6, 6]  # not rolled back to the old verify's 4
        verified = await roundtrip(ws, wire.VerifyRequest(81, 2, 6, new_draft))
        assert isinstance(verified, wire.VerifyResult) and torch.allclose(verified.hidden, expected[6:], atol=1e-4)


# -- configuration -----------------------------------------------------------------------------


async def test_more_stages_than_middle_layers_is_a_startup_error(tiny_llama_dir):
    with pytest.raises(SplitError, match="--pipeline-stages 4 does not fit: cannot split 3 middle layers"):
        VerifierServer.from_settings(Settings(model_dir=str(tiny_llama_dir), split_layers=M, pipeline_stages=4))
    with pytest.raises(SettingsError, match="pipeline_stages must be >= 1"):
        load_settings({"TOPHAT_VERIFIER_PIPELINE_STAGES": "0"})
    assert load_settings({"TOPHAT_VERIFIER_PIPELINE_STAGES": "3"}).pipeline_stages == 3
    # P = 1 stays the default and the in-process path: no pipeline, no worker processes.
    assert Settings().pipeline_stages == 1
    server = VerifierServer.from_settings(Settings(model_dir=str(tiny_llama_dir), split_layers=M))
    assert server.pipeline is None and server.runner is not None


# -- failure (keep last: it kills a worker of the shared P=3 server) ----------------------------


@pytest.mark.slow
async def test_a_dead_worker_makes_the_verifier_unready_until_the_stages_are_restarted(verifiers, checkpoint):
    running, hidden = verifiers[3], checkpoint.hidden_size
    pipeline = running.server.pipeline
    # Hold the restart until the unready state has been observed (the test, not the clock, decides).
    observed, restart = asyncio.Event(), pipeline.restart

    async def held_restart():
        await asyncio.wait_for(observed.wait(), 30)
        await restart()

    pipeline.restart = held_restart
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{running.http}/readyz")).status_code == 200
        async with connect(running.url) as ws:
            await open_sessions(ws, checkpoint, 71)
            await roundtrip(ws, wire.PrefillChunk(71, 1, 0, True, torch.randn(4, hidden)))
            os.kill(pipeline.workers.pids[1], signal.SIGKILL)
            reply = await roundtrip(ws, wire.VerifyRequest(71, 2, 4, torch.randn(2, hidden)))
            assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.INTERNAL
            # The session's KV died with the worker: the device is told, the session is closed.
            lost = wire.decode(await asyncio.wait_for(ws.recv(), 20))
            assert isinstance(lost, wire.ErrorFrame) and (lost.code, lost.session_id) == (wire.ErrorCode.INTERNAL, 71)
            assert "KV is lost" in lost.message and 71 not in running.server.scheduler.sessions
            refused = await roundtrip(ws, wire.OpenSession(72, hidden, F32, **split_identity(checkpoint, M)))
            assert isinstance(refused, wire.ErrorFrame) and refused.code == wire.ErrorCode.OVERLOADED
        ready = await http.get(f"{running.http}/readyz")
        assert ready.status_code == 503 and "stage 1 worker" in ready.text
        old_pids = pipeline.workers.pids
        observed.set()
        for _ in range(1200):  # bounded: the restart spawns P processes that load the checkpoint
            if (await http.get(f"{running.http}/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert (await http.get(f"{running.http}/readyz")).status_code == 200
    assert pipeline.restarts == 1 and not set(old_pids) & set(pipeline.workers.pids)
    # Served again, exactly, by the new workers; the lost session is unknown to them.
    async with connect(running.url) as ws:
        reply = await roundtrip(ws, wire.VerifyRequest(71, 3, 4, torch.randn(2, hidden)))
        assert isinstance(reply, wire.ErrorFrame) and reply.code == wire.ErrorCode.UNKNOWN_SESSION
    prompt = [5, 17, 33, 2, 9, 4]
    cloud = WebSocketCloud(running.url, hidden, F32, **split_identity(checkpoint, M))
    assert await generate_over_ws(checkpoint, cloud, prompt, 73) == generate_full(checkpoint, prompt, 12).token_ids
    await cloud.close_connection()
    assert await pipeline.probe() == [{}, {}, {}]
