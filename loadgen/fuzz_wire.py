"""Wire fuzzer: seeded mutations of valid frames sent to a live verifier over one WebSocket.

Every mutated frame is first decoded here with the verifier's own rules (`shared.wire.schema.decode`,
same frame limit and hidden size), so the fuzzer knows which frames are bad and which typed
code the verifier must answer with. Frames are sent one at a time and each gets exactly one
reply, so replies line up with frames without any matching. Frames that still decode and
would address a protected session are not sent: the fuzz must leave those sessions alone,
so the caller can check afterwards that they verify exactly as before.

`tophat bench fuzz-wire` starts a verifier on a free loopback port (SmolLM2 by default,
`--model demo` for the small model), opens a session, runs the fuzz on the same connection and prints the counts:
frames sent, typed errors, connections dropped (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from shared.wire import schema as wire

log = logging.getLogger("loadgen.fuzz_wire")

REPLY_TIMEOUT_S = 10.0
# Values a well-typed field must refuse: wrong types, negative and out-of-range ints, floats that are not numbers.
WRONG_VALUES = (
    -1,
    -(2**63),
    2**64 - 1,
    2**63,
    1.5,
    float("nan"),
    float("inf"),
    True,
    False,
    None,
    "7",
    b"\x07",
    [1, 2],
    {"a": 1},
    0,
    2**32,
)
MUTATIONS = (
    "bit_flip",
    "truncate",
    "wrong_type",
    "swap",
    "drop_key",
    "extra_key",
    "tensor",
    "type_code",
    "version",
    "append",
    "junk",
    "text",
)
# the mutations of the frame's bytes (_mutate_bytes); the others change its decoded map (_mutate_map)
BYTE_MUTATIONS = frozenset({"bit_flip", "truncate", "append", "junk", "text"})


@dataclass
class FuzzCounts:
    frames_sent: int = 0
    bad_frames: int = 0  # frames the wire schema refuses (each must get a typed ErrorFrame)
    typed_errors: int = 0  # bad frames answered with an ErrorFrame carrying the expected code
    wrong_replies: list[str] = field(default_factory=list)  # bad frames answered otherwise (must stay empty)
    valid_frames: int = 0  # mutations that still decode; the verifier answers them like any frame
    connections_dropped: int = 0
    by_code: Counter = field(default_factory=Counter)  # bad frames by the code the schema gives them
    valid_replies: Counter = field(default_factory=Counter)  # what still-valid frames were answered with
    elapsed_s: float = 0.0

    def summary(self) -> str:
        rate = self.frames_sent / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (
            f"frames sent {self.frames_sent} in {self.elapsed_s:.1f} s ({rate:.0f}/s), typed errors "
            f"{self.typed_errors} (of {self.bad_frames} bad frames), connections dropped "
            f"{self.connections_dropped}, still-valid frames {self.valid_frames}, wrong replies "
            f"{len(self.wrong_replies)}; errors by code: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.by_code.items()))
            + "; valid frames answered with: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.valid_replies.items()))
        )


def templates(hidden: int, session_ids: tuple[int, ...], open_fields: dict, rng: random.Random) -> list[wire.Message]:
    """Valid frames of every type the verifier meets, addressed to the fuzz's own sessions."""
    sid = rng.choice(session_ids)
    seq = rng.randrange(1, 2**32)
    num_final = rng.randrange(2)

    def rows(n: int) -> torch.Tensor:  # [n, H]
        return torch.randn(n, hidden, generator=torch.Generator().manual_seed(rng.randrange(2**31)))

    return [
        wire.OpenSession(rng.randrange(2**40, 2**41), hidden, **open_fields),
        wire.CloseSession(sid),
        wire.ForkSession(rng.randrange(2**40, 2**41), sid, rng.randrange(4) if rng.random() < 0.5 else None),
        wire.PrefillChunk(sid, seq, rng.randrange(4), rng.random() < 0.5, rows(rng.randint(1, 3))),
        wire.VerifyRequest(sid, seq, rng.randrange(4), rows(rng.randint(1, 3))),
        wire.BandwidthProbe(0, seq, rng.randint(1, 4), rows(1)),
        wire.OpenTokenSession(sid, 0.5, 0.9, 3),
        wire.TokenStep(sid, seq, 2, (5, 6)),
        wire.TokenDraft(
            sid,
            seq,
            rng.randrange(2),
            rng.randrange(4),
            (5, 6, 7),
            num_final,
            rng.random() < 0.5,
            rng.randrange(11),
            torch.full((3 - num_final,), 0.5) if rng.random() < 0.5 else None,
        ),
        wire.TokenVerdict(sid, seq, 1, 0, rejected=True, vocab_size=4, probs=torch.tensor([0.5, 0.5]), indices=(1, 2)),
        wire.SessionOpened(sid),
        wire.ErrorFrame(wire.ErrorCode.INTERNAL, "x", sid, seq),
    ]


