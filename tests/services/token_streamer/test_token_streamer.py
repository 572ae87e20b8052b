"""Token streamer against *test doubles* of device agents.

`FakeDevice` below is a small FastAPI app speaking the device agent's NDJSON
/generate protocol, served by a real uvicorn on a free loopback port; the
streamer runs on real uvicorn too, so the real `openai` client and httpx-sse
talk to it over TCP. End-to-end tests with the real device agents (and models)
are written elsewhere; these pin the streamer's own behaviour.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import uvicorn
import websockets
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from httpx_sse import aconnect_sse

from services.state_monitor.records import RequestDone
from services.token_streamer.app import create_app
from services.token_streamer.openai_format import StopScanner
from services.token_streamer.router import Router
from services.token_streamer.settings import load_settings
from shared.chat import plain_chat_text
from shared.settings import SettingsError

WORDS = ["Hello", ",", " world", "!", " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog"]


def expected_text(n: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


class FakeDevice:
    """Device-agent double: first round 1 token (prefill), then rounds of `per_round` tokens."""

    def __init__(
        self,
        device_id: str,
        *,
        per_round: int = 2,
        round_delay_s: float = 0.0,
        fail_after_rounds: int | None = None,
        busy: bool = False,
        max_sessions: int = 8,
    ) -> None:
        self.device_id = device_id
        self.max_sessions = max_sessions  # more concurrent generations get 503 busy, as a real agent's
        self.gate: asyncio.Event | None = None  # when set: generations start only once it is set
        self.per_round = per_round
        self.round_delay_s = round_delay_s
        self.fail_after_rounds = fail_after_rounds
        self.busy = busy
        self.requests: list[dict[str, Any]] = []
        self.admitted: list[str] = []  # prompts of the generations it started, in order
        self.finished = 0  # streams that reached 'done'
        self.active = 0
        self.ready = True  # what its /readyz says
        self.probes = 0  # GET /readyz answered

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            if self.busy or self.active >= self.max_sessions:
                return JSONResponse({"error": {"code": "busy", "message": "no free session"}}, status_code=503)
            prompt = (
                body["prompt"]
                if "prompt" in body
                else str(body["prompt_ids"])
                if "prompt_ids" in body
                else plain_chat_text(body["messages"])
            )
            if prompt == "user: bad\nassistant:":
                return JSONResponse({"error": {"code": "prompt_too_long", "message": "too long"}}, status_code=400)
            self.active += 1  # taken here, not in the stream, so two requests cannot both pass the check
            self.admitted.append(prompt)
            return StreamingResponse(self._lines(body), media_type="application/x-ndjson")

        @app.get("/info")
        async def info() -> dict[str, Any]:
            return {
                "device_id": self.device_id,
                "model": "fake",
                "active_sessions": self.active,
                "max_sessions": self.max_sessions,
            }

        @app.get("/readyz")
        async def readyz() -> JSONResponse:
            self.probes += 1
            return JSONResponse({"ready": self.ready}, status_code=200 if self.ready else 503)

        return app

    async def _lines(self, body: dict[str, Any]) -> AsyncIterator[str]:
        try:
            yield json.dumps({"type": "start", "request_id": body["request_id"], "prompt_tokens": 5}) + "\n"
            if self.gate is not None:
                await self.gate.wait()
            n, rounds, limit = 0, 0, body["max_new_tokens"]
            while n < limit:
                if self.fail_after_rounds is not None and rounds >= self.fail_after_rounds:
                    yield json.dumps({"type": "error", "code": "cloud_unreachable", "message": "verifier gone"}) + "\n"
                    return
                k = 1 if n == 0 else min(self.per_round, limit - n)
                await asyncio.sleep(self.round_delay_s)
                yield (
                    json.dumps(
                        {
                            "type": "tokens",
                            "token_ids": list(range(n, n + k)),
                            "text": "".join(WORDS[i % len(WORDS)] for i in range(n, n + k)),
                            "t": 0.01,
                        }
                    )
                    + "\n"
                )
                n, rounds = n + k, rounds + 1
            stats = {
                "prompt_tokens": 5,
                "completion_tokens": n,
                "ttft_s": 0.01,
                "tbt_s": 0.005,
                "mean_accept_length": float(self.per_round),
                "num_rounds": rounds - 1,
            }
            yield json.dumps({"type": "done", "finish_reason": "length", "stats": stats}) + "\n"
            self.finished += 1
        finally:
            self.active -= 1


@asynccontextmanager
async def serve(app: Any, **config: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with real uvicorn on a kernel-chosen loopback port (no bind race); `config`
    overrides uvicorn.Config's arguments."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, **{"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 1, **config})
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):  # the app's lifespan may build a device agent first: room for a busy box
            while not server.started:
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 5)
        sock.close()


def dead_url() -> str:
    """A loopback port with nothing listening: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def mesh(*devices: FakeDevice | str, **overrides: Any) -> AsyncIterator[str]:
    """Devices (FakeDevice or a raw URL) plus a streamer in front; yields the streamer URL."""
    async with _serve_all(list(devices)) as urls:
        settings = load_settings({}, device_urls=",".join(urls), health_interval_s=0.0, **overrides)
        async with serve(create_app(settings)) as url:
            yield url


