"""The token streamer's door (services/token_streamer/limits.py): API keys, a rate per credential, a body limit.

The streamer runs on real uvicorn over TCP (the helpers of
tests/services/token_streamer/test_token_streamer.py); only the device agents behind it are test doubles. Clients
are the real ones: httpx, websockets, openai, tophat's chat client and the load generator.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from services.token_streamer.app import create_app
from services.token_streamer.settings import load_settings
from shared.settings import SettingsError
from tests.services.token_streamer.test_token_streamer import CHAT, FakeDevice, expected_text, mesh, serve

KEY = "Zq8xTopSecretAlpha"  # distinctive, so any piece of it in a log is found
OTHER_KEY = "Wv3yHiddenKeyBeta"
WRONG = "Pk5mNotTheCodeGamma"
CLIENT_LOGGERS = ("httpx", "httpcore", "websockets.client", "openai")  # the test's own clients, not the streamer
COMPLETION = {"prompt": "x", "max_tokens": 3}
V1_CALLS = [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tophat-demo", None),
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ws_url(url: str) -> str:
    return url.replace("http", "ws") + "/v1/chat/ws"


async def ws_chat(url: str, headers: dict[str, str] | None, max_tokens: int = 3) -> str:
    async with websockets.connect(ws_url(url), additional_headers=headers, open_timeout=5) as ws:
        await ws.send(json.dumps({"messages": CHAT, "max_tokens": max_tokens}))
        texts: list[str] = []
        while (msg := json.loads(await asyncio.wait_for(ws.recv(), 5)))["type"] == "token":
            texts.append(msg["text"])
        assert msg["type"] == "done"
        return "".join(texts)


async def ws_refused(url: str, headers: dict[str, str] | None) -> httpx.Response | Any:
    with pytest.raises(InvalidStatus) as refused:
        async with websockets.connect(ws_url(url), additional_headers=headers, open_timeout=5):
            pass
    return refused.value.response


def assert_openai_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["message"]
    assert resp.headers["www-authenticate"] == "Bearer"


@pytest.mark.slow
async def test_every_v1_route_needs_a_key_and_the_probes_do_not() -> None:
    dev = FakeDevice("dev-a")
    async with mesh(dev, api_key=f"{KEY}, {OTHER_KEY}") as url, httpx.AsyncClient(timeout=10) as http:
        for method, path, body in V1_CALLS:
            for headers in (
                {},
                bearer(WRONG),
                {"Authorization": KEY},
                {"Authorization": f"Basic {KEY}"},
                bearer(KEY[:-1]),
            ):
                assert_openai_401(await http.request(method, url + path, json=body, headers=headers))
            for key in (KEY, OTHER_KEY):  # any of the configured keys
                resp = await http.request(method, url + path, json=body, headers=bearer(key))
                assert resp.status_code == 200, (path, resp.text)
            resp = await http.request(method, url + path, json=body, headers={"authorization": f"bearer {KEY}"})
            assert resp.status_code == 200  # the scheme is case-insensitive, as HTTP says
        assert_openai_401(await http.get(f"{url}/stats"))  # not a probe: it lists the devices
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert (await http.get(url + probe)).status_code == 200, probe
    assert len(dev.requests) == 6  # 2 routes x 3 accepted calls: nothing refused reached a device


async def test_websocket_chat_needs_the_key_on_its_handshake() -> None:
    async with mesh(FakeDevice("dev-a"), api_key=KEY) as url:
        for headers in (None, bearer(WRONG)):
            response = await ws_refused(url, headers)
            assert response.status_code == 401
            assert json.loads(response.body)["error"]["code"] == "invalid_api_key"
        assert await ws_chat(url, bearer(KEY), max_tokens=4) == expected_text(4)


async def test_openai_client_with_the_key_works_and_a_wrong_one_raises_authentication_error() -> None:
    async with mesh(FakeDevice("dev-a"), api_key=KEY) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10) as oai:
            assert [m.id for m in (await oai.models.list()).data] == ["tophat-demo"]
            done = await oai.completions.create(model="tophat-demo", prompt="x", max_tokens=5)
            assert done.choices[0].text == expected_text(5)
            stream = await oai.chat.completions.create(model="tophat-demo", messages=CHAT, max_tokens=4, stream=True)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected_text(4)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=WRONG, max_retries=0, timeout=10) as oai:
            with pytest.raises(openai.AuthenticationError) as refused:
                await oai.chat.completions.create(model="tophat-demo", messages=CHAT, max_tokens=4)
            assert refused.value.code == "invalid_api_key"


def serve_at_debug(app: Any):
    """`serve` at debug level, access log on, leaving the logging setup alone (log_config=None: no
    dictConfig, which would drop the handlers a test put on uvicorn's loggers)."""
    return serve(app, log_config=None, log_level="debug", access_log=True)


@asynccontextmanager
async def logged_streamer(dev: FakeDevice, **overrides: Any) -> AsyncIterator[str]:
    async with serve_at_debug(dev.app()) as dev_url:
        settings = load_settings({}, device_urls=dev_url, health_interval_s=0.0, log_level="debug", **overrides)
        async with serve_at_debug(create_app(settings)) as url:
            yield url


def pieces(secret: str, size: int = 4) -> Iterator[str]:
    return (secret[i : i + size] for i in range(len(secret) - size + 1))


async def test_no_key_ever_reaches_the_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    uvicorn_loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.access")]  # may not propagate
    for logger in uvicorn_loggers:
        logger.addHandler(caplog.handler)
    try:
        await talk_with_keys()
    finally:
        for logger in uvicorn_loggers:
            logger.removeHandler(caplog.handler)
    text = "\n".join(
        f"{r.name} {r.getMessage()} {r.args!r}" for r in caplog.records if not r.name.startswith(CLIENT_LOGGERS)
    )
    assert "authorization: [redacted]" in text  # uvicorn did log the handshake's headers, blanked
    assert "refused POST /v1/completions" in text and "401" in text and "429" in text and "413" in text
    for secret in (KEY, OTHER_KEY, WRONG):
        leaked = [piece for piece in pieces(secret) if piece in text]
        assert not leaked, leaked
    assert KEY not in repr(load_settings({"TOPHAT_STREAMER_API_KEY": KEY}))


async def talk_with_keys() -> None:
    """Right, wrong, rate-limited and oversized requests, and WebSocket handshakes, all carrying keys."""
    async with logged_streamer(
        FakeDevice("dev-a"), api_key=f"{KEY},{OTHER_KEY}", rate_limit_rps=0.01, rate_limit_burst=3
    ) as url:  # OTHER_KEY: the big body, the handshake, the message
        async with httpx.AsyncClient(timeout=10) as http:
            for key in (KEY, WRONG, KEY, KEY, KEY):  # right, wrong, right, right, then rate-limited
                await http.post(f"{url}/v1/completions", json=COMPLETION, headers=bearer(key))
            await http.post(f"{url}/v1/completions", content=b"x" * (2 << 20), headers=bearer(OTHER_KEY))
        await ws_refused(url, bearer(WRONG))
        assert await ws_chat(url, bearer(OTHER_KEY)) == expected_text(3)


def test_settings_keys_limits_and_the_open_endpoint_warning(caplog: pytest.LogCaptureFixture) -> None:
    s = load_settings(
        {
            "TOPHAT_STREAMER_API_KEY": f" {KEY},, {OTHER_KEY} ",
            "TOPHAT_STREAMER_RATE_LIMIT_RPS": "2.5",
            "TOPHAT_STREAMER_RATE_LIMIT_BURST": "4",
            "TOPHAT_STREAMER_MAX_BODY_BYTES": "1000",
        }
    )
    assert s.api_key_list == [KEY, OTHER_KEY]
    assert (s.rate_limit_rps, s.rate_limit_burst, s.max_body_bytes) == (2.5, 4, 1000)
    defaults = load_settings({})
    assert defaults.api_key_list == [] and defaults.rate_limit_rps == 0 and defaults.max_body_bytes == 1 << 20
    for bad in (
        {"TOPHAT_STREAMER_RATE_LIMIT_RPS": "-1"},
        {"TOPHAT_STREAMER_MAX_BODY_BYTES": "0"},
        {"TOPHAT_STREAMER_RATE_LIMIT_RPS": "1", "TOPHAT_STREAMER_RATE_LIMIT_BURST": "0"},
    ):
        with pytest.raises(SettingsError):
            load_settings(bad)
    caplog.set_level(logging.WARNING)
    for quiet in ({"host": "127.0.0.1"}, {"host": "::1"}, {"host": "0.0.0.0", "api_key": KEY}):
        create_app(load_settings({}, **quiet))
    assert not [r for r in caplog.records if "open to anyone" in r.getMessage()]
    create_app(load_settings({}, host="0.0.0.0"))
    assert [r for r in caplog.records if "open to anyone" in r.getMessage() and r.levelno == logging.WARNING]


@pytest.mark.timing  # its bounds are wall-clock times: make test runs it alone
@pytest.mark.slow
async def test_past_the_burst_a_credential_gets_429_with_retry_after() -> None:
    async with (
        mesh(FakeDevice("dev-a"), rate_limit_rps=0.4, rate_limit_burst=3) as url,
        httpx.AsyncClient(timeout=10) as http,
    ):
        codes = [(await http.post(f"{url}/v1/completions", json=COMPLETION)).status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        resp = await http.get(f"{url}/v1/models")
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "3"  # 1 token / 0.4 rps = 2.5 s, rounded up to whole seconds
        error = resp.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["message"] and error["type"]
        assert [(await http.get(f"{url}/healthz")).status_code for _ in range(5)] == [200] * 5  # probes not counted
        assert (await ws_refused(url, None)).status_code == 429  # a WebSocket handshake draws on the same bucket
    two_keys = {"api_key": f"{KEY},{OTHER_KEY}", "rate_limit_rps": 0.01, "rate_limit_burst": 1}
    async with mesh(FakeDevice("dev-a"), **two_keys) as url, httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{url}/v1/models", headers=bearer(KEY))).status_code == 200
        assert (await http.get(f"{url}/v1/models", headers=bearer(KEY))).status_code == 429
        assert (await http.get(f"{url}/v1/models", headers=bearer(OTHER_KEY))).status_code == 200  # its own bucket
        assert_openai_401(await http.get(f"{url}/v1/models", headers=bearer(WRONG)))  # no key, no bucket
    async with (
        mesh(FakeDevice("dev-a"), rate_limit_rps=0.01, rate_limit_burst=2) as url,
        httpx.AsyncClient(timeout=10) as http,
    ):
        openai_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)
        async with openai_client as oai:
            await oai.models.list()
            await oai.models.list()
            with pytest.raises(openai.RateLimitError):
                await oai.models.list()


async def test_an_open_endpoint_buckets_ipv6_clients_per_64() -> None:
    """The gate's bucket for a keyless client: a host that rotates through its /64 stays in one bucket."""
    app = create_app(load_settings({}, rate_limit_rps=0.01, rate_limit_burst=1))

    async def models_from(address: str) -> int:
        transport = httpx.ASGITransport(app=app, client=(address, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://streamer") as http:
            return (await http.get("/v1/models")).status_code

    assert await models_from("2001:db8:0:1::1") == 200
    assert [await models_from(f"2001:db8:0:1::{i:x}") for i in range(2, 6)] == [429] * 4
    assert await models_from("2001:db8:0:2::1") == 200  # another /64
    assert await models_from("::ffff:198.51.100.1") == 200 and await models_from("198.51.100.1") == 429
    assert await models_from("198.51.100.2") == 200  # IPv4: per address


async def chunks_of(total: int, size: int = 64 << 10) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        yield b" " * size
        sent += size


async def test_an_oversized_body_gets_413_before_it_is_parsed_and_the_streamer_goes_on() -> None:
    limit = 64 << 10
    dev = FakeDevice("dev-a")
    async with mesh(dev, max_body_bytes=limit) as url, httpx.AsyncClient(timeout=10) as http:
        fits = {"prompt": "y" * (limit - 100), "max_tokens": 2}
        assert (await http.post(f"{url}/v1/completions", json=fits)).status_code == 200
        big = json.dumps({"prompt": "z" * (20 << 20), "max_tokens": 2}).encode()  # 20 MB, Content-Length set
        for body in (big, b" " * (limit + 1)):
            resp = await http.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 413, resp.text
            assert resp.json()["error"]["code"] == "request_too_large"
            assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await http.post(
            f"{url}/v1/chat/completions", content=chunks_of(20 << 20), headers={"content-type": "application/json"}
        )  # chunked: no Content-Length
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
        for _ in range(2):  # and it keeps serving
            ok = await http.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == expected_text(4)
        assert await ws_chat(url, None) == expected_text(3)
    assert len(dev.requests) == 4  # the refused bodies never reached a device


async def test_tophats_own_clients_send_the_key() -> None:
    """`tophat chat --api-key` and the load generator send `Authorization: Bearer`; without it they get the 401."""
    from loadgen.runner import RunConfig, probe_server, run_load
    from loadgen.workloads import WorkloadRequest
    from tophatctl.chat_client import ChatClientError, chat_turn, run_chat

    async with mesh(FakeDevice("dev-a"), api_key=KEY) as url:
        out = io.StringIO()
        result = await chat_turn(url, CHAT, 4, 0.0, out=out, api_key=KEY)
        assert result.text == out.getvalue() == expected_text(4)
        with pytest.raises(ChatClientError, match="401"):
            await chat_turn(url, CHAT, 4, 0.0, out=io.StringIO())
        assert await run_chat(url, "hi", max_tokens=3, api_key=KEY) == 0
        assert await run_chat(url, "hi", max_tokens=3, api_key=WRONG) == 1

        work = [WorkloadRequest(i, f"p{i}", 2, 3, 0) for i in range(2)]
        run = await run_load(work, [0.0, 0.0], RunConfig(url=url, progress=False, api_key=KEY))
        assert all(r.ok for r in run.records) and KEY not in repr(RunConfig(url=url, api_key=KEY))
        run = await run_load(work, [0.0, 0.0], RunConfig(url=url, progress=False))
        assert not any(r.ok for r in run.records) and all("401" in str(r.error) for r in run.records)
        assert (await probe_server(url, api_key=KEY))["model"] == "tophat-demo"


@pytest.mark.slow
def test_tophat_up_api_key_reaches_the_streamer_of_a_real_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tophat up --api-key` -> MeshConfig -> the streamer process's TOPHAT_STREAMER_API_KEY (real processes,
    demo model): its OpenAI endpoint refuses a keyless request and serves `tophat chat --api-key`."""
    from typer.testing import CliRunner

    from tests.conftest import DEMO_MODEL_DIR
    from tophat import cli
    from tophatctl.mesh import Mesh
    from tophatctl.mesh_config import MeshConfig, MeshStartError
    from tophatctl.mesh_ports import find_port_base

    seen: list[MeshConfig] = []

    class NoMesh:
        def __init__(self, config: MeshConfig) -> None:
            seen.append(config)

        def start(self) -> None:
            raise MeshStartError("not in this test")

    monkeypatch.setattr("tophatctl.mesh.Mesh", NoMesh)
    CliRunner().invoke(cli.app, ["up", "--model", str(DEMO_MODEL_DIR), "--api-key", KEY])
    assert seen and seen[0].api_key == KEY and KEY not in repr(seen[0])
    monkeypatch.undo()

    config = MeshConfig(model_dir=str(DEMO_MODEL_DIR), num_devices=1, port_base=find_port_base(1), api_key=KEY)
    with Mesh(config) as running:
        url = running.config.streamer_url
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        assert_openai_401(httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=10))
        chat = CliRunner().invoke(
            cli.app, ["chat", "--url", url, "--prompt", "hi", "--max-new-tokens", "4", "--api-key", KEY]
        )
        assert chat.exit_code == 0 and "TTFT" in chat.output, chat.output
