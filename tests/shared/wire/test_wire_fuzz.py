"""Fuzz the wire decoder on its own: tens of thousands of frames in a few seconds.

Whatever arrives, `wire.decode` (with the verifier's own options) either returns a valid message
or raises `WireError` carrying an `ErrorCode`, never any other exception. Each refusal's answer
(`WireError.to_frame`, what the verifier sends back) encodes and decodes with the same code, and a
frame that decodes survives a re-encode unchanged. Three sources of frames: the live fuzzer's
seeded mutations of valid frames (loadgen/fuzz_wire.py), arbitrary bytes, and msgpack maps built
from the schema's own keys and type codes with values of every msgpack type (hypothesis,
derandomized so CI sees the same frames every run).
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadgen.fuzz_wire import mutate, templates
from shared.wire import schema as wire

# end-to-end: real processes, meshes or long statistical runs (make test-fast leaves these out)
pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)

HIDDEN = 8
OPEN_FIELDS = {"split_layers": 2, "fingerprint": 0x1234}
SEEDED_FRAMES = 30_000
HYPOTHESIS = settings(
    max_examples=1_000, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


class DecodeTally:
    """Frames seen, refusals by code, and anything that escaped as another exception or a bad answer."""

    def __init__(self) -> None:
        self.frames = 0
        self.by_code: Counter = Counter()
        self.escaped: list[str] = []

    def check(self, frame: bytes | str) -> None:
        self.frames += 1
        try:
            message = wire.decode(frame, expected_hidden_size=HIDDEN, finite_only=True)
        except wire.WireError as exc:
            self._check_refusal(frame, exc)
            return
        except Exception as exc:  # noqa: BLE001 - the very thing under test: record it with its frame
            self.escaped.append(f"{frame[:64]!r}: {type(exc).__name__}: {exc}"[:300])
            return
        self.by_code["valid"] += 1
        if not isinstance(message, wire.Message) or wire.decode(wire.encode(message)) != message:
            self.escaped.append(f"{frame[:64]!r}: decoded to {message!r}, which does not survive a re-encode"[:300])

    def _check_refusal(self, frame: bytes | str, exc: wire.WireError) -> None:
        if not isinstance(exc.code, wire.ErrorCode):
            self.escaped.append(f"{frame[:64]!r}: WireError without an ErrorCode: {exc.code!r}")
            return
        self.by_code[exc.code.name] += 1
        try:
            answer = wire.decode(wire.encode(exc.to_frame()))
        except Exception as err:  # noqa: BLE001 - an answer that cannot be built would drop the connection
            self.escaped.append(f"{frame[:64]!r}: its ErrorFrame does not encode: {type(err).__name__}: {err}"[:300])
            return
        if not isinstance(answer, wire.ErrorFrame) or answer.code != exc.code:
            self.escaped.append(f"{frame[:64]!r}: answered {answer!r}, expected code {exc.code.name}"[:300])

    def summary(self) -> str:
        return f"{self.frames} frames, " + ", ".join(f"{k} {v}" for k, v in self.by_code.most_common())


def test_seeded_mutations_of_valid_frames_decode_or_raise_a_typed_error():
    rng = random.Random(2024)
    tally = DecodeTally()
    for _ in range(SEEDED_FRAMES):
        tally.check(mutate(rng.choice(templates(HIDDEN, (5, 6), OPEN_FIELDS, rng)), rng))
    log.info("seeded decoder fuzz: %s", tally.summary())
    assert not tally.escaped, f"{tally.summary()}; escaped: {tally.escaped[:5]}"
    assert tally.frames == SEEDED_FRAMES
    # The mutations reach many different checks, and some stay valid (so the valid path is fuzzed too).
    reached = {"MALFORMED", "BAD_VERSION", "UNKNOWN_TYPE", "BAD_DTYPE", "BAD_SHAPE", "LENGTH_MISMATCH", "BAD_VALUE"}
    assert reached <= tally.by_code.keys() and tally.by_code["valid"] >= 500, tally.summary()


def _run_property(strategy, to_frame) -> DecodeTally:
    """Every example hypothesis draws from `strategy`, checked; the first problem fails (and is shrunk)."""
    tally = DecodeTally()

    @HYPOTHESIS
    @given(strategy)
    def run(example):
        tally.check(to_frame(example))
        assert not tally.escaped, tally.escaped[-1]

    run()
    return tally


def test_arbitrary_bytes_decode_or_raise_a_typed_error():
    tally = _run_property(st.binary(max_size=200), bytes)
    log.info("arbitrary-bytes decoder fuzz: %s", tally.summary())
    assert tally.frames >= 1_000, tally.summary()


# Values of every msgpack type, ints at the edges of u64/i64, tensors good and bad. Version and type code are
# valid here (the mutations and the arbitrary bytes cover those checks), so every map reaches the field checks
# of a real message type: each of its fields holds a value of the field's own kind (often, so that checks past
# the first bad field are reached too) or of any other, plus now and then a key no type has.
_INTS = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**32, 2**63, 2**64 - 1, HIDDEN]))
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, st.floats(), st.text(max_size=8), st.binary(max_size=40))
_TENSORS = st.fixed_dictionaries(
    {
        "d": st.one_of(st.sampled_from([wd.value for wd in wire.WireDtype]), _SCALARS),
        "s": st.one_of(st.lists(st.integers(-2, 2**33), max_size=3), st.sampled_from([[1, HIDDEN], [2, HIDDEN]])),
        "b": st.one_of(
            st.binary(max_size=4 * 2 * HIDDEN),
            st.binary(min_size=2 * HIDDEN, max_size=2 * HIDDEN),
            st.binary(min_size=4 * HIDDEN, max_size=4 * HIDDEN),
        ),
    }
)
_ANY = st.one_of(_SCALARS, _TENSORS, st.lists(_INTS, max_size=3))
_OF_KIND = {
    wire.U64: st.integers(0, 2**64 - 1),
    wire.OPT_U64: st.integers(0, 2**64 - 1),
    wire.BOOL: st.booleans(),
    wire.TEXT: st.text(max_size=8),
    wire.CREDENTIAL: st.text(max_size=8),
    wire.DTYPE: st.sampled_from([wd.value for wd in wire.WireDtype]),
    wire.CODE: st.integers(0, 16),
    wire.TENSOR: _TENSORS,
    wire.FLOAT: st.floats(-2, 2),
    wire.TOKENS: st.binary(max_size=16),
    wire.OPT_TOKENS: st.binary(max_size=16),
    wire.OPT_ROWS: st.binary(max_size=16),
    wire.OPT_PROBS: st.one_of(
        st.binary(max_size=16),
        st.lists(st.floats(-1, 2, width=32), min_size=1, max_size=4).map(
            lambda xs: np.asarray(xs, dtype="<f4").tobytes()
        ),
    ),
}


def _maps_of(code: int) -> st.SearchStrategy[dict]:
    fields = {key: st.one_of(_OF_KIND[kind], _OF_KIND[kind], _ANY) for _name, key, kind, _ in wire._TYPES[code]._spec}
    return st.fixed_dictionaries(
        {"v": st.just(wire.WIRE_VERSION), "t": st.just(code), **fields}, optional={"zz": _SCALARS}
    )


_MAPS = st.sampled_from(sorted(wire._TYPES)).flatmap(_maps_of)


def test_schema_shaped_maps_decode_or_raise_a_typed_error():
    tally = _run_property(_MAPS, lambda frame_map: msgpack.packb(frame_map, use_bin_type=True))
    log.info("schema-shaped decoder fuzz: %s", tally.summary())
    assert tally.frames >= 1_000, tally.summary()
    assert len(tally.by_code) >= 5, tally.summary()  # the field checks: bad dtypes, shapes, lengths, values...
