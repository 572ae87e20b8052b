"""Wire schema: round trips, exact dtype bits, every rejection path, overhead bound."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.wire import schema as wire
from shared.wire.schema import (
    MAX_FRAME_BYTES,
    WIRE_VERSION,
    ChunkAck,
    CloseSession,
    DeepHidden,
    ErrorCode,
    ErrorFrame,
    Message,
    OpenSession,
    OpenTokenSession,
    PrefillChunk,
    SessionClosed,
    SessionOpened,
    TokenPrefill,
    TokenResult,
    TokenStep,
    VerifyRequest,
    VerifyResult,
    WireDtype,
    WireError,
    assert_privacy_safe,
    decode,
    decode_tensor,
    encode,
    encode_tensor,
    max_rows_per_frame,
)

H = 16
SPLIT = {"split_layers": 2, "fingerprint": 0x1234_5678_9ABC_DEF0}  # OpenSession's split identity
U64 = st.integers(0, 2**64 - 1)
DTYPES = [torch.float16, torch.float32, torch.bfloat16]


def _h(rows: int = 3, dtype: torch.dtype = torch.float16, hidden: int = H) -> torch.Tensor:
    return torch.randn(rows, hidden).to(dtype)  # [rows, H]


def _raw(msg: Message) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def _pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def _err(frame: bytes, code: ErrorCode, **kw) -> WireError:
    with pytest.raises(WireError) as info:
        decode(frame, **kw)
    assert info.value.code == code, info.value
    return info.value


ALL_MESSAGES = [
    OpenSession(1, 4096, split_layers=2, fingerprint=0),
    OpenSession(2**64 - 1, 256, "bf", privacy=False, split_layers=2**64 - 1, fingerprint=2**64 - 1),
    SessionOpened(7),
    CloseSession(7),
    SessionClosed(7),
    PrefillChunk(7, 0, 0, False, _h(32)),
    PrefillChunk(7, 1, 32, True, _h(5, torch.bfloat16)),
    ChunkAck(7, 0),
    DeepHidden(7, 1, _h(1, torch.float32)),
    VerifyRequest(7, 2, 37, _h(5)),
    VerifyResult(7, 2, _h(5)),
    ErrorFrame(ErrorCode.UNKNOWN_SESSION, "no such session", 7, 2),
    ErrorFrame(ErrorCode.OVERLOADED, "busy"),
    wire.BandwidthProbe(0, 3, 128, _h(1)),
    wire.ProbeReply(0, 3, _h(128)),
    wire.ForkSession(8, 7),  # the parent's whole length
    wire.ForkSession(2**64 - 1, 7, length=37),
    wire.Reauthenticate("eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJkZXYtYSJ9.c2ln"),  # a credential, not prompt text
    wire.Reauthenticate("x" * wire.MAX_CREDENTIAL_CHARS),
]

TOKEN_MESSAGES = [
    OpenTokenSession(7),
    OpenTokenSession(2**64 - 1, temperature=0.8, top_p=0.95, seed=2**63),
    TokenPrefill(7, 0, [1, 2, 2**32 - 1]),
    TokenPrefill(7, 0, tuple(range(5000)), start_pos=3),  # far more ids than the unpacker's array limit
    TokenStep(7, 1, 3, [42]),
    TokenResult(7, 1, [0]),
    wire.TokenDraft(7, 4, 0, 12, (5, 6, 7), 1, True),  # greedy: no q
    wire.TokenDraft(7, 5, 3, 15, (8,), 0, False, top_k=0, draft_probs=torch.tensor([0.25])),
    wire.TokenVerdict(7, 4, 0, 2),  # all accepted, more promised
    wire.TokenVerdict(7, 5, 4, 0, rejected=True, token=9),  # greedy correction
    wire.TokenVerdict(7, 6, 4, 1, rejected=True, vocab_size=100, probs=torch.tensor([0.5, 0.25]), indices=(3, 4)),
    wire.TokenVerdict(7, 7, 4, 0, rejected=True, vocab_size=3, probs=torch.tensor([0.5, 0.25, 0.25])),
    wire.TokenVerdict(7, 8, 5, 0, stale=True),
]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_every_message(msg):
    out = decode(encode(msg))
    assert type(out) is type(msg) and out == msg
    assert_privacy_safe(encode(msg))  # nothing we define carries tokens or text


@pytest.mark.parametrize("msg", TOKEN_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_every_token_message_and_privacy_flags_it(msg):
    out = decode(encode(msg))
    assert type(out) is type(msg) and out == msg
    with pytest.raises(WireError) as info:
        assert_privacy_safe(encode(msg))
    assert info.value.code == ErrorCode.PRIVACY_VIOLATION
    assert info.value.session_id == msg.session_id


def test_every_registered_type_is_covered_and_codes_are_one_byte():
    assert {type(m) for m in ALL_MESSAGES + TOKEN_MESSAGES} == set(wire._TYPES.values())
    assert all(0 < code < 128 for code in wire._TYPES)
    # the token range and the carries_token_ids flag coincide exactly
    assert all((code in wire.TOKEN_MODE_CODES) == cls.carries_token_ids for code, cls in wire._TYPES.items())


def test_token_ids_are_four_bytes_each():
    frame = encode(TokenPrefill(7, 0, tuple(range(1000))))
    assert 4000 <= len(frame) <= 4000 + 32
    assert _raw(TokenStep(1, 2, 3, [258]))["i"] == (258).to_bytes(4, "little")


@pytest.mark.parametrize(
    "value,code",
    [
        (b"", ErrorCode.BAD_SHAPE),
        (b"\x01\x00\x00", ErrorCode.LENGTH_MISMATCH),
        ([1, 2], ErrorCode.MALFORMED),
        ("12", ErrorCode.MALFORMED),
        (None, ErrorCode.MALFORMED),
    ],
)
def test_bad_token_ids_are_rejected_and_addressed(value, code):
    m = _raw(TokenStep(7, 2, 3, [5]))
    err = _err(_pack({**m, "i": value}), code)
    assert (err.session_id, err.seq_no) == (7, 2)


def test_token_message_construction_is_validated():
    for bad in ([], [-1], [2**32], [True], [1.0], "ab"):
        with pytest.raises(WireError):
            TokenResult(1, 1, bad)
    for kw in (
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"temperature": float("nan")},
        {"temperature": "0.5"},
    ):
        with pytest.raises(WireError) as info:
            OpenTokenSession(1, **kw)
        assert info.value.code == ErrorCode.MALFORMED
    assert OpenTokenSession(1, temperature=1).temperature == 1.0  # ints are exact floats
    o = _raw(OpenTokenSession(4, 0.5, 0.9))
    assert "r" not in o  # an absent seed costs nothing
    _err(_pack({**o, "T": -1.0}), ErrorCode.MALFORMED)
    _err(_pack({**o, "pv": False}), ErrorCode.MALFORMED)  # no privacy switch: token sessions have none


@settings(max_examples=60, deadline=None)
@given(
    sid=U64,
    seq=U64,
    commit=U64,
    rows=st.integers(1, 8),
    hidden=st.integers(1, 48),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
    special=st.booleans(),
)
def test_verify_round_trip_property(sid, seq, commit, rows, hidden, dtype, seed, special):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=g) * 100).to(dtype)  # [K, H]
    if special:
        h.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0])[: h.numel()].to(dtype)
    msg = VerifyRequest(sid, seq, commit, h)
    out = decode(encode(msg), expected_hidden_size=hidden)
    assert out == msg and out.hidden.dtype == dtype and out.hidden.shape == (rows, hidden)


@pytest.mark.parametrize("dtype,code", [(torch.bfloat16, "bf"), (torch.float16, "f2")])
def test_all_16_bit_patterns_round_trip_exactly(dtype, code):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = bits.view(dtype).reshape(256, 256)  # [256, 256] every bit pattern, NaNs included
    out = decode_tensor(msgpack.unpackb(_pack(encode_tensor(t, code)), raw=False))
    assert out.dtype == dtype and torch.equal(out.view(torch.int16), bits.reshape(256, 256))


def test_encode_dtype_choice():
    f32 = torch.randn(2, H)
    assert decode(encode(VerifyResult(1, 1, f32))).hidden.dtype == torch.float32  # kept
    assert decode(encode(VerifyResult(1, 1, f32.double()))).hidden.dtype == torch.float16
    out = decode(encode(VerifyResult(1, 1, f32), wire_dtype=WireDtype.BF16)).hidden
    assert torch.equal(out, f32.to(torch.bfloat16))
    assert encode_tensor(f32)["d"] == "f2"  # float16 is the default on the wire


def test_decode_accepts_bytearray_and_memoryview_and_tensor_is_usable():
    frame = encode(ALL_MESSAGES[9])
    for f in (bytearray(frame), memoryview(frame)):
        assert decode(f) == ALL_MESSAGES[9]
    h = decode(frame).hidden.float()  # [K, H]
    assert (h @ torch.ones(H, 1)).shape == (5, 1)


def test_non_contiguous_and_grad_tensors_encode():
    base = torch.randn(H, 4, requires_grad=True)
    msg = VerifyRequest(1, 1, 0, base.t())  # [4, H] transposed view with grad
    assert torch.equal(decode(encode(msg, wire_dtype="f4")).hidden, base.t().detach())


# ---------------------------------------------------------------- rejections


def test_oversized_is_rejected_before_unpacking(monkeypatch):
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: pytest.fail("parsed"))
    _err(b"\xc1" * 101, ErrorCode.OVERSIZED, max_frame_bytes=100)
    _err(encode(ALL_MESSAGES[5]), ErrorCode.OVERSIZED, max_frame_bytes=64)


def test_default_limit_is_16_mib():
    assert MAX_FRAME_BYTES == 16 * 1024 * 1024
    _err(b"\x00" * (MAX_FRAME_BYTES + 1), ErrorCode.OVERSIZED)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b'{"v": 1}',
        encode(ALL_MESSAGES[9])[:-1],
        encode(ALL_MESSAGES[9])[:7],
        encode(ALL_MESSAGES[2]) + b"\x00",
        _pack([1, 2]),
        _pack(5),
        _pack({1: 2}),
        _pack({"v": WIRE_VERSION, "t": 2, "s": 1, "x": [None] * 100_000}),
        _pack({"v": WIRE_VERSION, "t": 2, "s": "a" * 5000}),
        _pack({"v": WIRE_VERSION, "t": 2, "s": msgpack.ExtType(1, b"x")}),
    ],
    ids=[
        "empty",
        "reserved-byte",
        "json",
        "truncated-tail",
        "truncated-head",
        "trailing",
        "array",
        "int",
        "int-key",
        "huge-array",
        "huge-str",
        "ext",
    ],
)
def test_not_a_msgpack_map_is_malformed(frame):
    _err(frame, ErrorCode.MALFORMED)


def test_text_frame_is_malformed():
    _err("hello", ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "version,code",
    [
        (1, ErrorCode.BAD_VERSION),
        (2, ErrorCode.BAD_VERSION),
        (0, ErrorCode.BAD_VERSION),
        ("3", ErrorCode.BAD_VERSION),
        (True, ErrorCode.BAD_VERSION),
        (None, ErrorCode.MALFORMED),
    ],
)
def test_version(version, code):
    m = _raw(SessionOpened(3))
    if version is None:
        del m["v"]
    else:
        m["v"] = version
    _err(_pack(m), code)
    assert WIRE_VERSION == 3


def test_type_field():
    m = _raw(ChunkAck(3, 4))
    _err(_pack({**m, "t": 0x5D}), ErrorCode.UNKNOWN_TYPE)
    _err(_pack({**m, "t": "ChunkAck"}), ErrorCode.MALFORMED)
    _err(_pack({k: v for k, v in m.items() if k != "t"}), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "key,value",
    [
        ("s", -1),
        ("s", "7"),
        ("s", True),
        ("s", 1.0),
        ("q", None),
        ("c", [1]),
        ("h", b"\x00" * 10),
        ("h", {"d": "f2", "s": [5, H]}),
        ("zz", 1),
    ],
)
def test_wrong_typed_or_extra_fields_are_malformed(key, value):
    m = _raw(VerifyRequest(7, 2, 37, _h(5)))
    _err(_pack({**m, key: value}), ErrorCode.MALFORMED)


@pytest.mark.parametrize("key", ["s", "q", "c", "h"])
def test_missing_field_is_malformed(key):
    m = _raw(VerifyRequest(7, 2, 37, _h(5)))
    del m[key]
    _err(_pack(m), ErrorCode.MALFORMED)


def test_other_field_kinds():
    p = _raw(PrefillChunk(7, 0, 0, False, _h(2)))
    _err(_pack({**p, "l": 1}), ErrorCode.MALFORMED)  # is_last must be a real bool
    _err(_pack({**_raw(OpenSession(1, H, **SPLIT)), "d": "f8"}), ErrorCode.BAD_DTYPE)
    _err(_pack({**_raw(ErrorFrame(ErrorCode.INTERNAL, "x")), "e": 99}), ErrorCode.MALFORMED)
    _err(_pack({**_raw(ErrorFrame(ErrorCode.INTERNAL, "x")), "m": b"x"}), ErrorCode.MALFORMED)
    o = _raw(OpenSession(1, H, **SPLIT))
    del o["pv"], o["d"]  # defaulted fields may be omitted; privacy defaults to on
    assert decode(_pack(o)) == OpenSession(1, H, WireDtype.F16, privacy=True, **SPLIT)
    for key in ("m", "f"):  # the split identity may not: a device must say what it ran
        _err(_pack({k: v for k, v in _raw(OpenSession(1, H, **SPLIT)).items() if k != key}), ErrorCode.MALFORMED)
    _err(_pack({**_raw(OpenSession(1, H, **SPLIT)), "f": -1}), ErrorCode.MALFORMED)
    _err(_pack({**_raw(OpenSession(1, H, **SPLIT)), "m": "2"}), ErrorCode.MALFORMED)


def _tensor_frame(**tensor_overrides) -> bytes:
    m = _raw(VerifyRequest(7, 2, 37, _h(5)))
    m["h"] = {**m["h"], **tensor_overrides}
    return _pack(m)


@pytest.mark.parametrize(
    "overrides,code",
    [
        ({"d": "f8"}, ErrorCode.BAD_DTYPE),
        ({"d": 2}, ErrorCode.BAD_DTYPE),
        ({"s": [5 * H]}, ErrorCode.BAD_SHAPE),
        ({"s": [1, 5, H]}, ErrorCode.BAD_SHAPE),
        ({"s": [0, H]}, ErrorCode.BAD_SHAPE),
        ({"s": [-5, -H]}, ErrorCode.BAD_SHAPE),
        ({"s": "5x16"}, ErrorCode.MALFORMED),
        ({"s": [5, H + 1]}, ErrorCode.LENGTH_MISMATCH),
        ({"s": [2**40, 2**40]}, ErrorCode.LENGTH_MISMATCH),
        ({"d": "f4"}, ErrorCode.LENGTH_MISMATCH),
        ({"b": b"\x00" * 3}, ErrorCode.LENGTH_MISMATCH),
        ({"b": "text"}, ErrorCode.MALFORMED),
    ],
)
def test_tensor_rejections_carry_session_and_seq(overrides, code):
    err = _err(_tensor_frame(**overrides), code)
    assert (err.session_id, err.seq_no) == (7, 2)
    reply = decode(encode(err.to_frame()))
    assert reply == ErrorFrame(code, err.message, 7, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 37, -1])  # first, inside, last element (after any vectorised stretch)
def test_non_finite_states_are_bad_value_where_asked(dtype, bad, where):
    h = _h(5, dtype, hidden=64)  # [5, 64]
    h.view(-1)[where] = bad
    frame = encode(VerifyRequest(7, 2, 37, h))
    assert decode(frame).hidden.shape == (5, 64)  # the device's side and tools see the bits as they are
    err = _err(frame, ErrorCode.BAD_VALUE, finite_only=True)
    assert (err.session_id, err.seq_no) == (7, 2)
    finite = encode(VerifyRequest(7, 2, 37, _h(5, dtype, hidden=64).clamp(-65504, 65504)))
    assert decode(finite, finite_only=True).hidden.shape == (5, 64)


def test_wrong_hidden_size_is_bad_shape():
    frame = encode(VerifyRequest(9, 4, 0, _h(5, hidden=H)))
    assert decode(frame, expected_hidden_size=H).hidden.shape == (5, H)
    err = _err(frame, ErrorCode.BAD_SHAPE, expected_hidden_size=H * 2)
    assert (err.session_id, err.seq_no) == (9, 4)
    err = _err(encode(OpenSession(5, H, **SPLIT)), ErrorCode.BAD_SHAPE, expected_hidden_size=H * 2)
    assert (err.session_id, err.seq_no) == (5, None)


def test_unknown_type_still_addressed_when_s_and_q_present():
    err = _err(_pack({"v": WIRE_VERSION, "t": 0x5D, "s": 11, "q": 12}), ErrorCode.UNKNOWN_TYPE)
    assert (err.session_id, err.seq_no) == (11, 12)
    assert err.to_frame() == ErrorFrame(ErrorCode.UNKNOWN_TYPE, err.message, 11, 12)


@pytest.mark.parametrize("sid,seq", [(-1, 3), (7, -(2**63)), (2**64, 2**70), ("7", 1.0), (True, None)])
def test_errors_about_invalid_ids_are_answered_unaddressed(sid, seq):
    """The id that made a frame bad cannot address its answer: building that answer must not raise."""

    def valid(v):
        return type(v) is int and 0 <= v < 2**64

    frame = WireError(ErrorCode.MALFORMED, "bad ids", sid, seq).to_frame()
    assert (frame.session_id, frame.seq_no) == (sid if valid(sid) else None, seq if valid(seq) else None)
    if type(sid) is int and -(2**63) <= sid < 0:  # msgpack carries it: the decoder must not copy it
        err = _err(_pack({"v": WIRE_VERSION, "t": 0x03, "s": sid}), ErrorCode.MALFORMED)
        assert err.session_id is None and decode(encode(err.to_frame())).session_id is None


def test_unparseable_errors_are_unaddressed():
    err = _err(encode(ALL_MESSAGES[9])[:-1], ErrorCode.MALFORMED)
    assert (err.session_id, err.seq_no) == (None, None)
    assert err.to_frame().session_id is None


def test_construction_is_validated_too():
    with pytest.raises(WireError) as info:
        VerifyRequest(1, 1, 0, torch.randn(H))  # 1-D
    assert info.value.code == ErrorCode.BAD_SHAPE
    for bad in (-1, 2**64, True, 1.0):
        with pytest.raises(WireError):
            SessionOpened(bad)
    with pytest.raises(WireError) as info:
        OpenSession(1, H, "f8", **SPLIT)
    assert info.value.code == ErrorCode.BAD_DTYPE
    with pytest.raises(dataclasses.FrozenInstanceError):
        SessionOpened(1).session_id = 2


def test_long_error_text_is_truncated_in_frames():
    assert len(WireError(ErrorCode.INTERNAL, "x" * 10_000).to_frame().message) <= 512


# ---------------------------------------------------------------- privacy


@pytest.fixture
def extra_type():
    """Register a throwaway message class, unregistering it afterwards."""
    made = []

    def make(code, **fields):
        cls = type(
            "Probe",
            (Message,),
            {"__annotations__": {k: v[0] for k, v in fields.items()}, **{k: v[1] for k, v in fields.items()}},
        )
        made.append(code)
        return wire._message(code)(cls)

    yield make
    for code in made:
        wire._TYPES.pop(code, None)


def test_token_mode_message_is_a_privacy_violation(extra_type):
    Probe = extra_type(
        0x5F, session_id=("int", wire._f("s", wire.U64)), tokens=("torch.Tensor", wire._f("h", wire.TENSOR))
    )
    assert Probe.carries_token_ids  # set by the registry for any code in the token range
    frame = encode(Probe(3, torch.zeros(1, 4)))
    with pytest.raises(WireError) as info:
        assert_privacy_safe(frame)
    assert info.value.code == ErrorCode.PRIVACY_VIOLATION and info.value.session_id == 3


def test_text_field_is_a_privacy_violation(extra_type):
    Probe = extra_type(0x6E, prompt=("str", wire._f("m", wire.TEXT)))  # outside the token range
    assert not Probe.carries_token_ids
    with pytest.raises(WireError) as info:
        assert_privacy_safe(encode(Probe("def read_config(path):")))
    assert info.value.code == ErrorCode.PRIVACY_VIOLATION


def test_smuggled_text_key_is_rejected_by_the_strict_schema():
    m = _raw(VerifyRequest(7, 2, 37, _h(5)))
    with pytest.raises(WireError) as info:
        assert_privacy_safe(_pack({**m, "prompt": "secret"}))
    assert info.value.code == ErrorCode.MALFORMED


# ---------------------------------------------------------------- size


@pytest.mark.parametrize("sid", [0, 7, 2**32, 2**63, 2**64 - 1])
def test_verify_request_overhead_at_most_64_bytes(sid):
    for seq, commit in [(0, 0), (2**32 - 1, 2**31), (2**63, 2**63)]:
        h = _h(5, hidden=256)  # [K=5, H=256]
        overhead = len(encode(VerifyRequest(sid, seq, commit, h))) - h.nbytes
        assert overhead <= 64, overhead


def test_max_rows_per_frame_fits():
    limit = 64 * 1024
    rows = max_rows_per_frame(256, "f2", limit)
    frame = encode(PrefillChunk(2**63, 2**32, 2**40, True, _h(rows, hidden=256)))
    assert len(frame) <= limit < len(frame) + 256 * 2 * 2
    assert decode(frame, max_frame_bytes=limit).hidden.shape == (rows, 256)


@pytest.mark.parametrize(
    "build",
    [
        lambda: wire.TokenDraft(7, 1, 0, 0, (1, 2), 2, True),  # num_final > 1
        lambda: wire.TokenDraft(7, 1, 0, 0, (1, 2), 1, True, draft_probs=torch.tensor([0.5, 0.5])),  # one q too many
        lambda: wire.TokenDraft(7, 1, 0, 0, (1,), 0, True, draft_probs=torch.tensor([1.5])),  # not a probability
        lambda: wire.TokenDraft(7, 1, 0, 0, (1,), 0, True, draft_probs=torch.tensor([float("nan")])),
        lambda: wire.TokenVerdict(7, 1, 0, 0, stale=True, token=3),  # a stale verdict carries nothing
        lambda: wire.TokenVerdict(7, 1, 0, 0, rejected=True),  # a rejection without a correction or a row
        lambda: wire.TokenVerdict(7, 1, 0, 0, rejected=True, vocab_size=9, probs=torch.tensor([0.5])),  # partial row
        lambda: wire.TokenVerdict(
            7, 1, 0, 0, probs=torch.tensor([0.5]), indices=(1,), vocab_size=9
        ),  # row, no rejection
    ],
)
def test_stream_messages_refuse_inconsistent_fields(build):
    with pytest.raises(WireError):
        build()


def test_a_draft_probability_frame_with_a_ragged_payload_is_a_typed_error():
    frame = msgpack.unpackb(encode(wire.TokenDraft(7, 1, 0, 0, (1,), 0, True, draft_probs=torch.tensor([0.5]))))
    frame["dq"] = b"\0\0\0"
    with pytest.raises(WireError) as info:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert info.value.code == ErrorCode.LENGTH_MISMATCH and info.value.session_id == 7


@pytest.mark.parametrize("field,value", [("ps", -1), ("ps", "7"), ("n", -2), ("n", True), ("ps", None)])
def test_a_fork_with_a_bad_parent_or_length_is_refused_and_addressed_to_the_child(field, value):
    m = _raw(wire.ForkSession(8, 7, length=3))
    err = _err(_pack({**m, field: value}), ErrorCode.MALFORMED)
    assert err.session_id == 8  # the session the refusal answers: the one the device asked to open


def test_a_fork_without_its_parent_is_malformed():
    m = _raw(wire.ForkSession(8, 7))
    del m["ps"]
    _err(_pack(m), ErrorCode.MALFORMED)


@pytest.mark.parametrize(
    "token, code",
    [
        ("", ErrorCode.MALFORMED),
        ("Bearer a.b.c", ErrorCode.MALFORMED),  # a header value, not a token
        ("a.b.c\n", ErrorCode.MALFORMED),
        ("\u00e9.b.c", ErrorCode.MALFORMED),
        (b"a.b.c", ErrorCode.MALFORMED),
        (7, ErrorCode.MALFORMED),
        ("x" * (wire.MAX_CREDENTIAL_CHARS + 1), ErrorCode.OVERSIZED),
    ],
)
def test_a_malformed_reauthenticate_token_is_a_typed_error(token, code):
    with pytest.raises(WireError) as info:
        wire.Reauthenticate(token)
    assert info.value.code == code
    # decoded, the same: a token over the bound is already past the unpacker's string limit (MALFORMED)
    _err(_pack({"v": wire.WIRE_VERSION, "t": wire.Reauthenticate.type, "k": token}), ErrorCode.MALFORMED)


def test_a_reauthenticate_never_shows_its_token():
    assert "secret" not in repr(wire.Reauthenticate("secret.token.sig"))
