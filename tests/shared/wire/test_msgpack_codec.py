"""The msgpack layer under the wire and the stage codec (shared/wire/msgpack_codec.py): registry, limits, errors."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from shared.wire.msgpack_codec import CodecError, FrameTooLarge, MessageRegistry, NotMsgpack, UnpackLimits, pack, unpack
from shared.wire.schema import WireError
from shared.wire.stage_codec import StageLinkError


@dataclasses.dataclass
class Ping:
    n: int


def test_the_registry_holds_dataclasses_under_unique_tags():
    registry: MessageRegistry[int] = MessageRegistry("test message")
    registry.register(1, Ping)
    assert registry.get(1) is Ping and registry.by_tag == {1: Ping}
    assert registry.get(2) is None and registry.get([1]) is None  # an unhashable tag from a peer is just unknown
    assert registry.holds(Ping, 1) and not registry.holds(Ping, 2)
    with pytest.raises(TypeError, match="registered twice"):
        registry.register(1, Ping)
    with pytest.raises(TypeError, match="not a dataclass"):
        registry.register(3, int)


def test_unpack_round_trips_what_pack_writes():
    obj = {"s": "text", "b": b"\x00\x01", "l": [1, 2.5, None, True]}
    assert unpack(pack(obj)) == obj
    assert unpack(memoryview(pack(obj))) == obj
    assert pack(obj) == msgpack.packb(obj, use_bin_type=True)  # the frames every peer already reads


def test_an_oversized_frame_is_refused_before_it_is_parsed(monkeypatch):
    monkeypatch.setattr(msgpack, "unpackb", lambda *a, **k: pytest.fail("parsed"))
    with pytest.raises(FrameTooLarge, match="101 bytes > 100"):
        unpack(b"\xc1" * 101, max_frame_bytes=100)


@pytest.mark.parametrize("frame", [b"", b"\xc1", pack(1) + b"\x00", pack([1, 2, 3]), pack("abc"), pack({1: 2}), "text"])
def test_bytes_that_are_not_one_bounded_object_are_not_msgpack(frame):
    limits = UnpackLimits(max_array_len=2, max_str_len=2)
    with pytest.raises(NotMsgpack):
        unpack(frame, limits=limits)


def test_container_limits_must_be_sizes():
    with pytest.raises(ValueError, match="max_map_len"):
        UnpackLimits(max_map_len=-1)


def test_every_schema_error_is_a_codec_error():
    assert issubclass(WireError, CodecError) and issubclass(StageLinkError, CodecError)
    assert issubclass(CodecError, ValueError)  # callers that caught ValueError still do
