"""Pipeline stages started on their own (`tophat stage`), on this host or others, wired by address.

The local pipeline spawns its stages and learns their ports through startup pipes (shared/wire/stage_chain.py).
A stage started on its own instead listens on a known `host:port` and holds a known layer range; the
verifier is given the stages' addresses and wires the same chain over a control connection per stage:

    for i = P-1 .. 0:  verifier --control--> stage i : credential, Wire(i, layers, next hop, run token)
                       stage i  --Wired or StageFailed--> verifier; stage i connects to its next hop
    verifier --hop 0--> stage 0 ... stage P-1 --hop P--> verifier's return listener

Wiring from the last stage back means every stage's downstream is already waiting for it. A stage reads
every control connection it accepts at once, each within its own `handshake_timeout_s` (shared/wire/stage_handshake.py's
`accept_first`), so a connection that stays silent does not hold the verifier's out. The control
connection is authenticated like every other hop of the mesh (a service credential, shared/auth/verify.py: a
device's credential is refused); the hops themselves present the per-run random token the verifier chose
and sent over the authenticated control connections, so a restart's hops refuse the old run's peers.

A run ends when a hop breaks or the verifier sends Stop: the stage drops every session's KV and waits to be
wired again. A verifier restart (its pipeline failed, or it was replaced) rewires the same stages; a stage
that is not there yet is retried until the start timeout (Swarm and Kubernetes start services in any order).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.verifier_cloud.stages import StageFailed
from shared.wire.stage_chain import TOKEN_BYTES, accept_link, bind_listener, connect_link, dial
from shared.wire.stage_codec import StageCodec, StageLinkError
from shared.wire.stage_handshake import HANDSHAKE_TIMEOUT_S, Address, accept_first
from shared.wire.stage_link import HEADER, MAGIC, LinkReceiver

log = logging.getLogger("services.verifier_cloud.remote_stages")


@dataclass
class Wire:
    """The verifier to stage `index`: you hold layers [start, stop); send what you compute to (host, port),
    presenting `run_token` (hex); expect the same token from upstream."""

    index: int
    start: int
    stop: int
    next_host: str
    next_port: int
    run_token: str


@dataclass
class Wired:
    """A stage's yes to Wire: it holds those layers, has dropped any earlier run's KV, and is connecting."""

    index: int
    start: int
    stop: int
    pid: int


CONTROL_CODEC = StageCodec((Wire, Wired, StageFailed))


@dataclass(frozen=True)
class RemoteStages:
    """Where the verifier finds its stages, and where the last one finds the verifier again."""

    addresses: tuple[Address, ...]  # stage i listens at addresses[i]
    return_bind: Address  # the return hop's listener (port 0: the kernel picks)
    return_host: str  # the host name the last stage dials for it (the verifier's name on the stages' network)
    credential: Callable[[], Awaitable[bytes]]  # a service token for the stages' audience, fresh per wiring
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  # what a connection to the return listener has to present

    async def wire(self, layers: Sequence[tuple[int, int]], timeout_s: float) -> tuple[socket.socket, socket.socket]:
        """A fresh credential, then `wire_remote_stages` off the event loop; StageLinkError on any failure."""
        try:
            credential = await asyncio.wait_for(self.credential(), timeout_s)
        except TimeoutError:
            raise StageLinkError("no credential for the stages within the start timeout") from None
        return await asyncio.to_thread(wire_remote_stages, self, layers, credential, timeout_s)


# -- the control connection: one framed message each way, outside a hop ----------------------------------

CREDENTIAL_LENGTH = struct.Struct("<H")
MAX_CREDENTIAL_BYTES = 8192  # a signed token with its header and claims is a few hundred bytes
MAX_CONTROL_FRAME_BYTES = 1 << 16  # a control message (Wire, Wired, StageFailed) is tiny


def send_credential(sock: socket.socket, credential: bytes) -> None:
    """What a control connection presents first: a length-prefixed credential (a signed token)."""
    if not 0 < len(credential) <= MAX_CREDENTIAL_BYTES:
        raise ValueError(f"a credential is 1..{MAX_CREDENTIAL_BYTES} bytes, got {len(credential)}")
    try:
        sock.sendall(CREDENTIAL_LENGTH.pack(len(credential)) + credential)
    except OSError as exc:
        raise StageLinkError(f"sending the credential failed: {exc}") from None


def send_message(sock: socket.socket, codec: StageCodec, message: Any) -> None:
    """One frame, written at once and due at once (a control message: no emulated link, no feeder thread)."""
    body = codec.encode(message)
    try:
        sock.sendall(HEADER.pack(MAGIC, len(body), 0.0) + body)
    except OSError as exc:
        raise StageLinkError(f"sending {type(message).__name__} failed: {exc}") from None


def read_message(
    sock: socket.socket, codec: StageCodec, timeout_s: float, max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES
) -> Any:
    """One frame's message within `timeout_s`: StageLinkError if none comes, it is malformed or too large."""
    receiver = LinkReceiver(sock, codec, "control", max_frame_bytes)
    try:
        return receiver.get(timeout_s)
    except queue.Empty:
        raise StageLinkError(f"no control message within {timeout_s:.0f}s") from None