def _pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def mutate(message: wire.Message, rng: random.Random) -> bytes | str:
    """One seeded mutation of a valid frame: bytes, or a text frame."""
    frame = wire.encode(message)
    kind = rng.choice(MUTATIONS)
    if kind in BYTE_MUTATIONS:
        return _mutate_bytes(kind, frame, rng)
    m = msgpack.unpackb(frame, raw=False)
    _mutate_map(kind, m, rng)
    return _pack(m)


def _mutate_bytes(kind: str, frame: bytes, rng: random.Random) -> bytes | str:
    """The frame broken below msgpack: flipped bits, cut short, trailing bytes, noise, or a text frame."""
    if kind == "bit_flip":
        out = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == "truncate":
        return frame[: rng.randrange(len(frame))]
    if kind == "append":
        return frame + rng.randbytes(rng.randint(1, 8))
    if kind == "junk":
        return rng.randbytes(rng.randint(0, 64))
    return '{"v": 1, "t": 3, "s": 1}'  # text


def _mutate_map(kind: str, m: dict, rng: random.Random) -> None:
    """The frame's decoded map broken in place: a field's value, its keys, its tensor, its type code or version."""
    keys = [k for k in m if k not in ("v", "t")] or ["s"]
    if kind == "wrong_type":
        m[rng.choice(keys)] = rng.choice(WRONG_VALUES)
    elif kind == "swap" and len(keys) >= 2:
        a, b = rng.sample(keys, 2)
        m[a], m[b] = m[b], m[a]
    elif kind == "drop_key":
        m.pop(rng.choice(list(m)))
    elif kind == "extra_key":
        m[rng.choice(("x", "prompt", "zz", "S", "h", "s", "q"))] = rng.choice(WRONG_VALUES)
    elif kind == "tensor" and isinstance(m.get("h"), dict):
        m["h"] = _mutate_tensor(m["h"], rng)
    elif kind == "type_code":
        m["t"] = rng.choice((0, 5, 0x13, 0x5D, 0x7E, 127, 200, -1, "t", None, 2**63))
    elif kind == "version":
        m["v"] = rng.choice((0, 1, 3, 255, -1, "2", True, None, 2.0))  # 1: an old peer
    else:  # a structural mutation that did not apply to this frame: break a session id instead
        m["s"] = rng.choice(WRONG_VALUES)


