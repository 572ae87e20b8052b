"""GET /metrics on every service, checked against what a real run did.

A real mesh (demo model, one device, real processes) whose device reaches the
verifier through a relay that records every frame both ways. The device drafts
with eta = 0, so every round drafts exactly its budget min(max_draft, tokens
left - 1): the draft counts follow from the run alone. The identities checked
(no request stops at end-of-sequence, so none is cut short):

* each request's first token comes from its prefill, each verification round
  makes final its accepted draft tokens plus one token of the target's own, so
  generated = requests + rounds + accepted, i.e.
  accepted = generated - rounds - requests (rounds, per request: its deliveries - 1);
* per position i: accepted_per_pos[i] = rounds that accepted more than i drafts,
  so their sum is the accepted total;
* drafts = rounds whose budget was > 0, draft tokens = the sum of the budgets;
* verifier batched tokens summed over steps = prompt tokens + sum over rounds of (draft + 1);
* the device's uplink / downlink bytes = the bytes of the frames the relay saw each way.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from shared.telemetry import metrics
from shared.wire import schema as wire
from tests.conftest import DEMO_MODEL_DIR
from tests.mesh_tools import CapturingRelay
from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig
from tophatctl.mesh_ports import find_port_base

MAX_TOKENS = 20
MAX_DRAFT = 4
PROMPTS = ["The old lighthouse keeper", "In the beginning the river", "A quiet morning in the"]


# -- reading an exposition -----------------------------------------------------------------------
def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


def scrape(url: str) -> dict:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return samples(response.text)


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


# -- the shared module, alone ----------------------------------------------------------------------
def test_two_instances_of_a_service_in_one_process_keep_separate_counts():
    first, second = metrics.PlannerMetrics(), metrics.PlannerMetrics()  # the global registry would refuse this
    first.decision("chunk_size", "eq3")
    assert (
        value(
            samples(metrics.exposition(first.registry).decode()),
            "tophat:planner_decisions_total",
            plan="chunk_size",
            source="eq3",
        )
        == 1
    )
    assert ("tophat:planner_decisions_total", (("plan", "chunk_size"), ("source", "eq3"))) not in samples(
        metrics.exposition(second.registry).decode()
    )


def test_counting_and_scraping_never_raise():
    device = metrics.DeviceMetrics("d", max_draft=2)
    device.frame("sideways", 10)  # no such direction: logged, not raised
    device.spec_decode.rounds([(2, "not a number")])  # a broken verdict: logged, not raised

    def broken() -> float:
        raise RuntimeError("gone")

    verifier = metrics.VerifierMetrics(sessions=broken, kv_bytes=lambda: 7)
    scraped = samples(metrics.exposition(verifier.registry).decode())
    assert math.isnan(value(scraped, "tophat:verifier_sessions"))  # the scrape still answers
    assert value(scraped, "tophat:verifier_kv_cache_bytes") == 7


def test_spec_decode_counts_rounds_with_drafts_and_accepts_by_position():
    device = metrics.DeviceMetrics("d", max_draft=3)
    device.spec_decode.rounds([(3, 2), (0, 0), (2, 0), (3, 3)])
    scraped = samples(metrics.exposition(device.registry).decode())
    assert value(scraped, "tophat:spec_decode_num_drafts_total") == 3  # the round without a draft is no draft
    assert value(scraped, "tophat:spec_decode_num_draft_tokens_total") == 8
    assert value(scraped, "tophat:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [
        value(scraped, "tophat:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)
    ]
    assert per_pos == [2, 2, 1]


# -- a real mesh ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh_and_relay():
    base = find_port_base(1)
    relay = CapturingRelay(f"ws://127.0.0.1:{base + 100}/ws").start()
    # No link probes: every frame on the device's link belongs to a request, so the relay's count is the device's.
    config = MeshConfig(
        model_dir=str(DEMO_MODEL_DIR),
        num_devices=1,
        port_base=base,
        device_verifier_url=relay.url,
        max_draft=MAX_DRAFT,
        eta=0.0,
        # every round a whole chain (the counts below assume it): no draft budget
        device_env={"bandwidth_probe_interval_s": "0", "rtt_probe_interval_s": "0", "draft_budgets": ""},
    )
    with Mesh(config) as mesh:
        yield mesh, relay
    relay.stop()


def complete(mesh: Mesh, prompt: str, **extra) -> dict:
    body = {"model": "tophat-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = httpx.post(f"{mesh.config.streamer_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def expected_rounds(deliveries: list[int], speculative: bool) -> list[tuple[int, int]]:
    """(draft tokens, accepted) per verification round, from the tokens per delivery the user got:
    the first delivery is the prefill's token; with eta = 0 a round drafts its whole budget."""
    assert deliveries[0] == 1
    generated, rounds = 1, []
    for made_final in deliveries[1:]:
        budget = min(MAX_DRAFT, MAX_TOKENS - generated - 1) if speculative else 0
        rounds.append((budget, made_final - 1))
        generated += made_final
    return rounds