# -- the verifier's side --------------------------------------------------------------------------------


def wire_remote_stages(
    remote: RemoteStages, layers: Sequence[tuple[int, int]], credential: bytes, timeout_s: float
) -> tuple[socket.socket, socket.socket]:
    """(hop 0 into stage 0, hop P back from the last stage), or StageLinkError naming the stage that failed."""
    if len(layers) != len(remote.addresses):
        raise StageLinkError(f"{len(layers)} layer ranges for {len(remote.addresses)} stage addresses")
    deadline = time.monotonic() + timeout_s
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        listener = bind_listener(*remote.return_bind)
    except OSError as exc:
        raise StageLinkError(f"cannot listen for the last stage on {remote.return_bind}: {exc}") from None
    try:
        next_hop: Address = (remote.return_host, listener.getsockname()[1])
        for index in reversed(range(len(layers))):
            wire = Wire(index, *layers[index], *next_hop, token.hex())
            _wire_one(remote.addresses[index], wire, credential, deadline)
            next_hop = remote.addresses[index]
        first = connect_link(remote.addresses[0], token, max(deadline - time.monotonic(), 0.1))
        try:
            last = accept_link(
                listener, token, max(deadline - time.monotonic(), 0.1), handshake_timeout_s=remote.handshake_timeout_s
            )
            return first, last
        except StageLinkError:
            first.close()
            raise
    finally:
        listener.close()


def _wire_one(address: Address, wire: Wire, credential: bytes, deadline: float) -> None:
    where = f"stage {wire.index} at {address[0]}:{address[1]}"
    try:
        sock = dial(address, max(deadline - time.monotonic(), 0.1))
    except StageLinkError as exc:
        raise StageLinkError(f"{where}: {exc}") from None
    try:
        send_credential(sock, credential)
        send_message(sock, CONTROL_CODEC, wire)
        # a stage still loading its layers (or ending an earlier run) answers once it can: wait up to the deadline
        reply = read_message(sock, CONTROL_CODEC, max(deadline - time.monotonic(), 0.1))
    except StageLinkError as exc:
        raise StageLinkError(f"{where}: {exc}") from None
    finally:
        sock.close()
    if isinstance(reply, StageFailed):
        raise StageLinkError(f"{where} refused: {reply.message}")
    if not (isinstance(reply, Wired) and (reply.index, reply.start, reply.stop) == (wire.index, wire.start, wire.stop)):
        raise StageLinkError(f"{where} answered {reply!r:.120} to {wire.index}'s wiring")
    log.info("%s wired: layers [%d, %d), pid %d", where, reply.start, reply.stop, reply.pid)


# -- the stage's side -----------------------------------------------------------------------------------