@asynccontextmanager
async def _serve_all(devices: list[FakeDevice | str]) -> AsyncIterator[list[str]]:
    if not devices:
        yield []
        return
    head, rest = devices[0], devices[1:]
    if isinstance(head, str):
        async with _serve_all(rest) as urls:
            yield [head, *urls]
        return
    async with serve(head.app()) as url, _serve_all(rest) as urls:
        yield [url, *urls]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)


async def raw_events(url: str, path: str, body: dict[str, Any]) -> list[str]:
    async with httpx.AsyncClient(timeout=10) as http, aconnect_sse(http, "POST", url + path, json=body) as src:
        assert src.response.status_code == 200
        assert src.response.headers["content-type"].startswith("text/event-stream")
        return [sse.data async for sse in src.aiter_sse()]


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


async def test_openai_client_streams_chat_and_completions() -> None:
    dev = FakeDevice("dev-a")
    async with mesh(dev) as url:
        async with client(url) as oai:
            stream = await oai.chat.completions.create(model="tophat-demo", messages=CHAT, max_tokens=7, stream=True)
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text(7)
            assert chunks[-1].choices[0].finish_reason == "length"
            tophat = chunks[-1].model_extra["tophat"]
            assert tophat["completion_tokens"] == 7 and tophat["mean_accept_length"] == 2.0 and tophat["ttft_s"] > 0

            stream = await oai.completions.create(
                model="tophat-demo", prompt="def f(", max_tokens=5, stream=True, temperature=0, seed=3
            )
            texts = [c.choices[0].text async for c in stream]
            assert "".join(texts) == expected_text(5)
    assert dev.requests[0]["messages"] == CHAT and "prompt" not in dev.requests[0]  # templated on the device
    assert (dev.requests[1]["prompt"], dev.requests[1]["temperature"], dev.requests[1]["seed"]) == ("def f(", 0, 3)
    assert "messages" not in dev.requests[1]  # a completion stays raw text
    assert dev.requests[0]["max_new_tokens"] == 7 and dev.requests[0]["request_id"].startswith("chatcmpl-")


