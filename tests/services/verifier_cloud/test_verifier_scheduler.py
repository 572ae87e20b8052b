"""The verifier's scheduler as pure policy (no model, no sockets): per-device bounds and idle sessions."""

from __future__ import annotations

import pytest
import torch

from services.verifier_cloud.scheduler import Scheduler, WorkItem
from services.verifier_cloud.session import Session
from services.verifier_cloud.work import EngineError, ErrorKind, WorkKind


def item(sid: int, seq: int, kind: str = "verify") -> WorkItem:
    return WorkItem(sid, seq, kind, torch.zeros(1, 4), 0)


def test_one_connection_cannot_take_every_session():
    sched = Scheduler(64, max_sessions=8, context_length=512, max_sessions_per_owner=3)
    greedy, polite = object(), object()
    for sid in range(3):
        sched.open(Session(sid, greedy))
    with pytest.raises(EngineError) as info:
        sched.open(Session(3, greedy))
    assert info.value.kind is ErrorKind.OVERLOADED and info.value.session_id == 3
    assert "3 sessions" in info.value.message
    sched.open(Session(10, polite))  # another device still gets in
    sched.close(0)
    sched.open(Session(4, greedy))  # and a closed session's place is free again
    assert sorted(sched.owned_by(greedy)) == [1, 2, 4]


def test_a_session_queue_over_its_cap_is_overloaded_for_that_item_only():
    sched = Scheduler(64, max_sessions=8, context_length=512, max_queue=2)
    owner = object()
    for sid in (1, 2):
        sched.open(Session(sid, owner))
    sched.submit(item(1, 1), owner)
    sched.submit(item(1, 2), owner)
    with pytest.raises(EngineError) as info:
        sched.submit(item(1, 3), owner)
    assert info.value.kind is ErrorKind.OVERLOADED and (info.value.session_id, info.value.seq_no) == (1, 3)
    sched.submit(item(2, 1), owner)  # other sessions are not affected
    assert [len(sched.sessions[sid].queue) for sid in (1, 2)] == [2, 1]
    sched.finish_batch(sched.schedule())  # once the queue drains, the session takes work again
    sched.submit(item(1, 3), owner)


def test_idle_sessions_are_those_without_traffic_for_the_ttl():
    sched = Scheduler(64, max_sessions=8, context_length=512)
    owner = object()
    quiet, talking, working = (sched.open(Session(sid, owner)) for sid in (1, 2, 3))
    for session in (quiet, talking, working):
        session.touch(100.0)
    talking.touch(109.0)
    sched.submit(item(3, 1), owner)
    working.touch(100.0)
    sched.schedule()  # session 3's item is in flight: busy, however long it takes
    assert sched.idle(now=110.0, ttl_s=10.0) == [1]
    assert sched.idle(now=119.0, ttl_s=10.0) == [1, 2]
    assert WorkKind.VERIFY in working.in_flight


@pytest.mark.parametrize("prefill_pipelining", [False, True], ids=["P=1", "P>1"])
def test_a_batch_of_a_closed_session_finishes_without_touching_its_reopened_id(prefill_pipelining):
    """Session 7 is closed and opened again under its id while its old item is computed: the old batch's
    finish must not count as the new session's (no reply to it, and its in-flight slot is its own)."""
    sched = Scheduler(64, max_sessions=4, context_length=512, prefill_pipelining=prefill_pipelining)
    owner = object()
    sched.open(Session(7, owner))
    sched.submit(item(7, 1, "prefill"), owner)
    old = sched.schedule()
    sched.close(7)
    sched.open(Session(7, owner))
    sched.submit(item(7, 1, "prefill"), owner)
    sched.submit(item(7, 2, "verify"), owner)
    new = sched.schedule()
    assert [i.seq_no for i in new.items] == [1] and not sched.schedule().items  # the verify waits for the prefill
    sched.finish_batch(old)
    assert not sched.schedule().items  # the new prefill is still in flight: the old finish freed nothing of it
    assert not sched.is_current(old.items[0]) and sched.is_current(new.items[0])
    sched.finish_batch(new)
    assert [i.seq_no for i in sched.schedule().items] == [2]


def test_prefills_take_turns_in_arrival_order_while_verifies_run_every_step():
    """With one prefill per step the older prompt's chunks run alone, the younger's wait for them; a verify
    never waits, and the younger prompt runs when the older has no chunk ready (the verifier never idles)."""
    sched = Scheduler(1024, max_sessions=8, context_length=512, prefill_sessions_per_step=1)
    owner = object()
    younger, older, decoding = (sched.open(Session(sid, owner)) for sid in (1, 2, 3))
    sched.submit(item(2, 1, "prefill"), owner)
    older.prefill_since = 10.0
    sched.submit(item(1, 1, "prefill"), owner)
    younger.prefill_since = 20.0
    sched.submit(item(3, 1, "verify"), owner)
    first = sched.schedule()
    assert sorted(i.session_id for i in first.items) == [2, 3]
    sched.finish_batch(first)
    sched.submit(item(2, 2, "prefill"), owner)  # the older prompt's next chunk came: still its turn
    second = sched.schedule()
    assert [i.session_id for i in second.items] == [2]
    sched.finish_batch(second)
    third = sched.schedule()  # nothing of the older one is ready: the younger runs
    assert [i.session_id for i in third.items] == [1]


def test_without_a_bound_prefills_of_every_session_share_a_step():
    sched = Scheduler(1024, max_sessions=8, context_length=512)
    owner = object()
    for sid in (1, 2):
        sched.open(Session(sid, owner))
        sched.submit(item(sid, 1, "prefill"), owner)
    assert sorted(i.session_id for i in sched.schedule().items) == [1, 2]


def test_a_new_turn_prefills_after_its_decode_get_a_fresh_place_in_line():
    sched = Scheduler(1024, max_sessions=8, context_length=512, prefill_sessions_per_step=1)
    owner = object()
    session = sched.open(Session(1, owner))
    sched.submit(item(1, 1, "prefill"), owner)
    first_turn = session.prefill_since
    sched.finish_batch(sched.schedule())
    sched.submit(item(1, 2, "verify"), owner)
    assert session.prefill_since is None
    sched.finish_batch(sched.schedule())
    session.touch(first_turn + 50.0)
    sched.submit(item(1, 3, "prefill"), owner)
    assert session.prefill_since is not None and session.prefill_since > first_turn
