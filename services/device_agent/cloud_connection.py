"""The device agent's WebSocket connection to verifier-cloud, under cloud_client.py's `WebSocketCloud`.

One connection per device agent, shared by all its sessions; `url` may list several verifier replicas and a
connection goes to the first that answers. Replies are matched to requests by (session_id, seq_no); a reader
task owns the receive side. If the connection drops, every waiting request fails with `CloudUnavailable` and
the next request reconnects. Every wait is bounded by `request_timeout_s`. With auth on, a connection sends
the verifier a fresh token at half the life of the one in force (reauth.py), so it outlives its first token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from services.device_agent.cloud_errors import CloudError, CloudTimeout, CloudUnavailable
from services.device_agent.reauth import keep_fresh
from shared.auth.client import BrokerAuth, CredentialUnavailable
from shared.auth.tls import websocket_ssl
from shared.net.links import LinkProfile
from shared.net.shaper import DelayLine, shapers_for
from shared.wire import schema as wire

log = logging.getLogger("services.device_agent.cloud")

# Replies that answer a session-level request (open/close) carry no seq_no.
SESSION_SEQ = -1

FrameHook = Callable[[str, int], None]  # (direction "up"/"down", bytes of one WebSocket message); must not raise


class CloudConnection:
    def __init__(
        self,
        url: str,
        wire_dtype: wire.WireDtype,
        request_timeout_s: float,
        connect_timeout_s: float,
        max_frame_bytes: int,
        link: LinkProfile | None,
        on_frame: FrameHook | None,
        tls_ca: str,
        auth: BrokerAuth | None,
    ):
        self.urls = [u.strip() for u in url.split(",") if u.strip()]
        if not self.urls:
            raise ValueError("no verifier URL")
        self.url = self.urls[0]  # the replica connected to (or tried) last
        self._next_url = 0
        self.wire_dtype = wire_dtype
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.on_frame = on_frame  # every message's payload bytes, each way (the device's link metrics)
        self.tls_ca = tls_ca  # the CA trusted for wss:// replicas (empty: the system's CAs)
        self.auth = auth  # this device's token for the verifier (shared/auth/client.py); fresh on every connect
        self._connection: ClientConnection | None = None
        self._reader: asyncio.Task | None = None
        self._connect_lock = asyncio.Lock()
        self._waiting: dict[tuple[int, int], asyncio.Future] = {}
        self._seq = itertools.count(1)
        # In-process link emulation (when the kernel path is unavailable): frames pass through
        # a delay line per direction, so bandwidth and latency apply to real WebSocket traffic.
        self._shapers = shapers_for(link) if link is not None else None
        self._uplink: DelayLine | None = None
        self._downlink: DelayLine | None = None
        self.not_ready_reason = "not yet connected to the verifier"  # why the device is not ready (/readyz)

    @property
    def connected(self) -> bool:
        return self._connection is not None and self._reader is not None and not self._reader.done()

    async def _ensure_connected(self) -> ClientConnection:
        async with self._connect_lock:
            if self._connection is not None and self._reader is not None and not self._reader.done():
                return self._connection
            failures = []
            for attempt in range(len(self.urls)):
                index = (self._next_url + attempt) % len(self.urls)
                self.url = self.urls[index]
                try:
                    token = await self.auth.token() if self.auth is not None else None
                    headers = {"Authorization": f"Bearer {token}"} if token is not None else None
                    self._connection = await connect(
                        self.url,
                        open_timeout=self.connect_timeout_s,
                        max_size=self.max_frame_bytes,
                        compression=None,
                        ping_interval=20,
                        ping_timeout=20,
                        ssl=websocket_ssl(self.url, self.tls_ca),  # None for ws://
                        additional_headers=headers,
                    )
                except (OSError, TimeoutError, InvalidHandshake, InvalidURI, CredentialUnavailable) as exc:
                    failures.append(f"{self.url}: {exc or type(exc).__name__}")
                    continue
                self._next_url = index
                break
            else:
                raise CloudUnavailable(f"cannot reach a verifier ({'; '.join(failures)})")
            if self._shapers is not None:
                connection = self._connection
                self._uplink = DelayLine(self._shapers[0], connection.send)
                self._downlink = DelayLine(self._shapers[1], self._deliver_frame)
            renewal = self._keep_fresh(self._connection, token)
            self._reader = asyncio.create_task(self._read_loop(self._connection, renewal))
            log.info("connected to verifier %s", self.url)
            return self._connection

    def _keep_fresh(self, connection: ClientConnection, token: str | None) -> asyncio.Task | None:
        """The task renewing `connection`'s token (reauth.py), owned by its read loop; None with auth off."""
        if token is None or self.auth is None:
            return None

        async def send(frame: bytes) -> None:
            if self._uplink is not None:
                await self._uplink.put(frame)
            else:
                await connection.send(frame)
            if self.on_frame is not None:
                self.on_frame("up", len(frame))

        renewal = keep_fresh(token, self.auth.token, send, timeout_s=self.request_timeout_s)
        return asyncio.create_task(renewal, name="verifier-token-renewal")

    async def _read_loop(self, connection: ClientConnection, renewal: asyncio.Task | None = None) -> None:
        try:
            async for frame in connection:
                if self._downlink is not None:
                    await self._downlink.put(frame)
                else:
                    await self._deliver_frame(frame)
        except ConnectionClosed:
            pass
        finally:
            if renewal is not None:  # the connection's token dies with it
                renewal.cancel()
            if self._downlink is not None:
                await self._downlink.aclose()
            if self._uplink is not None:
                await self._uplink.aclose()
            failure = CloudUnavailable("connection to the verifier closed")
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(failure)
            self._waiting.clear()
            self._next_url = (self.urls.index(self.url) + 1) % len(self.urls)  # another replica first next time
            self.not_ready_reason = f"the connection to the verifier at {self.url} closed"
            log.info("connection to verifier %s closed", self.url)

    async def _deliver_frame(self, frame: bytes | str) -> None:
        received = time.perf_counter()
        if self.on_frame is not None:
            self.on_frame("down", len(frame))
        if isinstance(frame, str):  # a text frame: the verifier sends binary ones only (wire.decode refuses it)
            log.warning("undecodable frame from the verifier: MALFORMED: frame must be bytes, got str")
            return
        try:
            message = wire.decode(frame, max_frame_bytes=self.max_frame_bytes)
        except wire.WireError as exc:
            log.warning("undecodable frame from the verifier: %s", exc)
            return
        self._deliver(message, len(frame), received)

    def _deliver(self, message: wire.Message, nbytes: int, received: float) -> None:
        seq_no = getattr(message, "seq_no", None)
        session_id = getattr(message, "session_id", None)
        key = (session_id, SESSION_SEQ if seq_no is None else seq_no)
        # nothing waits under a None session id: every request is sent under its session's (`_send`)
        future = self._waiting.pop((session_id, key[1]), None) if session_id is not None else None
        if future is None and isinstance(message, wire.ErrorFrame) and message.session_id is not None:
            # An error about a session-level request, or one we cannot place.
            future = self._waiting.pop((message.session_id, SESSION_SEQ), None)
        if future is None:
            log.warning("unexpected %s from the verifier (session %s, seq %s)", type(message).__name__, *key)
            return
        if future.done():
            return
        if isinstance(message, wire.ErrorFrame):
            future.set_exception(CloudError(wire.ErrorCode(message.code), message.message))
        else:
            future.set_result(message)

    async def _send(self, message: wire.Message, key: tuple[int, int]) -> asyncio.Future:
        connection = await self._ensure_connected()
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        frame = wire.encode(message, wire_dtype=self.wire_dtype)
        try:
            async with asyncio.timeout(self.request_timeout_s):
                if self._uplink is not None:
                    await self._uplink.put(frame)
                else:
                    await connection.send(frame)
        except TimeoutError as exc:
            self._waiting.pop(key, None)
            raise CloudTimeout(f"the verifier did not take a frame within {self.request_timeout_s}s") from exc
        except (ConnectionClosed, RuntimeError) as exc:
            self._waiting.pop(key, None)
            raise CloudUnavailable(f"sending to the verifier failed: {type(exc).__name__}") from exc
        if self.on_frame is not None:
            self.on_frame("up", len(frame))
        return future

    async def _wait(self, future: asyncio.Future, key: tuple[int, int]) -> wire.Message:
        try:
            async with asyncio.timeout(self.request_timeout_s):
                return await future
        except TimeoutError as exc:
            self._waiting.pop(key, None)
            raise CloudTimeout(f"the verifier did not answer within {self.request_timeout_s}s") from exc

    async def _request(self, message: wire.Message, key: tuple[int, int]) -> wire.Message:
        return await self._wait(await self._send(message, key), key)

    async def close_connection(self) -> None:
        if self._connection is not None:
            await self._connection.close()
        if self._reader is not None:
            try:
                async with asyncio.timeout(5):
                    await self._reader
            except TimeoutError:
                self._reader.cancel()