def _mutate_tensor(original: dict, rng: random.Random) -> dict:
    """A copy of a tensor's {"d", "s", "b"} map with one part broken: its dtype code, shape or bytes."""
    tensor = copy.copy(original)
    part = rng.choice(("d", "s", "b"))
    if part == "d":
        tensor["d"] = rng.choice(("f8", "i4", "", 2, None, "f4", "bf"))
    elif part == "s":
        tensor["s"] = rng.choice(
            ([0, 1], [-1, 4], [1], [1, 2, 3], [2**40, 2**40], "1x4", [1, 0], [tensor["s"][0] + 1, tensor["s"][1]])
        )
    else:
        raw = tensor["b"]
        tensor["b"] = rng.choice(
            (raw[:-1], raw + b"\0", b"", "text", raw[: len(raw) // 2], b"\xff" * len(raw))
        )  # all bits set: NaN in every float dtype
    return tensor


def expected_error(
    frame: bytes | str, hidden: int, max_frame_bytes: int
) -> tuple[wire.ErrorCode | None, wire.Message | None]:
    """(code the verifier must answer, None) for a bad frame; (None, message) for one that decodes."""
    if isinstance(frame, str):
        return wire.ErrorCode.MALFORMED, None
    try:
        return None, wire.decode(frame, max_frame_bytes=max_frame_bytes, expected_hidden_size=hidden, finite_only=True)
    except wire.WireError as exc:
        return exc.code, None


async def _exchange(ws: ClientConnection, frame: bytes | str) -> wire.Message:
    await asyncio.wait_for(ws.send(frame), REPLY_TIMEOUT_S)
    # the verifier answers in binary frames: their bytes, as the wire decodes them
    return wire.decode(await asyncio.wait_for(ws.recv(decode=False), REPLY_TIMEOUT_S), max_frame_bytes=2**31)


async def fuzz_connection(
    ws: ClientConnection,
    hidden: int,
    *,
    frames: int = 2000,
    seed: int = 0,
    protected: frozenset[int] = frozenset(),
    open_fields: dict | None = None,
    max_frame_bytes: int = wire.MAX_FRAME_BYTES,
    reconnect: Callable[[], Awaitable[ClientConnection]] | None = None,
) -> FuzzCounts:
    """Send `frames` mutated frames on `ws`, one reply each; never touch `protected` sessions.

    A connection that closes is counted; with `reconnect` the fuzz goes on over a new one,
    otherwise it stops there."""
    rng = random.Random(seed)
    open_fields = open_fields or {}
    counts = FuzzCounts()
    started = time.perf_counter()
    own = tuple(rng.randrange(2**32, 2**33) for _ in range(2))
    for sid in own:  # the fuzz's own sessions, so that mutations which stay valid have something to act on
        await _exchange(ws, wire.encode(wire.OpenSession(sid, hidden, **open_fields)))
    while counts.frames_sent < frames:
        frame = mutate(rng.choice(templates(hidden, own, open_fields, rng)), rng)
        code, message = expected_error(frame, hidden, max_frame_bytes)
        if message is not None and getattr(message, "session_id", None) in protected:
            continue  # still valid and aimed at a session the caller will check: leave it alone
        counts.frames_sent += 1
        try:
            reply = await _exchange(ws, frame)
        except ConnectionClosed as exc:
            counts.connections_dropped += 1
            log.warning("connection dropped after frame %d (%r): %s", counts.frames_sent, frame[:64], exc)
            if reconnect is None:
                break
            ws = await reconnect()
            continue
        if code is None:
            counts.valid_frames += 1
            answered = type(reply).__name__
            if isinstance(reply, wire.ErrorFrame):
                answered += f" {reply.code.name}"
                if reply.code == wire.ErrorCode.INTERNAL:  # a valid frame met a bug in the handler
                    counts.wrong_replies.append(f"{frame[:48]!r}: valid frame answered {reply!r}"[:300])
            counts.valid_replies[answered] += 1
            continue
        counts.bad_frames += 1
        counts.by_code[code.name] += 1
        if isinstance(reply, wire.ErrorFrame) and reply.code == code:
            counts.typed_errors += 1
        else:
            counts.wrong_replies.append(f"{frame[:48]!r}: expected {code.name}, got {reply!r}"[:300])
    counts.elapsed_s = time.perf_counter() - started
    return counts


async def _main(args: argparse.Namespace) -> FuzzCounts:
    from services.verifier_cloud.server import VerifierServer
    from services.verifier_cloud.settings import Settings
    from tophatctl.models import resolve_model

    settings = Settings(
        port=0, model_dir=str(resolve_model(args.model)), split_layers=args.split_layers, log_level="warning"
    )
    server = VerifierServer.from_settings(settings)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.serve_forever(stop, started))
    try:
        port = await asyncio.wait_for(started, 120)
        url = f"ws://127.0.0.1:{port}/ws"
        open_fields: dict[str, Any] = {"split_layers": settings.split_layers, "fingerprint": server.split_fingerprint}
        ws = await connect(url, max_size=None, open_timeout=10)
        protected = 1
        await _exchange(ws, wire.encode(wire.OpenSession(protected, server.hidden_size, **open_fields)))

        async def reconnect() -> ClientConnection:
            return await connect(url, max_size=None, open_timeout=10)

        counts = await fuzz_connection(
            ws,
            server.hidden_size,
            frames=args.frames,
            seed=args.seed,
            protected=frozenset({protected}),
            open_fields=open_fields,
            max_frame_bytes=settings.max_frame_bytes,
            reconnect=reconnect,
        )
        await ws.close()
        return counts
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    counts = asyncio.run(_main(args))
    print(
        f"frames sent: {counts.frames_sent} in {counts.elapsed_s:.1f} s "
        f"({counts.frames_sent / max(counts.elapsed_s, 1e-9):.0f} frames/s)"
    )
    print(
        f"typed errors: {counts.typed_errors} (of {counts.bad_frames} bad frames; "
        f"{counts.valid_frames} mutations still valid)"
    )
    print(f"connections dropped: {counts.connections_dropped}")
    print("errors by code: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.by_code.items())))
    print("still-valid frames answered with: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.valid_replies.items())))
    for line in counts.wrong_replies[:10]:
        print(f"wrong reply: {line}")
    return 0 if counts.connections_dropped == 0 and not counts.wrong_replies else 1
