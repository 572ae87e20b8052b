"""TelemetryClient under load: the verifier's step records go out in batches (one POST for many steps), and what
is dropped anyway is counted by reason on the sender's /metrics, never lost silently. Against the real state
monitor app (ASGI in-process, in memory) where it matters what the monitor ends up with."""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client import CollectorRegistry

from services.state_monitor.app import create_app
from services.state_monitor.settings import load_settings
from shared.telemetry.client import TelemetryClient
from shared.telemetry.metrics import exposition

STEP = {"kind": "verifier_step", "batched_tokens": 8, "compute_s": 0.01}


def counted(registry: CollectorRegistry, sample: str) -> float:
    """The value of one sample line of the registry's exposition, e.g. 'tophat:telemetry_records_sent_total'."""
    for line in exposition(registry).decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not exposed")


def dropped(registry: CollectorRegistry, reason: str) -> float:
    return counted(registry, f'tophat:telemetry_records_dropped_total{{reason="{reason}"}}')


async def test_a_burst_of_verifier_steps_reaches_the_monitor_whole_in_a_few_posts() -> None:
    """2000 steps in one burst (a busy verifier between two awaits): every one arrives, none dropped."""
    app = create_app(load_settings({}, embedded_redis=False))
    posts: list[int] = []
    inner = httpx.ASGITransport(app)

    class Counting(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(await request.aread())
            posts.append(len(body) if isinstance(body, list) else 1)
            return await inner.handle_async_request(request)

    registry = CollectorRegistry()
    async with app.router.lifespan_context(app):
        client = TelemetryClient("http://monitor", transport=Counting())
        client.count_into(registry)
        for _ in range(2000):
            client.emit_verifier_step(8, 0.01, 1, {"verify": 1})
        await client.aclose()  # sends the batch still kept, drains what is in flight
        async with httpx.AsyncClient(transport=inner, base_url="http://monitor") as reader:
            steps = (await reader.get("/state/cloud")).json()["steps"]
    assert steps == 2000 and sum(posts) == 2000
    assert len(posts) <= 2000 // client.batch_max + 1
    assert client.dropped == 0 and dropped(registry, "backlog") == 0
    assert counted(registry, "tophat:telemetry_records_sent_total") == 2000


async def test_a_few_steps_go_out_together_after_the_batch_interval() -> None:
    bodies: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.read()))
        return httpx.Response(200, json={})

    client = TelemetryClient("http://monitor", transport=httpx.MockTransport(handler), batch_interval_s=0.1)
    for tokens in (1, 2, 3):
        client.emit_verifier_step(tokens, 0.01, 1)
    await asyncio.sleep(0.02)
    assert bodies == []  # kept for the batch
    await asyncio.sleep(0.2)
    assert len(bodies) == 1 and [r["batched_tokens"] for r in bodies[0]] == [1, 2, 3]  # type: ignore[index]
    await client.aclose()


async def test_records_beyond_the_posts_in_flight_are_counted_as_dropped() -> None:
    release = asyncio.Event()

    async def stuck(request: httpx.Request) -> httpx.Response:
        await release.wait()  # a monitor that does not answer yet
        return httpx.Response(200, json={})

    registry = CollectorRegistry()
    client = TelemetryClient("http://monitor", transport=httpx.MockTransport(stuck), max_in_flight=4)
    client.count_into(registry)
    for i in range(10):
        client.emit({**STEP, "batched_tokens": i})
    client.emit([STEP, STEP, STEP])  # a batch counts its records
    assert client.dropped == 9 and dropped(registry, "backlog") == 9
    release.set()
    await client.aclose()
    assert counted(registry, "tophat:telemetry_records_sent_total") == 4


async def test_a_failed_batch_counts_every_record_it_carried() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-fail") == "down":
            raise httpx.ConnectError("monitor down", request=request)
        return httpx.Response(422, json={"detail": []})

    registry = CollectorRegistry()
    client = TelemetryClient("http://monitor", transport=httpx.MockTransport(handler))
    client.count_into(registry)
    assert not await client.send([STEP, STEP, STEP])
    assert dropped(registry, "rejected") == 3 and dropped(registry, "unreachable") == 0
    client._client.headers["x-fail"] = "down"  # type: ignore[union-attr]
    assert not await client.send([STEP, STEP])
    assert dropped(registry, "unreachable") == 2 and client.dropped == 5
    await client.aclose()
