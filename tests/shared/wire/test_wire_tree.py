"""VerifyRequest's draft-tree fields (wire version 3): a tree's parents and the rows kept of the last tree
round-trip, and every bad shape is a typed BAD_SHAPE / MALFORMED error, never a crash."""

import msgpack
import pytest
import torch

from shared.wire import schema as wire
from shared.wire.schema import ErrorCode, VerifyRequest, WireError


def _rows(n: int) -> torch.Tensor:
    return torch.randn(n, 8).half()


def test_tree_fields_round_trip_and_default_to_a_chain():
    tree = VerifyRequest(3, 4, 10, _rows(5), parents=(0, 0, 1, 1), kept=(12, 14))
    assert wire.decode(wire.encode(tree)) == tree
    chain = VerifyRequest(3, 5, 10, _rows(3))
    decoded = wire.decode(wire.encode(chain))
    assert decoded.parents is None and decoded.kept is None
    assert set(msgpack.unpackb(wire.encode(chain))) == {"v", "t", "s", "q", "c", "h"}  # a chain pays nothing


def test_tree_rows_are_not_token_ids():
    # parents and kept rows describe shape, not content: a private session may send them
    frame = wire.encode(VerifyRequest(3, 4, 10, _rows(3), parents=(0, 1), kept=(11,)))
    assert isinstance(wire.assert_privacy_safe(frame), VerifyRequest)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(parents=(0, 0)), "needs 3 parents"),  # too few for 4 rows
        (dict(parents=(0, 0, 0, 0)), "needs 3 parents"),  # too many
        (dict(parents=(0, 2, 1)), "does not come before"),  # a self-loop
        (dict(parents=(0, 3, 1)), "does not come before"),  # a forward edge: a cycle or disorder
        (dict(kept=(12, 11)), "increasing"),
        (dict(kept=(12, 12)), "increasing"),
        (dict(kept=(1, 2)), "later positions"),  # rows 1, 2 cannot fill positions 8, 9
        (dict(kept=tuple(range(11, 22))), "no more than commit_len"),
    ],
)
def test_bad_trees_are_typed_errors(fields, message):
    with pytest.raises(WireError, match=message) as caught:
        VerifyRequest(3, 4, 10, _rows(4), **fields)
    assert caught.value.code is ErrorCode.BAD_SHAPE
    # the same frame from a peer that skips the constructor is refused by the decoder, addressed
    raw = msgpack.unpackb(wire.encode(VerifyRequest(3, 4, 10, _rows(4))))
    for name, value in fields.items():
        raw["pa" if name == "parents" else "kp"] = wire.encode_tokens(value)
    with pytest.raises(WireError) as decoded:
        wire.decode(msgpack.packb(raw, use_bin_type=True))
    assert decoded.value.code is ErrorCode.BAD_SHAPE and decoded.value.session_id == 3


def test_tree_size_is_bounded():
    rows = wire.MAX_TREE_ROWS + 1
    with pytest.raises(WireError, match="at most"):
        VerifyRequest(1, 1, 0, torch.zeros(rows, 4).half(), parents=tuple(range(rows - 1)))


@pytest.mark.parametrize("raw", [b"\x00\x00\x00", [1, 2], "ab", b""])
def test_malformed_row_fields(raw):
    frame = msgpack.unpackb(wire.encode(VerifyRequest(3, 4, 10, _rows(2))))
    frame["pa"] = raw
    with pytest.raises(WireError) as caught:
        wire.decode(msgpack.packb(frame, use_bin_type=True))
    assert caught.value.code in (ErrorCode.MALFORMED, ErrorCode.LENGTH_MISMATCH, ErrorCode.BAD_SHAPE)