def control_missing(presented: bytes, max_frame_bytes: int = MAX_CONTROL_FRAME_BYTES) -> int:
    """How many more bytes a control connection's handshake needs: its length-prefixed credential, then one
    frame (the Wire); 0 once both are whole. StageLinkError for a credential or frame length out of bounds."""
    if len(presented) < CREDENTIAL_LENGTH.size:
        return CREDENTIAL_LENGTH.size - len(presented)
    (length,) = CREDENTIAL_LENGTH.unpack_from(presented)
    if not 0 < length <= MAX_CREDENTIAL_BYTES:
        raise StageLinkError(f"a {length}-byte credential is outside 1..{MAX_CREDENTIAL_BYTES}")
    header_at = CREDENTIAL_LENGTH.size + length
    if len(presented) < header_at + HEADER.size:
        return header_at + HEADER.size - len(presented)
    magic, body, _ = HEADER.unpack_from(presented, header_at)
    if magic != MAGIC or body > max_frame_bytes:
        raise StageLinkError(f"not a control frame (magic {magic!r}, {body} bytes)")
    return header_at + HEADER.size + body - len(presented)


def await_wiring(
    listener: socket.socket,
    index: int,
    layers: tuple[int, int],
    check_credential: Callable[[bytes], None],
    should_stop: Callable[[], bool] = lambda: False,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[Address, bytes] | None:
    """Accept control connections until one with a good credential wires this stage as it is: (next hop,
    run token), after answering Wired. Every connection is read at the same time, each within its own
    `handshake_timeout_s`; anything else is answered (StageFailed) or dropped, and logged; the stage waits on.
    None once `should_stop()`."""

    def admit(sock: socket.socket, presented: bytes, peer: Address) -> tuple[Address, bytes] | None:
        try:
            return _answer_control(sock, presented, index, layers, check_credential)
        except StageLinkError as exc:
            log.warning("stage %d: control connection from %s:%d refused: %s", index, *peer[:2], exc)
            return None
        finally:
            sock.close()

    try:
        return accept_first(
            listener, control_missing, admit, None, handshake_timeout_s, lambda: "stopping" if should_stop() else None
        )
    except StageLinkError:  # only `should_stop`
        return None


def _answer_control(
    sock: socket.socket,
    presented: bytes,
    index: int,
    layers: tuple[int, int],
    check_credential: Callable[[bytes], None],
) -> tuple[Address, bytes] | None:
    sock.settimeout(HANDSHAKE_TIMEOUT_S)  # the answer's send
    header_at = CREDENTIAL_LENGTH.size + CREDENTIAL_LENGTH.unpack_from(presented)[0]
    check_credential(presented[CREDENTIAL_LENGTH.size : header_at])  # StageLinkError (an AuthError, wrapped)
    wire = CONTROL_CODEC.decode(presented[header_at + HEADER.size :])
    if not isinstance(wire, Wire):
        raise StageLinkError(f"expected Wire, got {type(wire).__name__}")
    problem = _wiring_problem(wire, index, layers)
    if problem is not None:
        send_message(sock, CONTROL_CODEC, StageFailed(index, problem))
        raise StageLinkError(problem)
    send_message(sock, CONTROL_CODEC, Wired(index, *layers, os.getpid()))
    return (wire.next_host, wire.next_port), bytes.fromhex(wire.run_token)


def _wiring_problem(wire: Wire, index: int, layers: tuple[int, int]) -> str | None:
    if (wire.index, wire.start, wire.stop) != (index, *layers):
        return (
            f"this is stage {index} holding layers [{layers[0]}, {layers[1]}), "
            f"not stage {wire.index} with [{wire.start}, {wire.stop})"
        )
    if not 0 < wire.next_port < 65536 or not wire.next_host:
        return f"bad next hop {wire.next_host!r}:{wire.next_port}"
    try:
        token = bytes.fromhex(wire.run_token)
    except ValueError:
        token = b""
    if len(token) != TOKEN_BYTES:
        return f"the run token must be {TOKEN_BYTES} bytes of hex"
    return None
