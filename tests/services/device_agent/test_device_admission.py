"""A /generate client that goes away at any point gives back its slot and both KV caches (admission.py).

A real device agent (demo model) against a real verifier on loopback. Where the client leaves is
decided exactly by driving the agent's ASGI app with a client that disconnects before the first
event, while the first event is being sent, or while a later one is (the ASGI server shape uvicorn
gives it: spec 2.3, a disconnect seen by `receive`). After each, at once (not whenever the garbage
collector gets to it), the agent counts no active session, the request's device KV is freed and the
verifier holds no session for it. Real HTTP shows the other half: a device at `max_sessions` whose
clients all went away still serves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from services.device_agent import app as device_app
from services.device_agent.agent import DeviceAgent
from tests.mesh_tools import loopback_agent_settings, verifier_on_loopback
from tests.services.token_streamer.test_token_streamer import serve

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_SESSIONS = 2
LONG = {"prompt": "Once upon a time", "max_new_tokens": 2000, "temperature": 0}  # still decoding when it leaves


@dataclass
class Running:
    agent: DeviceAgent
    app: Any  # the agent's ASGI app, also served over HTTP at `url`
    url: str
    verifier: Any  # the VerifierServer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def device(demo_checkpoint):
    async with AsyncExitStack() as stack:
        verifier, ws_url = await stack.enter_async_context(verifier_on_loopback(demo_checkpoint, 2))
        settings = loopback_agent_settings(ws_url, max_sessions=MAX_SESSIONS)
        agent = await asyncio.to_thread(DeviceAgent, settings)
        app = device_app.create_app(settings, agent)
        url = await stack.enter_async_context(serve(app))
        yield Running(agent, app, url, verifier)


@pytest.fixture
def built_sessions(monkeypatch) -> list:
    """Every device session /generate builds, in order."""
    built: list = []
    build = device_app.build_session

    def recorded(*args, **kwargs):
        session = build(*args, **kwargs)
        built.append(session)
        return session

    monkeypatch.setattr(device_app, "build_session", recorded)
    return built


# The client's side of one ASGI request: (receive, send) built from a `leave_on(message)` predicate that says on
# which message the agent sends it goes away (that send then never completes, as to a client that stopped
# reading, and its next receive is the disconnect).
LeaveOn = Callable[[dict], bool]


async def request_and_leave(app, body: dict, leave_on: LeaveOn) -> list[dict]:
    """POST /generate to the ASGI app; the client leaves when the agent sends a message `leave_on` accepts.
    Returns the messages the agent sent before that one."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    left = asyncio.Event()
    sent: list[dict] = []
    bodies = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if bodies:
            return bodies.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if left.is_set() or leave_on(message):
            left.set()
            await asyncio.Event().wait()  # never read: only the disconnect ends this
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 30)
    return sent


def at_response_start() -> LeaveOn:
    return lambda message: message["type"] == "http.response.start"


def at_event(number: int) -> LeaveOn:
    """The client leaves while the agent sends its `number`th NDJSON event (1: start, 2: the prefill's token,
    3: one verification round's tokens, ...)."""
    bodies = 0

    def leave_on(message: dict) -> bool:
        nonlocal bodies
        bodies += message["type"] == "http.response.body"
        return bodies == number

    return leave_on


LEAVING = {
    "before the first event": (at_response_start, 0),
    "during the first event": (lambda: at_event(1), 0),
    "mid-stream": (lambda: at_event(3), 2),
}


async def assert_nothing_held(running: Running, session) -> None:
    assert running.agent.active == 0
    assert session.input_cache.is_freed and (session.adapter_cache is None or session.adapter_cache.is_freed)
    # The verifier's session closes over the WebSocket: a request cancelled again while it releases leaves that
    # close to finish on its own (session_loop.release_session), a frame's round trip after the response ended.
    await wait_for(lambda: not running.verifier.scheduler.sessions, timeout_s=5.0)
    assert running.verifier.runner.lengths() == {}


@pytest.mark.parametrize("where", list(LEAVING))
async def test_a_client_gone_at_any_point_leaves_no_slot_and_no_kv(device, built_sessions, where):
    leave_on, events_seen = LEAVING[where]
    sent = await request_and_leave(device.app, LONG, leave_on())
    assert len([m for m in sent if m["type"] == "http.response.body"]) == events_seen
    (session,) = built_sessions
    # The response has ended, and so has everything the request held (the verifier's a round trip later).
    await assert_nothing_held(device, session)


async def test_a_device_at_max_sessions_still_serves_after_its_clients_went_away(device, built_sessions):
    for _ in range(MAX_SESSIONS):
        for leave_on, _ in LEAVING.values():
            await request_and_leave(device.app, LONG, leave_on())
    # And over real HTTP: clients that close their socket right after sending the request (their side of it:
    # the agent sees them gone; whatever it answered meanwhile is read to the end, so each has been handled).
    host, port = device.url.removeprefix("http://").split(":")
    payload = json.dumps(LONG).encode()
    for _ in range(MAX_SESSIONS + 1):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: device\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        writer.write_eof()
        async with asyncio.timeout(10):
            while await reader.read(1 << 16):
                pass
        writer.close()
    await wait_for(lambda: device.agent.active == 0 and not device.verifier.scheduler.sessions)
    await wait_for(lambda: all(session.input_cache.is_freed for session in built_sessions))
    async with httpx.AsyncClient(timeout=30) as http:
        done = await http.post(f"{device.url}/generate", json={**LONG, "max_new_tokens": 4})
        assert done.status_code == 200
        events = [json.loads(line) for line in done.text.splitlines()]
        assert events[0]["type"] == "start" and events[-1]["type"] == "done"
        assert (await http.get(f"{device.url}/info")).json()["active_sessions"] == 0


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)