async def test_raw_sse_format_with_httpx_sse() -> None:
    async with mesh(FakeDevice("dev-a")) as url:
        events = await raw_events(
            url,
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        )
        no_usage = await raw_events(url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and "tophat" in final
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert no_usage[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in no_usage[:-1])
    assert json.loads(no_usage[0])["object"] == "text_completion"


async def test_non_stream_responses_carry_usage() -> None:
    async with mesh(FakeDevice("dev-a")) as url:
        async with client(url) as oai:
            chat = await oai.chat.completions.create(model="tophat-demo", messages=CHAT, max_tokens=6)
            assert chat.choices[0].message.content == expected_text(6)
            assert chat.choices[0].finish_reason == "length"
            assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (5, 6, 11)
            assert chat.model_extra["tophat"]["device_stats"]["num_rounds"] == 3
            async with httpx.AsyncClient(timeout=10) as http:
                body = (await http.post(f"{url}/v1/completions", json={"prompt": ["p"], "max_tokens": 3})).json()
            assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected_text(3)
            assert body["usage"]["total_tokens"] == 8


async def test_stop_strings_cut_text_and_stop_the_device() -> None:
    dev = FakeDevice("dev-a", round_delay_s=0.01)
    async with mesh(dev) as url:
        async with client(url) as oai:
            # rounds: [Hello] [, world] [! The] [ quick brown] ...: "The qu" spans two rounds
            stream = await oai.completions.create(
                model="m", prompt="x", max_tokens=40, stream=True, stop=["The qu", "zzz"]
            )
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks) == "Hello, world! "
            assert chunks[-1].choices[0].finish_reason == "stop"
            chat = await oai.chat.completions.create(model="m", messages=CHAT, max_tokens=40, stop="!")
            assert chat.choices[0].message.content == "Hello, world" and chat.choices[0].finish_reason == "stop"
        await asyncio.sleep(0.1)
    assert dev.finished == 0  # both generations were cut off, not run to max_tokens


def test_stop_scanner_holds_back_partial_matches() -> None:
    sc = StopScanner(["END", "xy"])
    assert [sc.feed("abE"), sc.feed("N"), sc.feed("x"), sc.feed("q")] == ["ab", "", "EN", "xq"]
    assert sc.flush() == "" and not sc.stopped
    sc = StopScanner(["END"])
    assert (sc.feed("aE"), sc.feed("NDzz"), sc.stopped, sc.feed("more")) == ("a", "", True, "")
    assert StopScanner([]).feed("E") == "E"


async def test_models_endpoint() -> None:
    async with mesh(FakeDevice("dev-a"), model_name="tophat-tiny") as url:
        async with client(url) as oai:
            assert [m.id async for m in oai.models.list()] == ["tophat-tiny"]
            async with httpx.AsyncClient() as http:
                missing = await http.get(f"{url}/v1/models/nope")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
async def test_routing_spreads_load_and_avoids_dead_device() -> None:
    a, b = FakeDevice("dev-a", round_delay_s=0.05), FakeDevice("dev-b", round_delay_s=0.05)
    dead = dead_url()
    async with mesh(a, dead, b) as url:
        async with client(url) as oai:

            async def one(i: int) -> str:
                stream = await oai.completions.create(model="m", prompt=f"p{i}", max_tokens=5, stream=True)
                return "".join([c.choices[0].text async for c in stream])

            results = await asyncio.gather(*(one(i) for i in range(4)))
            assert results == [expected_text(5)] * 4
            assert (len(a.requests), len(b.requests)) == (2, 2)
            async with httpx.AsyncClient() as http:
                ready = (await http.get(f"{url}/readyz")).json()
                devices = (await http.get(f"{url}/stats")).json()["devices"]
            assert ready == {"ready": True, "ready_devices": 2}
            by_url = {d["url"]: d for d in devices}
            assert by_url[dead]["healthy"] is False and by_url[dead]["served"] == 0
            assert {d["device_id"] for d in devices} == {"dev-a", "dev-b", None}


async def test_client_disconnect_releases_device() -> None:
    dev = FakeDevice("dev-a", round_delay_s=0.05)
    async with mesh(dev) as url, httpx.AsyncClient(timeout=10) as http:
        body = {"prompt": "x", "max_tokens": 200, "stream": True}
        async with aconnect_sse(http, "POST", f"{url}/v1/completions", json=body) as src:
            events = src.aiter_sse()
            for _ in range(2):
                await anext(events)
            await events.aclose()
        async with asyncio.timeout(5):
            while dev.active or (await http.get(f"{url}/stats")).json()["devices"][0]["outstanding"]:
                await asyncio.sleep(0.05)
    assert dev.finished == 0


