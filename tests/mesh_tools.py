"""Tools for the end-to-end tests: a WebSocket relay that records every frame
a device sends to the cloud (to prove what crosses the wire), and what a running
mesh holds (verifier and device sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from http import HTTPStatus

import httpx
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake


class CapturingRelay:
    """Listens on a free port, relays each connection to `upstream`, keeps device->cloud frames (and the
    cloud's replies, in `replies`)."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.frames: list[bytes] = []
        self.replies: list[bytes] = []
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._ready = threading.Event()

    async def _pipe(self, source, sink, record: list[bytes]) -> None:
        try:
            async for frame in source:
                record.append(frame)
                await asyncio.wait_for(sink.send(frame), 30)
        except ConnectionClosed:
            pass
        finally:
            await sink.close()

    async def _open_upstream(self, device_side, request):
        """Connect to the cloud before the device's handshake completes: while the cloud is down the device
        gets a 503 and sends nothing, as it would facing the verifier itself. (Accepting first would let
        the device send a frame the relay never passes on, and its byte count would disagree with ours.)"""
        # The device's credential goes on to the verifier (a mesh with a secret refuses a handshake without one).
        credential = request.headers.get("Authorization")
        try:
            device_side.cloud_side = await connect(
                self.upstream,
                max_size=None,
                compression=None,
                open_timeout=10,
                additional_headers={"Authorization": credential} if credential else None,
            )
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            return device_side.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"upstream unavailable: {exc}\n")
        return None

    async def _handle(self, device_side) -> None:
        async with device_side.cloud_side as cloud_side:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._pipe(device_side, cloud_side, record=self.frames))
                tasks.create_task(self._pipe(cloud_side, device_side, record=self.replies))

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with serve(
            self._handle, "127.0.0.1", 0, max_size=None, compression=None, process_request=self._open_upstream
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self) -> "CapturingRelay":
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def split_identity(checkpoint, split_layers: int = 2) -> dict:
    """The split_layers/fingerprint keywords (of OpenSession and WebSocketCloud) of `checkpoint` split at m."""
    from shared.model.checkpoint import split_fingerprint

    return {"split_layers": split_layers, "fingerprint": split_fingerprint(checkpoint.path, split_layers)}


async def open_session(ws, checkpoint, session_id: int, split_layers: int = 2):
    """OpenSession for `checkpoint` split at m on an open verifier socket, and the verifier's answer."""
    from shared.wire import schema as wire

    identity = split_identity(checkpoint, split_layers)
    await ws.send(wire.encode(wire.OpenSession(session_id, checkpoint.hidden_size, **identity)))
    return wire.decode(await asyncio.wait_for(ws.recv(), 10))


@contextlib.asynccontextmanager
async def verifier_on_loopback(checkpoint, split_layers: int = 2, token_model=None, **overrides):
    """The real VerifierServer in this event loop on a free loopback port: yields (server, ws url)."""
    from services.verifier_cloud.server import VerifierServer
    from services.verifier_cloud.settings import Settings
    from shared.model.split import MiddleSubmodel

    # model_dir names the checkpoint's files: the verifier fingerprints its split from them
    settings = Settings(**{"port": 0, "split_layers": split_layers, "model_dir": str(checkpoint.path), **overrides})
    middle = MiddleSubmodel(checkpoint, split_layers)
    if settings.hidden_rotation:  # as from_settings does, on a copy: the caller's checkpoint stays the public one
        from shared.privacy.hidden_rotation import apply_secret_rotation

        middle = copy.deepcopy(middle)
        apply_secret_rotation(middle, settings.hidden_rotation)
    server = VerifierServer(
        settings, middle, checkpoint.config.max_position_embeddings, checkpoint.hidden_size, token_model=token_model
    )
    async with serving_verifier(server, start_timeout_s=10) as url:
        yield server, url


def loopback_agent_settings(ws_url: str, **overrides):
    """A device agent's settings for the demo model against the verifier at `ws_url`, its probes off."""
    from services.device_agent.settings import Settings
    from tests.conftest import DEMO_MODEL_DIR

    return Settings(
        model_dir=str(DEMO_MODEL_DIR),
        split_layers=2,
        verifier_url=ws_url,
        bandwidth_probe_interval_s=0,
        rtt_probe_interval_s=0,
        **overrides,
    )


@contextlib.asynccontextmanager
async def serving_verifier(server, start_timeout_s: float, stop_timeout_s: float = 30.0):
    """Run a built VerifierServer in this event loop until the block ends: yields its ws URL."""
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve_forever(stop, started))
    port = await asyncio.wait_for(started, start_timeout_s)
    try:
        yield f"ws://127.0.0.1:{port}/ws"
    finally:
        stop.set()
        await asyncio.wait_for(task, stop_timeout_s)


async def sse_text_and_errors(http: httpx.AsyncClient, url: str, body: dict) -> tuple[str, list[dict]]:
    """POST a streamed OpenAI request; (the text its chunks carried, the error objects it sent)."""
    text, errors = "", []
    async with http.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                elif chunk.get("choices"):
                    choice = chunk["choices"][0]
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, errors


def verifier_state(mesh) -> dict[str, int]:
    """The verifier's /readyz body, `sessions=N steps=M`, as a dict."""
    body = httpx.get(f"http://{mesh.config.host}:{mesh.config.verifier_port}/readyz", timeout=5).text
    return {k: int(v) for k, v in (part.split("=") for part in body.split()[:2])}


def device_sessions(mesh, index: int = 0) -> int:
    info = httpx.get(f"{mesh.config.device_url(index)}/info", timeout=5, auth=mesh.operator_auth())  # as the streamer
    return info.json()["active_sessions"]


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@contextlib.asynccontextmanager
async def device_agent_http(model_dir, verifier_url: str, split_layers: int = 2, **overrides):
    """A real device agent app (random adapter, fp32 wire, no chunking; `overrides`: other settings) on
    `verifier_url`, and an httpx client speaking to it in-process."""
    from services.device_agent import settings as device_settings
    from services.device_agent.app import create_app

    settings = device_settings.Settings(
        **{
            "model_dir": str(model_dir),
            "split_layers": split_layers,
            "adapter": "random",
            "verifier_url": verifier_url,
            "wire_dtype": "f4",
            "prompt_chunking": False,
            **overrides,
        }
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://device", timeout=60) as http:
            yield http
