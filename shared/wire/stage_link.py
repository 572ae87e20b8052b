"""The stage transport: length-prefixed msgpack frames over TCP, each hop an emulated link.

Pipeline stages (the verifier's P workers; Jupiter's edge devices) are
separate processes chained by one TCP connection per hop:

    main --hop 0--> stage 0 --hop 1--> stage 1 ... stage P-1 --hop P--> main

A hop carries frames one way, in order (TCP's FIFO is what keeps every
stage's KV in step). `LinkSender.put(message)` and `LinkReceiver.get(timeout)`
have the queue interface the stages were written against: put never blocks
on the network (a feeder thread writes, like multiprocessing.Queue's), get
raises queue.Empty when nothing is due within the timeout.

Frame: a 16-byte header `magic, body length (u32), deliver_at (f64)` and a
msgpack body (shared/wire/stage_codec.py; never pickle: a peer must not be able to
run code here). A bad magic or an oversized length leaves the stream
unreadable: the receiver closes the connection and raises StageLinkError. A
body that does not decode drops that frame only and raises StageLinkError;
either way the receiving process goes on and decides what to do (a stage
reports StageFailed downstream; the main process fails and restarts the
pipeline).

Emulated link (`LinkProfile`, shared/net/links.py): the sender owns the hop's
schedule. A frame starts onto the link when the previous one has finished
(FIFO), occupies it for bytes / bandwidth (the profile's uplink: a hop runs in
one direction), and is due at send_done + latency (+/- jitter). The sender
stamps that due time in the header and sends at once; the receiver holds the
frame until time.monotonic() reaches the stamp. ASSUMPTION: both ends read
the same clock. time.monotonic() is CLOCK_MONOTONIC, system-wide on Linux, so
this holds for processes on one host; stages on other hosts would need the
stamp replaced by a receiver-side schedule. An unshaped hop stamps 0 (due at
once).

A hop's connection is made and authenticated by shared/wire/stage_chain.py.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from shared.net.links import UNSHAPED, LinkProfile
from shared.wire.stage_codec import StageCodec, StageLinkError

log = logging.getLogger("shared.wire.stage_link")

MAGIC = b"TSL1"
HEADER = struct.Struct("<4sId")  # magic, body bytes, deliver_at (time.monotonic(); 0 = at once)
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a prefill micro-batch of a 4096-wide model at 4096 tokens is 64 MiB
MAX_HOLD_S = 120.0  # a stamp further ahead than this is refused: a peer cannot park a frame forever
_RECV_CHUNK = 1 << 20


# -- the emulated link's schedule (pure) ----------------------------------------------------


@dataclass(frozen=True)
class FrameSlot:
    """When a frame of a shaped hop starts onto the link, finishes sending, and may be delivered."""

    start: float
    send_done: float
    deliver_at: float


def schedule_frame(
    link_free_at: float, now: float, nbytes: int, profile: LinkProfile, jitter_draw: float = 0.0
) -> FrameSlot:
    """A frame of `nbytes` handed to the hop at `now`, the link busy until `link_free_at` (FIFO).

    `jitter_draw` in [-1, 1] scales the profile's jitter (the caller draws it; uniform, as netem)."""
    if not -1.0 <= jitter_draw <= 1.0:
        raise ValueError(f"jitter_draw must be in [-1, 1], got {jitter_draw}")
    start = max(now, link_free_at)
    bandwidth = profile.uplink_bytes_s
    send_done = start if math.isinf(bandwidth) else start + nbytes / bandwidth
    return FrameSlot(start, send_done, send_done + profile.latency_s + jitter_draw * profile.jitter_s)


class LinkPacer:
    """One hop's running schedule: each frame's deliver_at stamp (0.0 on an unshaped hop)."""

    def __init__(self, profile: LinkProfile = UNSHAPED, seed: int | None = None):
        self.profile = profile
        self.link_free_at = 0.0
        self._rng = random.Random(seed)

    def stamp(self, nbytes: int, now: float) -> float:
        if not self.profile.shaped:
            return 0.0
        draw = self._rng.uniform(-1.0, 1.0) if self.profile.jitter_s > 0 else 0.0
        slot = schedule_frame(self.link_free_at, now, nbytes, self.profile, draw)
        self.link_free_at = slot.send_done
        return slot.deliver_at


# -- the two ends of a hop ------------------------------------------------------------------


