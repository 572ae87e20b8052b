"""Accepting connections whose first bytes are a handshake (a token, a credential) that a stranger may never send.

`accept_first` takes every connection as it comes and reads what each presents concurrently, through one
selector, each within its own `handshake_timeout_s` (HANDSHAKE_TIMEOUT_S; at most MAX_PENDING_HANDSHAKES at once,
the oldest dropped first): a connection that stays silent, or trickles, costs only itself, and the right peer is
admitted as soon as it has presented its handshake. shared/wire/stage_link.py's hops and
services/verifier_cloud/remote_stages.py's control connections are accepted this way.
"""

from __future__ import annotations

import logging
import math
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from shared.wire.stage_codec import StageLinkError

log = logging.getLogger("shared.wire.stage_link")

HANDSHAKE_TIMEOUT_S = 5.0  # what one accepted connection has to present its token (or credential) in
MAX_PENDING_HANDSHAKES = 64  # connections read at once; a newer one pushes out the oldest
CHECK_EVERY_S = 0.2  # how often a wait checks whether it should give up

Address = tuple[str, int]
T = TypeVar("T")


@dataclass
class _Pending:
    """One accepted connection still presenting its handshake."""

    sock: socket.socket
    peer: Address
    deadline: float
    buffer: bytearray


class _Handshakes:
    """The connections accepted and not yet whole, read together through one selector."""

    def __init__(self, listener: socket.socket, handshake_timeout_s: float) -> None:
        self.listener, self.handshake_timeout_s = listener, handshake_timeout_s
        self.pending: dict[socket.socket, _Pending] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)

    def take(self, entry: _Pending) -> socket.socket:
        self.selector.unregister(entry.sock)
        del self.pending[entry.sock]
        return entry.sock

    def drop(self, entry: _Pending, why: str) -> None:
        self.take(entry).close()
        log.warning("stage link: dropped a connection from %s:%d: %s", *entry.peer[:2], why)

    def expire(self, now: float) -> None:
        for entry in [p for p in self.pending.values() if p.deadline <= now]:
            self.drop(entry, f"no handshake within {self.handshake_timeout_s:g}s")

    def next_expiry(self) -> float:
        return min((p.deadline for p in self.pending.values()), default=math.inf)

    def accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. out of file descriptors: the next round tries again
            log.warning("stage link: accept failed: %s", exc)
            return
        if len(self.pending) >= MAX_PENDING_HANDSHAKES:
            self.drop(min(self.pending.values(), key=lambda p: p.deadline), "too many handshakes at once")
        sock.setblocking(False)
        deadline = time.monotonic() + self.handshake_timeout_s
        self.pending[sock] = _Pending(sock, (str(peer[0]), int(peer[1])), deadline, bytearray())
        self.selector.register(sock, selectors.EVENT_READ)

    def read(self, entry: _Pending, missing: Callable[[bytes], int]) -> bool:
        """Read what `entry` has sent; True once its handshake is whole (then it is out of the pending set)."""
        try:
            chunk = entry.sock.recv(max(missing(bytes(entry.buffer)), 1))
            if not chunk:
                raise StageLinkError("closed during the handshake")
            entry.buffer += chunk
            if missing(bytes(entry.buffer)) > 0:
                return False
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, StageLinkError) as exc:
            self.drop(entry, str(exc))
            return False
        self.take(entry).setblocking(True)
        return True

    def close(self) -> None:
        for entry in list(self.pending.values()):
            self.take(entry).close()
        self.selector.close()


def accept_first(
    listener: socket.socket,
    missing: Callable[[bytes], int],
    admit: Callable[[socket.socket, bytes, Address], T | None],
    timeout_s: float | None,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    check: Callable[[], str | None] | None = None,
) -> T | None:
    """Accept connections and read what each presents, all at once, until one is admitted: `admit`'s answer.

    `missing(bytes so far)` says how many more bytes a connection's handshake needs (0: it is whole; a
    StageLinkError: it is malformed). A whole handshake goes to `admit(sock, bytes, peer)` (the socket
    blocking again), which returns the result, or None (or a StageLinkError) to refuse it: then the socket is
    closed. A malformed, closed or late one (past its own `handshake_timeout_s`) is dropped and costs nothing
    else. None when `timeout_s` passes (None: no limit); StageLinkError with `check`'s reason when it gives one."""
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    handshakes = _Handshakes(listener, handshake_timeout_s)
    listener.setblocking(False)
    try:
        while True:
            if check is not None and (reason := check()) is not None:
                raise StageLinkError(reason)
            now = time.monotonic()
            if now >= deadline:
                return None
            handshakes.expire(now)
            wait = min(CHECK_EVERY_S, handshakes.next_expiry() - now, deadline - now)
            for key, _ in handshakes.selector.select(max(wait, 0.0)):
                if key.fileobj is listener:
                    handshakes.accept()
                    continue
                entry = handshakes.pending.get(key.fileobj)  # type: ignore[call-overload]
                if entry is None or not handshakes.read(entry, missing):  # None: pushed out by a newer one
                    continue
                try:
                    result = admit(entry.sock, bytes(entry.buffer), entry.peer)
                except StageLinkError as exc:
                    log.warning("stage link: refused a connection from %s:%d: %s", *entry.peer[:2], exc)
                    result = None
                if result is not None:
                    return result
                entry.sock.close()
    finally:
        handshakes.close()
        listener.setblocking(True)
