"""Connecting the stage transport's hops: listen, dial, authenticate, and wire a chain of stage
processes on one host (the frames that then cross each hop: shared/wire/stage_link.py).

Connections are authenticated with a per-pipeline random token the parent
hands its children at spawn: a connector sends it first; an acceptor drops
any connection that does not, so a stray local client cannot take a hop.
An acceptor reads every connection's token at once, each within its own
`handshake_timeout_s` (shared/wire/stage_handshake.py): a connection that stays
silent costs only itself.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from shared.wire.stage_codec import StageLinkError
from shared.wire.stage_handshake import CHECK_EVERY_S, HANDSHAKE_TIMEOUT_S, Address, accept_first

# The transport's one logger (stage_handshake.py logs there too): a hop's refusals read in one place.
log = logging.getLogger("shared.wire.stage_link")

TOKEN_BYTES = 16
LISTEN_BACKLOG = 16


def bind_listener(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket for one hop's downstream end (port 0: the kernel picks; read getsockname())."""
    return socket.create_server((host, port), backlog=LISTEN_BACKLOG)


def dial(address: Address, timeout_s: float) -> socket.socket:
    """A TCP connection to `address`, retrying a refused connect until `timeout_s` (the listener may still be
    starting: a stage loading its layers, a container being replaced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.01))
        except (ConnectionRefusedError, socket.gaierror) as exc:  # not up yet; a peer's name not yet resolvable
            if time.monotonic() >= deadline:
                raise StageLinkError(
                    f"no listener at {address[0]}:{address[1]} within {timeout_s:.0f}s ({exc})"
                ) from None
            time.sleep(0.05 if isinstance(exc, ConnectionRefusedError) else 0.5)
        except OSError as exc:
            raise StageLinkError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from None


def connect_link(address: Address, token: bytes, timeout_s: float) -> socket.socket:
    """Connect to a hop's listener and authenticate, retrying a refused connect until `timeout_s`."""
    sock = dial(address, timeout_s)
    try:
        sock.sendall(token)
    except OSError as exc:
        sock.close()
        raise StageLinkError(f"handshake with {address[0]}:{address[1]} failed: {exc}") from None
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames go out whole, not after a delayed ACK
    return sock


def accept_link(
    listener: socket.socket,
    token: bytes,
    timeout_s: float,
    check: Callable[[], str | None] | None = None,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> socket.socket:
    """Accept the hop's one connection that presents `token` within `timeout_s`; others are dropped, each
    given `handshake_timeout_s` to present it (concurrently: `accept_first`). `check` (between short waits)
    returns a reason to give up early, e.g. the peer process died."""

    def admit(sock: socket.socket, presented: bytes, peer: Address) -> socket.socket | None:
        if hmac.compare_digest(presented, token):
            return sock
        log.warning("stage link: dropped a connection from %s:%d without the pipeline's token", *peer[:2])
        return None

    sock = accept_first(listener, lambda buffer: len(token) - len(buffer), admit, timeout_s, handshake_timeout_s, check)
    if sock is None:
        raise StageLinkError(f"no stage connected to {listener.getsockname()} within {timeout_s:.0f}s")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- bootstrap: wiring a chain of stage processes on one host ---------------------------------
#
# The parent creates one startup pipe per stage (addresses only: no message ever goes through it) and a
# random token, and spawns every stage at once. Each stage binds port 0 on its host and sends
# (host, port) up its pipe. Once all have, the parent binds its return listener and sends each stage
# its next hop's address (stage i+1's, the last stage the parent's). Each stage connects downstream,
# then accepts its upstream (the listen backlog takes a connect before its accept, so the order
# cannot deadlock); the parent connects to stage 0 and accepts the last. Stages on other hosts would
# need only a different way to learn the addresses: every hop is an explicit (host, port).


def join_chain(host: str, startup: Connection, token: bytes, timeout_s: float) -> tuple[socket.socket, socket.socket]:
    """A stage's side: (its upstream connection, its downstream connection)."""
    try:
        listener = bind_listener(host)
    except OSError as exc:
        raise StageLinkError(f"cannot listen on {host}: {exc}") from None
    try:
        startup.send(tuple(listener.getsockname()[:2]))
        if not startup.poll(timeout_s):
            raise StageLinkError(f"no next-hop address from the parent within {timeout_s:.0f}s")
        next_hop = _address(startup.recv())
        downstream = connect_link(next_hop, token, timeout_s)
        try:
            return accept_link(listener, token, timeout_s), downstream
        except StageLinkError:
            downstream.close()
            raise
    except (EOFError, OSError) as exc:
        raise StageLinkError(f"startup pipe to the parent failed: {exc}") from None
    finally:
        listener.close()


def chain_stages(
    startups: list[Connection], host: str, token: bytes, timeout_s: float, check: Callable[[], str | None]
) -> tuple[socket.socket, socket.socket]:
    """The parent's side: (its connection to stage 0, its connection from the last stage).
    `check` returns a reason to give up (a stage process died); StageLinkError on any failure."""
    deadline = time.monotonic() + timeout_s
    addresses: list[Address] = []
    for index, startup in enumerate(startups):
        try:
            while not startup.poll(CHECK_EVERY_S):
                if (reason := check()) is not None:
                    raise StageLinkError(reason)
                if time.monotonic() > deadline:
                    raise StageLinkError(f"stage {index} did not report its address within {timeout_s:.0f}s")
            addresses.append(_address(startup.recv()))
        except (EOFError, OSError) as exc:
            raise StageLinkError(f"stage {index}'s startup pipe failed: {exc}") from None
    try:
        listener = bind_listener(host)
    except OSError as exc:
        raise StageLinkError(f"cannot listen for the last stage on {host}: {exc}") from None
    try:
        for startup, next_hop in zip(startups, addresses[1:] + [_address(listener.getsockname()[:2])]):
            startup.send(next_hop)
        first = connect_link(addresses[0], token, max(deadline - time.monotonic(), 0.1))
        try:
            return first, accept_link(listener, token, max(deadline - time.monotonic(), 0.1), check)
        except StageLinkError:
            first.close()
            raise
    except OSError as exc:
        raise StageLinkError(f"wiring the stages failed: {exc}") from None
    finally:
        listener.close()


def _address(raw: Any) -> Address:
    if not (isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[0], str) and type(raw[1]) is int):
        raise StageLinkError(f"not a (host, port) address: {raw!r:.80}")
    return raw[0], raw[1]