def test_router_policy_least_outstanding_round_robin_and_down() -> None:
    now = [0.0]
    router = Router(["http://a", "http://b", "http://c"], down_s=5.0, clock=lambda: now[0])
    picks = [router.pick().url for _ in range(4)]
    assert picks == ["http://a", "http://b", "http://c", "http://a"]  # all idle: take turns
    a, b, c = router.devices
    router.acquire(a), router.acquire(b)
    assert router.pick() is c
    router.mark_down(c, "test")
    assert router.pick() in (a, b) and router.pick(exclude=["http://a", "http://b"]) is None
    now[0] = 5.1
    assert router.pick() is c


async def test_device_error_mid_stream() -> None:
    async with mesh(FakeDevice("dev-a", fail_after_rounds=2)) as url:
        events = await raw_events(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 9, "stream": True})
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "cloud_unreachable" and last["error"]["message"] == "verifier gone"
        async with client(url) as oai:
            stream = await oai.chat.completions.create(model="m", messages=CHAT, max_tokens=9, stream=True)
            got: list[str] = []
            with pytest.raises(openai.APIError, match="verifier gone"):
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")
            assert "".join(got) == expected_text(3)
            async with httpx.AsyncClient() as http:
                resp = await http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 9})
            assert resp.status_code == 502 and resp.json()["error"]["code"] == "cloud_unreachable"


@pytest.mark.slow
async def test_error_shapes_400_and_503() -> None:
    async with mesh(FakeDevice("dev-a"), max_new_tokens_limit=100) as url, httpx.AsyncClient(timeout=10) as http:
        for body in (
            {"prompt": "x", "n": 2},
            {"prompt": "x", "max_tokens": 101},
            {"prompt": "x", "stop": [""]},
            {"prompt": "x", "temperature": -1},
            {"max_tokens": 3},
        ):
            resp = await http.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 400, body
            assert set(resp.json()["error"]) >= {"message", "type", "code"}
            assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await http.post(
            f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400
        resp = await http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "bad"}]})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long"  # device's own 400
        async with client(url) as oai:
            with pytest.raises(openai.BadRequestError):
                await oai.completions.create(model="m", prompt="x", n=3)
    async with mesh(dead_url(), dead_url()) as url, httpx.AsyncClient(timeout=10) as http:
        resp = await http.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "stream": True})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_device_available"
        assert (await http.get(f"{url}/readyz")).status_code == 503
        assert (await http.get(f"{url}/healthz")).status_code == 200
    # Busy devices are waited for, not refused: tests/services/token_streamer/test_streamer_queue.py.


async def test_public_readyz_says_ready_and_a_count_from_a_shared_probe_and_stats_has_the_details() -> None:
    """A flood of /readyz costs one probe round per ready_max_age_s, and tells nobody where the devices are
    or why one failed: that is /stats', behind the API key."""
    dev, dead = FakeDevice("dev-a"), dead_url()
    async with mesh(dev, dead, api_key="k3y", ready_max_age_s=60) as url, httpx.AsyncClient(timeout=10) as http:
        answers = await asyncio.gather(*(http.get(f"{url}/readyz") for _ in range(10)))
        answers += [await http.get(f"{url}/readyz") for _ in range(10)]
        assert {(a.status_code, a.text) for a in answers} == {(200, '{"ready":true,"ready_devices":1}')}
        assert dev.probes == 1
        assert (await http.get(f"{url}/stats")).status_code == 401
        stats = (await http.get(f"{url}/stats", headers={"Authorization": "Bearer k3y"})).json()
        by_url = {d["url"]: d for d in stats["devices"]}
        assert by_url[dead]["healthy"] is False and "connect" in by_url[dead]["last_error"].lower()
    dev = FakeDevice("dev-b")
    async with mesh(dev, ready_max_age_s=0.2) as url, httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{url}/readyz")).status_code == 200
        dev.ready = False
        await asyncio.sleep(0.3)  # older than ready_max_age_s: the next check probes again
        not_ready = await http.get(f"{url}/readyz")
        assert not_ready.status_code == 503 and not_ready.json() == {"ready": False, "ready_devices": 0}
        assert dev.probes == 2


