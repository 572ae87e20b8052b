"""The token streamer queues requests for device slots instead of refusing them.

Device agents are the test doubles of tests/services/token_streamer/test_token_streamer.py (real uvicorn
on loopback, capacity enforced like a real agent: more than `max_sessions`
generations get 503 busy). The streamer must hold the excess in a bounded FCFS
queue: every request completes in arrival order; a full queue answers 429 with
Retry-After; a request still queued at its deadline gets a typed error; a
queued request whose client leaves is dropped from the queue.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from tests.services.token_streamer.test_token_streamer import FakeDevice, expected_text, mesh

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow


async def post(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return await http.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})


async def queue_length(http: httpx.AsyncClient, url: str) -> int:
    return (await http.get(f"{url}/stats")).json()["queue"]["waiting"]


async def wait_for_queue(http: httpx.AsyncClient, url: str, n: int) -> None:
    async with asyncio.timeout(5):
        while await queue_length(http, url) != n:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("learn_capacity", [False, True], ids=["capacity-unknown", "capacity-from-info"])
async def test_more_requests_than_slots_all_complete_first_come_first_served(learn_capacity: bool) -> None:
    # One device, two slots, ten requests arriving in order: eight must wait their turn.
    dev = FakeDevice("dev-a", round_delay_s=0.01, max_sessions=2)
    dev.gate = asyncio.Event()  # the first two hold their slots until all ten have arrived
    async with mesh(dev) as url, httpx.AsyncClient(timeout=30) as http:
        if learn_capacity:  # a probe reads max_sessions from /info: the streamer then never overfills
            assert (await http.get(f"{url}/readyz")).status_code == 200
        tasks = []
        for i in range(2):  # each one on the device before the next is sent: p0 is admitted first
            tasks.append(asyncio.create_task(post(http, url, f"p{i}", max_tokens=5)))
            async with asyncio.timeout(5):
                while dev.active < i + 1:
                    await asyncio.sleep(0.01)
        for i in range(2, 10):  # each one queued before the next is sent: a defined arrival order
            tasks.append(asyncio.create_task(post(http, url, f"p{i}", max_tokens=5)))
            await wait_for_queue(http, url, i - 1)
        dev.gate.set()
        responses = await asyncio.gather(*tasks)
        stats = (await http.get(f"{url}/stats")).json()["queue"]
    assert [r.status_code for r in responses] == [200] * 10
    assert [r.json()["choices"][0]["text"] for r in responses] == [expected_text(5)] * 10
    assert dev.admitted == [f"p{i}" for i in range(10)]  # FCFS
    waits = [r.json()["tophat"]["queue_wait_s"] for r in responses]
    assert all(w >= 0 for w in waits) and max(waits) > 0
    assert [float(r.headers["x-tophat-queue-wait-ms"]) / 1e3 for r in responses] == pytest.approx(waits, abs=1e-3)
    assert stats["waiting"] == 0 and stats["queued"] >= 8 and stats["admitted"] == 10
    if learn_capacity:
        assert len(dev.requests) == 10  # never sent a request the device had to refuse


async def occupy_the_only_slot(http: httpx.AsyncClient, url: str, dev: FakeDevice, max_tokens: int) -> asyncio.Task:
    """Start a request "first" and return its task once the device is running it."""
    running = asyncio.create_task(post(http, url, "first", max_tokens=max_tokens))
    async with asyncio.timeout(5):
        while not dev.active:
            await asyncio.sleep(0.01)
    return running


async def test_full_queue_answers_429_with_retry_after() -> None:
    dev = FakeDevice("dev-a", round_delay_s=0.05, max_sessions=1)
    dev.gate = asyncio.Event()  # "first" holds the only slot until the test lets it go
    async with mesh(dev, queue_max_waiting=2) as url, httpx.AsyncClient(timeout=30) as http:
        running = await occupy_the_only_slot(http, url, dev, max_tokens=12)
        queued = [asyncio.create_task(post(http, url, f"q{i}")) for i in range(2)]
        await wait_for_queue(http, url, 2)
        refused = await post(http, url, "one too many")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        dev.gate.set()
        assert [r.status_code for r in await asyncio.gather(running, *queued)] == [200, 200, 200]
        assert (await http.get(f"{url}/stats")).json()["queue"]["rejected_full"] == 1
    assert "one too many" not in [r["prompt"] for r in dev.requests]


async def test_request_still_queued_at_its_deadline_gets_a_typed_error() -> None:
    dev = FakeDevice("dev-a", round_delay_s=0.1, max_sessions=1)
    async with mesh(dev, queue_timeout_s=0.3) as url, httpx.AsyncClient(timeout=30) as http:
        running = asyncio.create_task(post(http, url, "long", max_tokens=30))
        async with asyncio.timeout(5):
            while not dev.active:
                await asyncio.sleep(0.01)
        late = await post(http, url, "waits too long")
        assert late.status_code == 503
        error = late.json()["error"]
        assert error["code"] == "queue_timeout" and "queue" in error["message"]
        assert await queue_length(http, url) == 0
        assert (await running).status_code == 200
        assert (await http.get(f"{url}/stats")).json()["queue"]["timed_out"] == 1


async def test_busy_devices_that_never_free_time_out_in_the_queue() -> None:
    async with mesh(FakeDevice("a", busy=True), FakeDevice("b", busy=True), queue_timeout_s=0.3) as url:
        async with httpx.AsyncClient(timeout=10) as http:
            resp = await post(http, url, "x")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_timeout"


async def test_queued_request_whose_client_leaves_is_dropped() -> None:
    dev = FakeDevice("dev-a", round_delay_s=0.05, max_sessions=1)
    dev.gate = asyncio.Event()  # "first" holds the only slot until the test lets it go
    async with mesh(dev) as url, httpx.AsyncClient(timeout=30) as http:
        running = await occupy_the_only_slot(http, url, dev, max_tokens=12)
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        payload = json.dumps({"prompt": "leaves", "max_tokens": 4}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        await wait_for_queue(http, url, 1)
        writer.close()
        await writer.wait_closed()
        await wait_for_queue(http, url, 0)
        assert dev.active == 1  # it left before the slot freed: the queue let go of it at once
        dev.gate.set()
        assert (await running).status_code == 200
        after: Any = await post(http, url, "next")
        assert after.status_code == 200
        assert (await http.get(f"{url}/stats")).json()["queue"]["abandoned"] == 1
    assert dev.admitted == ["first", "next"]


async def test_stats_reports_the_queue() -> None:
    async with mesh(FakeDevice("dev-a"), queue_max_waiting=7) as url, httpx.AsyncClient(timeout=10) as http:
        stats = (await http.get(f"{url}/stats")).json()
    assert stats["queue"]["waiting"] == 0 and stats["queue"]["max_waiting"] == 7


async def test_loadgen_records_the_streamers_queue_wait() -> None:
    """A burst on one slot: the load generator keeps each request's queue wait (the streamer's
    own figure) and the run summary reports its percentiles."""
    from loadgen.metrics import build_results
    from loadgen.runner import RunConfig, run_load
    from loadgen.workloads import WorkloadRequest

    dev = FakeDevice("dev-a", round_delay_s=0.02, max_sessions=1)
    async with mesh(dev) as url:
        work = [WorkloadRequest(i, f"p{i}", 2, 5, 0) for i in range(3)]
        run = await run_load(work, [0.0, 0.0, 0.0], RunConfig(url=url, progress=False))
    waits = sorted(r.server_queue_wait_s for r in run.records)
    assert all(r.ok for r in run.records) and waits[0] >= 0 and waits[-1] > 0
    results = build_results(run.records)
    assert results["p99_server_queue_wait_ms"] == pytest.approx(1e3 * float(np.percentile(waits, 99)))


async def test_queued_websocket_chat_whose_client_leaves_is_dropped() -> None:
    """The WebSocket chat too: a client that closes its socket while its request waits for a slot leaves the
    queue at once, not when a slot would have come to it."""
    import websockets

    dev = FakeDevice("dev-a", round_delay_s=0.05, max_sessions=1)
    dev.gate = asyncio.Event()  # "first" holds the only slot until the test lets it go
    async with mesh(dev) as url, httpx.AsyncClient(timeout=30) as http:
        running = await occupy_the_only_slot(http, url, dev, max_tokens=100)
        async with websockets.connect(url.replace("http", "ws") + "/v1/chat/ws", open_timeout=5) as ws:
            await ws.send(json.dumps({"messages": [{"role": "user", "content": "leaves"}], "max_tokens": 4}))
            await wait_for_queue(http, url, 1)
        await wait_for_queue(http, url, 0)
        assert dev.active == 1  # the first request still holds the only slot
        assert (await http.get(f"{url}/stats")).json()["queue"]["abandoned"] == 1
        dev.gate.set()
        assert (await running).status_code == 200
    assert dev.admitted == ["first"]  # the chat never got a slot
