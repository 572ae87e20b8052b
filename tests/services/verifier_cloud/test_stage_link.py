"""The stage transport (shared/wire/stage_link.py, shared/wire/stage_codec.py): frames, refusals, pacing, bootstrap,
a real 2-stage verifier pipeline over sockets with LAN hops, and the stage_* settings."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import queue
import socket
import time

import msgpack
import numpy as np
import pytest
import pytest_asyncio
import torch

from services.verifier_cloud import stages
from services.verifier_cloud.pipeline import StagePipeline
from services.verifier_cloud.scheduler import SchedulerOutput, WorkItem
from services.verifier_cloud.settings import Settings, load_settings
from services.verifier_cloud.stage_specs import plan_stages
from services.verifier_cloud.stages import (
    STAGE_CODEC,
    STAGE_MESSAGES,
    Hello,
    MicroBatch,
    Probe,
    SessionsClosed,
    SessionsOpened,
    SessionsRolledBack,
    StageFailed,
    StageItem,
    Stop,
)
from services.verifier_cloud.work import ErrorKind, WorkKind
from shared.model.checkpoint import load_checkpoint
from shared.model.split import MiddleSubmodel, SplitError
from shared.net.links import PROFILES, UNSHAPED, LinkProfile, parse_link_spec
from shared.settings import SettingsError
from shared.wire.stage_chain import accept_link, bind_listener, connect_link
from shared.wire.stage_codec import StageCodec, StageLinkError
from shared.wire.stage_link import HEADER, MAGIC, LinkPacer, LinkReceiver, LinkSender, schedule_frame

M = 2  # the tiny model has 5 layers: the stages run layers 2, 3, 4


def sample(cls: type):
    """One filled-in instance of every registered message type (a new type needs a sample here)."""
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    item = StageItem(7, 2, WorkKind.VERIFY, 5, 3, hidden)
    samples = {
        StageItem: item,
        MicroBatch: MicroBatch(
            9,
            [item, StageItem(8, 1, WorkKind.PREFILL, 0, 2, None, (10, "stage 0: boom"))],
            [(0, 1.25, 2.5), (1, 2.5, 3.0)],
        ),
        SessionsOpened: SessionsOpened([1, 2]),
        SessionsClosed: SessionsClosed([3]),
        SessionsRolledBack: SessionsRolledBack([(1, 4), (2, 0)]),
        Probe: Probe(4, [{1: 4, 2: 0}, {}]),
        Hello: Hello([(0, 2, 3, 111), (1, 3, 5, 222)]),
        Stop: Stop(),
        StageFailed: StageFailed(1, "out of memory"),
    }
    if hasattr(stages, "SessionsForked"):
        samples[stages.SessionsForked] = stages.SessionsForked([(5, 1, 4), (6, 1, None)])
    return samples[cls]


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# -- codec ------------------------------------------------------------------------------------


def test_every_stage_message_dataclass_is_registered():
    defined = {
        obj
        for obj in vars(stages).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == stages.__name__
    }
    assert defined - {stages.StageSpec} == set(STAGE_MESSAGES)


@pytest.mark.parametrize("cls", STAGE_MESSAGES, ids=lambda c: c.__name__)
def test_every_message_type_round_trips(cls):
    message = sample(cls)
    decoded = STAGE_CODEC.decode(STAGE_CODEC.encode(message))
    assert same(decoded, message)
    for array in (getattr(i, "hidden", None) for i in getattr(decoded, "items", [decoded])):
        if array is not None:
            assert array.flags.writeable  # torch.from_numpy takes it without a copy or a warning


def frame_of(type_name: str, fields) -> bytes:
    return msgpack.packb([type_name, fields], use_bin_type=True)


def item_fields(**change):
    fields = dict(
        session_id=7, seq_no=2, kind=1, position=5, num_tokens=3, hidden=["<f4", [3, 4], bytes(48)], error=None
    )
    fields.update(change)
    return list(fields.values())


@pytest.mark.parametrize(
    "body, match",
    [
        (b"\xc1\xc1", "not msgpack"),
        (msgpack.packb({"type": "Stop"}), r"\[type name, fields\]"),
        (frame_of("StageSpec", []), "unknown message type"),  # a dataclass of stages.py, but not a message
        (frame_of("os.system", ["rm -rf /"]), "unknown message type"),
        (frame_of("Stop", [1]), "expected 0 fields"),
        (frame_of("SessionsOpened", [[1, "2"]]), "expected an int"),
        (frame_of("SessionsOpened", [[True]]), "expected an int"),
        (frame_of("StageItem", item_fields(kind=2)), "WorkKind ordinal"),
        (frame_of("StageItem", item_fields(hidden=["|O", [1], b"\0" * 8])), "dtype '|O' is not allowed"),
        (frame_of("StageItem", item_fields(hidden=[">f4", [3, 4], bytes(48)])), "is not allowed"),
        (frame_of("StageItem", item_fields(hidden=["<f4", [3, 4], bytes(47)])), "do not fill"),
        (frame_of("StageItem", item_fields(hidden=["<f4", [-3, -4], bytes(48)])), "bad array shape"),
        (frame_of("StageItem", item_fields(hidden=["<f4", [1] * 9, bytes(4)])), "bad array shape"),
        (frame_of("StageItem", item_fields(error=[1])), "2-tuple"),
        (frame_of("Probe", [1, [{"a": 1}]]), "expected an int"),
    ],
)
def test_malformed_bodies_are_refused_with_the_typed_error(body, match):
    with pytest.raises(StageLinkError, match=match):
        STAGE_CODEC.decode(body)


def test_the_codec_refuses_to_register_what_it_cannot_check():
    @dataclasses.dataclass
    class Opaque:
        payload: object

    with pytest.raises(TypeError, match="cannot carry"):
        StageCodec([Opaque])
    with pytest.raises(TypeError, match="not a registered"):
        STAGE_CODEC.encode(Opaque(1))


# -- frames over a real socket ----------------------------------------------------------------


@pytest.fixture
def hop():
    """(sender, receiver, the sender's raw socket) over a connected socket pair."""
    upstream, downstream = socket.socketpair()
    sender, receiver = (
        LinkSender(upstream, STAGE_CODEC, name="test hop"),
        LinkReceiver(downstream, STAGE_CODEC, name="test hop", max_frame_bytes=4096),
    )
    yield sender, receiver, upstream
    sender.close(timeout_s=1.0)
    receiver.close()


def test_frames_arrive_whole_and_in_order(hop):
    sender, receiver, _ = hop
    messages = [sample(cls) for cls in STAGE_MESSAGES]
    for message in messages:
        sender.put(message)
    assert all(same(receiver.get(timeout=5), m) for m in messages)
    with pytest.raises(queue.Empty):
        receiver.get(timeout=0.01)


def test_a_bad_body_drops_that_frame_only_and_the_link_goes_on(hop):
    sender, receiver, raw = hop
    garbage = frame_of("Pickle", [b"cos\nsystem\n"])
    raw.sendall(HEADER.pack(MAGIC, len(garbage), 0.0) + garbage)
    sender.put(Stop())
    with pytest.raises(StageLinkError, match="unknown message type 'Pickle'"):
        receiver.get(timeout=5)
    assert not receiver.closed and isinstance(receiver.get(timeout=5), Stop)


@pytest.mark.parametrize(
    "header, match",
    [
        (HEADER.pack(MAGIC, 4097, 0.0), "exceeds the 4096-byte limit"),
        (HEADER.pack(b"HTTP", 4, 0.0), "bad magic"),
    ],
)
def test_an_oversized_or_foreign_frame_closes_the_link(hop, header, match):
    _, receiver, raw = hop
    raw.sendall(header + b"\0" * 64)
    with pytest.raises(StageLinkError, match=match):
        receiver.get(timeout=5)
    assert receiver.closed
    with pytest.raises(StageLinkError, match="closed"):
        receiver.get(timeout=0.01)


def test_a_frame_stamped_far_ahead_is_refused_and_one_not_yet_due_is_held(hop):
    _, receiver, raw = hop
    body = STAGE_CODEC.encode(Stop())
    raw.sendall(HEADER.pack(MAGIC, len(body), time.monotonic() + 3600) + body)
    with pytest.raises(StageLinkError, match="beyond any link's delay"):
        receiver.get(timeout=5)
    raw.sendall(HEADER.pack(MAGIC, len(body), math.nan) + body)
    with pytest.raises(StageLinkError, match="beyond any link's delay"):
        receiver.get(timeout=5)
    raw.sendall(HEADER.pack(MAGIC, len(body), time.monotonic() + 60) + body)
    with pytest.raises(queue.Empty):
        receiver.get(timeout=0.05)  # arrived, not yet due
    assert not receiver.closed


def test_an_oversized_message_is_refused_by_its_sender():
    upstream, downstream = socket.socketpair()
    sender = LinkSender(upstream, STAGE_CODEC, max_frame_bytes=1024)
    with pytest.raises(StageLinkError, match="exceeds the 1024-byte frame limit"):
        sender.put(SessionsOpened(list(range(1000))))
    sender.close(timeout_s=1.0)
    downstream.close()


def test_a_peer_closing_is_a_typed_error(hop):
    sender, receiver, _ = hop
    sender.put(Stop())
    sender.close(timeout_s=5.0)
    assert isinstance(receiver.get(timeout=5), Stop)  # flushed before the close
    with pytest.raises(StageLinkError, match="peer closed"):
        receiver.get(timeout=5)


def test_a_hop_accepts_only_a_connection_with_the_pipelines_token():
    listener = bind_listener("127.0.0.1")
    address = listener.getsockname()[:2]
    stray = socket.create_connection(address, timeout=5)
    stray.sendall(b"GET / HTTP/1.1\r\n")
    stray.shutdown(socket.SHUT_WR)
    good = connect_link(address, b"t" * 16, timeout_s=5)
    accepted = accept_link(listener, b"t" * 16, timeout_s=5)
    good.sendall(b"ping")
    assert accepted.recv(4) == b"ping"
    with pytest.raises(StageLinkError, match="within"):
        accept_link(listener, b"t" * 16, timeout_s=0.2, check=lambda: None)
    with pytest.raises(StageLinkError, match="stage 3 died"):
        accept_link(listener, b"t" * 16, timeout_s=5, check=lambda: "stage 3 died")
    for sock in (stray, good, accepted, listener):
        sock.close()


# -- the emulated link's schedule ---------------------------------------------------------------

LAN = PROFILES["lan"]


def test_the_lan_profile_is_100_mbps_both_ways_with_a_millisecond():
    assert parse_link_spec("lan") == LAN
    assert LAN.uplink_bytes_s == LAN.downlink_bytes_s == 12.5e6
    assert LAN.latency_s == pytest.approx(0.001) and 0 < LAN.jitter_s < LAN.latency_s


def test_frames_queue_behind_each_other_at_the_hops_bandwidth():
    # 125 kB at 12.5 MB/s occupies the link 10 ms; the second, handed over 2 ms later, waits for the first.
    first = schedule_frame(link_free_at=0.0, now=100.0, nbytes=125_000, profile=LAN)
    second = schedule_frame(first.send_done, now=100.002, nbytes=125_000, profile=LAN)
    assert (first.start, first.send_done, first.deliver_at) == pytest.approx((100.0, 100.01, 100.011))
    assert (second.start, second.send_done, second.deliver_at) == pytest.approx((100.01, 100.02, 100.021))
    # An idle link starts at once: the schedule does not carry an old backlog.
    later = schedule_frame(second.send_done, now=200.0, nbytes=12_500, profile=LAN)
    assert (later.start, later.send_done) == pytest.approx((200.0, 200.001))


def test_jitter_moves_delivery_within_its_band_and_never_before_send_done():
    profile = LinkProfile(1e6, 1e6, latency_s=0.004, jitter_s=0.004)
    low, high = (schedule_frame(0.0, 1.0, 1000, profile, jitter_draw=d) for d in (-1.0, 1.0))
    assert low.deliver_at == pytest.approx(low.send_done) and high.deliver_at == pytest.approx(1.001 + 0.008)
    with pytest.raises(ValueError):
        schedule_frame(0.0, 1.0, 1000, profile, jitter_draw=1.5)


def test_the_pacer_stamps_a_running_schedule_and_nothing_when_unshaped():
    pacer = LinkPacer(LinkProfile(1e6, 1e6, latency_s=0.002))
    assert [pacer.stamp(1000, now=10.0) for _ in range(3)] == pytest.approx([10.003, 10.004, 10.005])
    assert pacer.link_free_at == pytest.approx(10.003)
    unshaped = LinkPacer(UNSHAPED)
    assert unshaped.stamp(10**9, now=5.0) == 0.0 and unshaped.link_free_at == 0.0
    seeded = [LinkPacer(LAN, seed=3).stamp(100, now=0.0) for _ in range(2)]
    assert seeded[0] == seeded[1] and abs(seeded[0] - (100 / LAN.uplink_bytes_s + LAN.latency_s)) <= LAN.jitter_s


# -- settings ---------------------------------------------------------------------------------


def test_stage_layers_set_p_and_are_checked():
    settings = load_settings({"TOPHAT_VERIFIER_STAGE_LAYERS": "2-3,3-5"})
    assert settings.pipeline_stages == 2 and settings.stage_workers
    assert (
        load_settings(
            {"TOPHAT_VERIFIER_STAGE_LAYERS": "2-3,3-5", "TOPHAT_VERIFIER_PIPELINE_STAGES": "2"}
        ).pipeline_stages
        == 2
    )
    for bad, match in [
        ("2-3,4-5", "contiguous"),
        ("1-3,3-5", "start at split_layers"),
        ("2-2,2-5", "empty"),
        ("2-3;3-5", "bad range"),
        ("two-five", "bad range"),
    ]:
        with pytest.raises(SettingsError, match=match):
            load_settings({"TOPHAT_VERIFIER_STAGE_LAYERS": bad})
    with pytest.raises(SettingsError, match="gives 2 stages but pipeline_stages is 3"):
        load_settings({"TOPHAT_VERIFIER_STAGE_LAYERS": "2-3,3-5", "TOPHAT_VERIFIER_PIPELINE_STAGES": "3"})
    assert not Settings().stage_workers


def test_stage_slowdowns_and_links_are_checked_against_p():
    env = {"TOPHAT_VERIFIER_PIPELINE_STAGES": "2"}
    assert load_settings({**env, "TOPHAT_VERIFIER_STAGE_SLOWDOWNS": "1,xavier"}).stage_slowdowns == "1,xavier"
    for value, match in [
        ("1", "1 values for 2 stages"),
        ("1,0.5", "must be a finite number >= 1"),
        ("1,cycle", "changes speed over time"),
    ]:
        with pytest.raises(SettingsError, match=match):
            load_settings({**env, "TOPHAT_VERIFIER_STAGE_SLOWDOWNS": value})
    load_settings({**env, "TOPHAT_VERIFIER_STAGE_LINKS": "lan;lan;far,lat=20ms"})
    load_settings({**env, "TOPHAT_VERIFIER_STAGE_LINKS": "lan"})  # one spec: every hop
    for value, match in [("lan;lan", "2 hop specs for 2 stages"), ("lan;wifi;lan", "unknown link profile")]:
        with pytest.raises(SettingsError, match=match):
            load_settings({**env, "TOPHAT_VERIFIER_STAGE_LINKS": value})
    with pytest.raises(SettingsError, match="full_model"):
        load_settings({"TOPHAT_VERIFIER_STAGE_LINKS": "lan", "TOPHAT_VERIFIER_FULL_MODEL": "1"})


def test_plan_stages_takes_the_explicit_ranges_slowdowns_and_hop_links():
    settings = Settings(
        split_layers=1, stage_layers="1-2,2-6,6-9", stage_slowdowns="1,3,3", stage_links="lan;none;lan;far"
    )
    specs = plan_stages(settings, num_layers=9, cuda=(False, 0))
    assert [s.layers for s in specs] == [(1, 2), (2, 6), (6, 9)] and [s.slowdown for s in specs] == [1, 3, 3]
    assert [s.in_link for s in specs] == [LAN, UNSHAPED, LAN] and [s.out_link for s in specs] == [
        UNSHAPED,
        LAN,
        PROFILES["far"],
    ]
    assert plan_stages(Settings(split_layers=1, pipeline_stages=2), 9, cuda=(False, 0))[0].out_link == UNSHAPED
    with pytest.raises(SplitError, match="--stage-layers 1-2,2-6 does not fit: .*must end at the model's 9 layers"):
        plan_stages(Settings(split_layers=1, stage_layers="1-2,2-6"), 9, cuda=(False, 0))


def test_an_item_without_hidden_states_is_refused_not_a_dead_stage(tiny_llama_dir):
    """The codec lets `hidden` be None (a failed item's); one that arrives without an error is refused
    as malformed instead of raising in the stage (which would kill its process), and its batch goes on."""
    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    worker = stages.StageWorker(0, MiddleSubmodel(checkpoint, M, stage=(2, 5)), 64)
    worker.handle(SessionsOpened([1, 2]))
    batch = MicroBatch(
        1,
        [
            StageItem(1, 1, WorkKind.PREFILL, 0, 3, None),
            StageItem(2, 1, WorkKind.PREFILL, 0, 3, np.zeros((3, checkpoint.hidden_size), np.float32)),
        ],
    )
    worker.handle(batch)
    assert batch.items[0].error[0] == int(ErrorKind.MALFORMED) and batch.items[0].hidden is None
    assert batch.items[1].error is None and batch.items[1].hidden.shape == (3, checkpoint.hidden_size)
    assert worker.runner.lengths() == {1: 0, 2: 3}


def test_a_batch_hop_0_refused_is_not_left_in_flight():
    """submit raising on a broken hop 0: the engine answers that batch and gives its slot back, so the
    batch must not stay in flight too (the pipeline's failure would answer it and free its slot again)."""
    pipeline = StagePipeline(
        plan_stages(Settings(split_layers=M, pipeline_stages=2), 5, cuda=(False, 0)),
        start_timeout_s=1,
        stage_timeout_s=1,
    )
    upstream, downstream = socket.socketpair()
    pipeline.sender = LinkSender(upstream, STAGE_CODEC, name="hop 0")
    pipeline.sender.error = "BrokenPipeError: the stage is gone"
    try:
        with pytest.raises(StageLinkError, match="link broken"):
            pipeline.submit(SchedulerOutput([WorkItem(1, 1, "prefill", torch.zeros(2, 8), 0, is_last=True)]))
        assert pipeline.in_flight == {}
    finally:
        pipeline.sender.close(timeout_s=1.0)
        downstream.close()
        for end in pipeline.workers.startups + pipeline.workers.child_ends:
            end.close()


# -- a real 2-stage pipeline over sockets, LAN hops, one slowed stage --------------------------

pytestmark_async = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lan_pipeline(tiny_llama_dir):
    settings = Settings(
        model_dir=str(tiny_llama_dir),
        split_layers=M,
        stage_layers="2-3,3-5",
        stage_slowdowns="1,2",
        stage_links="lan",
        device="cpu",
    )
    pipeline = StagePipeline(plan_stages(settings, 5, cuda=(False, 0)), start_timeout_s=120, stage_timeout_s=30)
    await pipeline.start()
    yield pipeline
    collector = collect(pipeline)  # Stop comes back through it
    await pipeline.aclose()
    await asyncio.wait_for(collector, 10)
    assert [process.exitcode for process in pipeline.workers.processes] == [0, 0]  # stopped in order, not terminated


_collectors: dict[int, asyncio.Task] = {}


def collect(pipeline: StagePipeline) -> asyncio.Task:
    """The pipeline's collector task, started if none runs. Never cancelled: its poll runs in a thread
    that a cancel would abandon mid-read, with the next collector reading the same hop."""
    task = _collectors.get(id(pipeline))
    if task is None or task.done():
        task = _collectors[id(pipeline)] = asyncio.create_task(pipeline.run())
    return task


async def run_through(pipeline: StagePipeline, inputs: dict[int, torch.Tensor]) -> dict[int, np.ndarray]:
    """Prefill each session's hidden states through the stages; their deep states, by session."""
    results: asyncio.Queue = asyncio.Queue()
    pipeline.on_done = lambda batch, items, step: results.put_nowait((items, step))
    pipeline.on_fail = lambda batch, reason: results.put_nowait((None, reason))
    collect(pipeline)
    for sid in inputs:
        pipeline.open_session(sid)
    for sid, hidden in inputs.items():
        await pipeline.acquire_slot()
        pipeline.submit(SchedulerOutput([WorkItem(sid, 1, "prefill", hidden, 0, is_last=True)]))
    out = {}
    for _ in inputs:
        items, step = await asyncio.wait_for(results.get(), 30)
        assert items is not None, step
        assert [stage for stage, _, _ in step.spans] == [0, 1]
        out.update({item.session_id: item.hidden for item in items})
    assert await pipeline.probe() == [{sid: len(h) for sid, h in inputs.items()}] * 2
    for sid in inputs:
        pipeline.close_session(sid)
    assert await pipeline.probe() == [{}, {}]
    return out


def expected_deep(tiny_llama_dir, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    middle = MiddleSubmodel(load_checkpoint(tiny_llama_dir, with_tokenizer=False), M)  # P = 1: the whole middle
    return {sid: middle.forward_batch([(middle.new_cache(), hidden)])[0] for sid, hidden in inputs.items()}


@pytestmark_async
@pytest.mark.slow
async def test_two_stages_over_lan_sockets_give_the_deep_states_of_one(lan_pipeline, tiny_llama_dir):
    assert lan_pipeline.healthy and lan_pipeline.sender.pacer.profile == LAN
    torch.manual_seed(0)
    inputs = {1: torch.randn(7, 64), 2: torch.randn(3, 64)}
    got = await run_through(lan_pipeline, inputs)
    for sid, want in expected_deep(tiny_llama_dir, inputs).items():
        assert torch.allclose(torch.from_numpy(got[sid]), want, atol=1e-5)


@pytestmark_async
@pytest.mark.slow
async def test_a_refused_frame_fails_the_pipeline_without_killing_the_stage_and_a_restart_serves_again(
    lan_pipeline, tiny_llama_dir
):
    pipeline = lan_pipeline
    assert pipeline.healthy
    pipeline.on_fail = lambda batch, reason: None
    collector = collect(pipeline)
    garbage = frame_of("Exploit", [])
    pipeline.sender.sock.sendall(HEADER.pack(MAGIC, len(garbage), 0.0) + garbage)  # straight onto hop 0
    await asyncio.wait_for(collector, 30)  # the collector returns once the pipeline has failed
    # Stage 0 lived to report it (a dead stage would be named as such), and the pipeline went unready.
    assert pipeline.failure == "stage 0 failed: refused a frame: hop 0 (into stage 0): unknown message type 'Exploit'"
    assert not pipeline.healthy
    await pipeline.restart()
    torch.manual_seed(1)
    inputs = {3: torch.randn(5, 64)}
    got = await run_through(pipeline, inputs)
    assert torch.allclose(torch.from_numpy(got[3]), expected_deep(tiny_llama_dir, inputs)[3], atol=1e-5)


def test_a_silent_connection_costs_only_itself_and_the_right_peer_wires_at_once():
    """Issue 47: a hop's acceptor gave each connection the whole remaining deadline to present its token, one at a
    time, so one silent connection held the wiring until it timed out. Now each has its own short handshake
    deadline and all are read at once."""
    listener = bind_listener("127.0.0.1")
    address = listener.getsockname()[:2]
    silent = [socket.create_connection(address, timeout=5) for _ in range(3)]
    trickle = socket.create_connection(address, timeout=5)
    trickle.sendall(b"t" * 5)  # a part of a token, never the rest
    good = connect_link(address, b"t" * 16, timeout_s=5)
    started = time.monotonic()
    accepted = accept_link(listener, b"t" * 16, timeout_s=8, handshake_timeout_s=5)
    assert time.monotonic() - started < 1.0
    good.sendall(b"ping")
    assert accepted.recv(4) == b"ping"
    # a connection that stays silent past its own handshake deadline is dropped, and the listener still serves
    late = socket.create_connection(address, timeout=5)
    with pytest.raises(StageLinkError, match="within"):
        accept_link(listener, b"t" * 16, timeout_s=0.6, handshake_timeout_s=0.2)
    assert late.recv(1) == b""  # closed by the acceptor
    for sock in (*silent, trickle, good, accepted, late, listener):
        sock.close()