@pytest.mark.slow
def test_metrics_match_the_run(mesh_and_relay):
    mesh, relay = mesh_and_relay
    config = mesh.config
    verifier_url = f"http://127.0.0.1:{config.verifier_port}"
    answers = [complete(mesh, p) for p in PROMPTS] + [complete(mesh, PROMPTS[0], tophat={"speculative": False})]
    rounds, prompt_tokens = [], 0
    for answer, speculative in zip(answers, [True] * len(PROMPTS) + [False]):
        assert answer["choices"][0]["finish_reason"] == "length"  # no EOS: every round made accepted + 1 final
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
        rounds += expected_rounds(answer["tophat"]["rounds"], speculative)
        prompt_tokens += answer["usage"]["prompt_tokens"]
    requests, generated = len(answers), MAX_TOKENS * len(answers)
    accepted = sum(a for _, a in rounds)
    assert accepted == generated - len(rounds) - requests

    device = scrape(config.device_url(0))
    assert value(device, "tophat:spec_decode_num_accepted_tokens_total") == accepted
    assert value(device, "tophat:spec_decode_num_drafts_total") == sum(k > 0 for k, _ in rounds)
    assert value(device, "tophat:spec_decode_num_draft_tokens_total") == sum(k for k, _ in rounds)
    per_pos = [
        value(device, "tophat:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(MAX_DRAFT)
    ]
    assert per_pos == [sum(a > i for _, a in rounds) for i in range(MAX_DRAFT)]
    assert sum(per_pos) == accepted
    assert accepted > 0  # the demo adapter agrees with the model often enough for the check to mean something
    up = value(device, "tophat:device_uplink_bytes_total", device="device-0")
    down = value(device, "tophat:device_downlink_bytes_total", device="device-0")
    assert up == sum(map(len, relay.frames)) > 0
    assert down == sum(map(len, relay.replies)) > 0

    streamer = scrape(config.streamer_url)
    assert value(streamer, "tophat:time_to_first_token_seconds_count") == requests
    assert value(streamer, "tophat:e2e_request_latency_seconds_count") == requests
    assert value(streamer, "tophat:inter_token_latency_seconds_count") == generated - requests
    assert value(streamer, "tophat:num_requests_running") == 0
    assert value(streamer, "tophat:num_requests_waiting") == 0

    verifier = scrape(verifier_url)
    assert value(verifier, "tophat:verifier_batched_tokens_sum") == prompt_tokens + sum(k + 1 for k, _ in rounds)
    steps = value(verifier, "tophat:verifier_batched_tokens_count")
    assert steps == value(verifier, "tophat:verifier_step_seconds_count") > 0
    assert value(verifier, "tophat:verifier_sessions") == 0  # every request closed its session
    assert value(verifier, "tophat:verifier_kv_cache_bytes") == 0

    # The monitor ingests the verifier's step records (best effort, off the request path): eventually one each.
    monitor_url = config.monitor_url
    assert _wait_for(
        lambda: scrape(monitor_url).get(("tophat:telemetry_records_total", (("kind", "verifier_step"),))) == steps
    )
    assert _wait_for(
        lambda: scrape(monitor_url).get(("tophat:telemetry_records_total", (("kind", "request"),))) == requests
    )

    planner = scrape(config.planner_url)
    before = sum(v for (name, _), v in planner.items() if name == "tophat:planner_decisions_total")
    assert before > 0  # the device asked for its chunk sizes and draft steps
    plan = httpx.get(
        f"{config.planner_url}/chunk-size",
        params={"device_id": "x", "prompt_tokens": 50},
        timeout=10,
        auth=mesh.operator_auth(),
    ).json()
    after = scrape(config.planner_url)
    assert (
        value(after, "tophat:planner_decisions_total", plan="chunk_size", source=plan["source"])
        == planner.get(("tophat:planner_decisions_total", (("plan", "chunk_size"), ("source", plan["source"]))), 0) + 1
    )


def test_a_bad_frame_is_counted_by_its_code(mesh_and_relay):
    mesh, _ = mesh_and_relay
    verifier_url = f"http://127.0.0.1:{mesh.config.verifier_port}"

    async def send_garbage() -> wire.ErrorFrame:
        # the handshake needs a device's token for the verifier
        credential = mesh.operator_auth(role="device", subject="test-device", audience="verifier")
        async with connect(
            f"ws://127.0.0.1:{mesh.config.verifier_port}/ws",
            open_timeout=10,
            additional_headers=credential.header() if credential else None,
        ) as ws:
            await ws.send(b"\xc1 not msgpack")
            return wire.decode(await asyncio.wait_for(ws.recv(), 10))

    before = scrape(verifier_url)
    error = asyncio.run(send_garbage())
    assert isinstance(error, wire.ErrorFrame)
    code = wire.ErrorCode(error.code).name
    after = scrape(verifier_url)
    assert (
        value(after, "tophat:verifier_bad_frames_total", code=code)
        == before.get(("tophat:verifier_bad_frames_total", (("code", code),)), 0) + 1
    )


# -- the verifier's gauges while a session lives, and the device's frame hook ------------------------
@pytest.mark.slow
async def test_live_sessions_and_kv_bytes_rise_while_a_session_is_open(tiny_llama_dir):
    from services.device_agent.cloud_client import WebSocketCloud
    from shared.model.checkpoint import load_checkpoint
    from tests.mesh_tools import split_identity, verifier_on_loopback

    checkpoint = load_checkpoint(tiny_llama_dir, with_tokenizer=False)
    frames: list[tuple[str, int]] = []
    async with verifier_on_loopback(checkpoint, 2) as (server, url):
        http_url = url.replace("ws://", "http://").removesuffix("/ws")
        cloud = WebSocketCloud(
            url, checkpoint.hidden_size, on_frame=lambda d, n: frames.append((d, n)), **split_identity(checkpoint)
        )
        async with httpx.AsyncClient(timeout=10) as http:

            async def scraped() -> dict:
                response = await http.get(f"{http_url}/metrics")
                assert response.headers["content-type"] == metrics.CONTENT_TYPE
                return samples(response.text)

            idle = await scraped()
            assert value(idle, "tophat:verifier_sessions") == 0 and value(idle, "tophat:verifier_kv_cache_bytes") == 0
            try:
                await cloud.open(7)
                answer = await cloud.send_prefill(7, 0, torch.randn(5, checkpoint.hidden_size), is_last=True)
                assert (await answer).shape == (1, checkpoint.hidden_size)
                live = await scraped()
                assert value(live, "tophat:verifier_sessions") == 1
                assert value(live, "tophat:verifier_kv_cache_bytes") > 0
                assert value(live, "tophat:verifier_batched_tokens_sum") == 5
                await cloud.close(7)
                closed = await scraped()
                assert value(closed, "tophat:verifier_sessions") == 0
                assert value(closed, "tophat:verifier_kv_cache_bytes") == 0
            finally:
                await cloud.close_connection()
    # open, prefill, close: three frames each way, every one counted with its size
    assert [d for d, _ in frames].count("up") == 3 and [d for d, _ in frames].count("down") == 3
    assert all(n > 0 for _, n in frames)