class LinkSender:
    """The upstream end: encode on the caller's thread, pace, and let a feeder thread write."""

    def __init__(
        self,
        sock: socket.socket,
        codec: StageCodec,
        profile: LinkProfile = UNSHAPED,
        name: str = "hop",
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ):
        self.sock, self.codec, self.name, self.max_frame_bytes = sock, codec, name, max_frame_bytes
        self.pacer = LinkPacer(profile)
        self.error: str | None = None  # set by the feeder when the connection broke
        self._frames: queue.SimpleQueue[tuple[bytes, bytes] | None] = queue.SimpleQueue()
        self._feeder = threading.Thread(target=self._feed, name=f"stage-link-{name}", daemon=True)
        self._feeder.start()

    def put(self, message: Any) -> None:
        """Queue one message for the hop; never waits on the network. StageLinkError if the link broke."""
        if self.error is not None:
            raise StageLinkError(f"{self.name}: link broken: {self.error}")
        body = self.codec.encode(message)
        if len(body) > self.max_frame_bytes:
            raise StageLinkError(
                f"{self.name}: a {type(message).__name__} of {len(body)} bytes exceeds "
                f"the {self.max_frame_bytes}-byte frame limit"
            )
        deliver_at = self.pacer.stamp(HEADER.size + len(body), time.monotonic())
        self._frames.put((HEADER.pack(MAGIC, len(body), deliver_at), body))

    def _feed(self) -> None:
        while (frame := self._frames.get()) is not None:
            try:
                self.sock.sendall(frame[0])
                self.sock.sendall(frame[1])
            except OSError as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("stage link %s: send failed: %s", self.name, self.error)
                return

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what was put (bounded by `timeout_s`), then close the connection."""
        self._frames.put(None)
        self._feeder.join(timeout_s)
        _shut(self.sock)


class LinkReceiver:
    """The downstream end: whole frames, decoded and held until their deliver_at stamp."""

    def __init__(
        self, sock: socket.socket, codec: StageCodec, name: str = "hop", max_frame_bytes: int = MAX_FRAME_BYTES
    ):
        self.sock, self.codec, self.name, self.max_frame_bytes = sock, codec, name, max_frame_bytes
        self.closed = False
        self._buffer = bytearray()
        self._due: tuple[float, Any] | None = None  # decoded, waiting for its deliver_at

    def get(self, timeout: float) -> Any:
        """The next message, once due. queue.Empty if none is due within `timeout`; StageLinkError for a
        refused frame (dropped) or a broken or closed connection (then every later get raises too)."""
        deadline = time.monotonic() + timeout
        if self._due is None:
            self._due = self._next_frame(deadline)
        deliver_at, message = self._due
        wait = deliver_at - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, max(deadline - time.monotonic(), 0.0)))
            if time.monotonic() < deliver_at:
                raise queue.Empty
        self._due = None
        return message

    def _next_frame(self, deadline: float) -> tuple[float, Any]:
        while True:
            if len(self._buffer) >= HEADER.size:
                magic, length, deliver_at = HEADER.unpack_from(self._buffer)
                if magic != MAGIC or length > self.max_frame_bytes:
                    self._break(
                        f"bad magic {magic!r}"
                        if magic != MAGIC
                        else f"a {length}-byte frame exceeds the {self.max_frame_bytes}-byte limit"
                    )
                if len(self._buffer) >= HEADER.size + length:
                    body = bytes(self._buffer[HEADER.size : HEADER.size + length])
                    del self._buffer[: HEADER.size + length]  # consumed: a refused body drops this frame only
                    if not math.isfinite(deliver_at) or deliver_at - time.monotonic() > MAX_HOLD_S:
                        raise StageLinkError(f"{self.name}: frame stamped {deliver_at!r}, beyond any link's delay")
                    try:
                        return deliver_at, self.codec.decode(body)
                    except StageLinkError as exc:
                        raise StageLinkError(f"{self.name}: {exc}") from None
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        if self.closed:
            raise StageLinkError(f"{self.name}: connection closed")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise queue.Empty
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(_RECV_CHUNK)
        except TimeoutError:
            raise queue.Empty from None
        except OSError as exc:
            self._break(f"{type(exc).__name__}: {exc}")
        if not chunk:
            self._break("peer closed the connection", warn=False)
        self._buffer += chunk

    def _break(self, reason: str, warn: bool = True) -> None:
        if not self.closed:
            (log.warning if warn else log.info)("stage link %s: %s; closing it", self.name, reason)
        self.closed = True
        self._buffer.clear()
        _shut(self.sock)
        raise StageLinkError(f"{self.name}: {reason}")

    def close(self) -> None:
        self.closed = True
        _shut(self.sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
    except OSError:
        pass  # already closed or never connected
    sock.close()