async def test_websocket_chat_keeps_socket_open() -> None:
    async with mesh(FakeDevice("dev-a")) as url:
        async with websockets.connect(url.replace("http", "ws") + "/v1/chat/ws", open_timeout=5) as ws:
            for max_tokens in (3, 5):
                await ws.send(json.dumps({"messages": CHAT, "max_tokens": max_tokens}))
                texts: list[str] = []
                while (msg := json.loads(await asyncio.wait_for(ws.recv(), 5)))["type"] == "token":
                    texts.append(msg["text"])
                assert msg["type"] == "done" and "".join(texts) == expected_text(max_tokens)
                assert msg["stats"]["completion_tokens"] == max_tokens and msg["finish_reason"] == "length"
            await ws.send(json.dumps({"messages": []}))
            err = json.loads(await asyncio.wait_for(ws.recv(), 5))
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            await ws.send(json.dumps({"messages": CHAT, "max_tokens": 2}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 5)) == {"type": "token", "text": expected_text(1)}


async def test_websocket_chat_answers_requests_sent_while_one_is_streaming_in_order() -> None:
    """The socket is watched for a disconnect while a request streams; what else the client sends meanwhile
    is kept and answered next, in order."""
    async with mesh(FakeDevice("dev-a", round_delay_s=0.02)) as url:
        async with websockets.connect(url.replace("http", "ws") + "/v1/chat/ws", open_timeout=5) as ws:
            for max_tokens in (6, 3, 4):
                await ws.send(json.dumps({"messages": CHAT, "max_tokens": max_tokens}))
            for max_tokens in (6, 3, 4):
                texts: list[str] = []
                while (msg := json.loads(await asyncio.wait_for(ws.recv(), 5)))["type"] == "token":
                    texts.append(msg["text"])
                assert msg["type"] == "done" and "".join(texts) == expected_text(max_tokens)


async def test_request_telemetry_reaches_state_monitor_schema() -> None:
    received: list[dict[str, Any]] = []
    monitor = FastAPI()

    @monitor.post("/telemetry")
    async def telemetry(request: Request) -> dict[str, int]:
        received.append(await request.json())
        return {"accepted": 1}

    async with serve(monitor) as monitor_url, mesh(FakeDevice("dev-a"), state_monitor_url=monitor_url) as url:
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{url}/readyz")).status_code == 200  # learns the device id
            await http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 7})
        async with asyncio.timeout(5):
            while not received:
                await asyncio.sleep(0.02)
    record = RequestDone.model_validate(received[0])
    assert record.device_id == "dev-a" and record.prompt_tokens == 5 and record.ttft_s > 0
    assert record.accept_lengths == [2, 2, 2] and len(record.token_times_s) == 6


def test_settings_from_env() -> None:
    s = load_settings(
        {"TOPHAT_STREAMER_DEVICE_URLS": " http://a:1/, http://b:2 ,,http://a:1", "TOPHAT_STREAMER_PORT": "9000"}
    )
    assert s.device_url_list == ["http://a:1", "http://b:2"] and s.port == 9000 and s.model_name == "tophat-demo"
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_STREAMER_DEVICE_URLS": "a:1"})
    with pytest.raises(SettingsError):
        load_settings({"TOPHAT_STREAMER_MAX_NEW_TOKENS_DEFAULT": "2000"})
