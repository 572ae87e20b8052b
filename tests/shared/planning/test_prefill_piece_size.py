"""A prefill piece bounded by its predicted pass time (shared/planning/prefill_pieces.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.planning.prefill_pieces import MIN_PIECE_TOKENS, prefill_piece_tokens


def linear(per_row_s: float, fixed_s: float = 0.005):
    return lambda rows: fixed_s + per_row_s * rows


def test_a_flat_curve_takes_the_whole_prompt():
    assert prefill_piece_tokens(300, lambda rows: 0.011, 0.1) == 300  # a GPU: 300 rows cost what 1 does


def test_a_steep_curve_takes_the_most_rows_that_fit():
    # 5 ms + 1.3 ms a row (this CPU's g): 73 rows are 99.9 ms, 74 rows 101.2 ms
    assert prefill_piece_tokens(300, linear(0.0013), 0.1) == 73


def test_a_piece_never_goes_below_the_minimum_nor_above_what_remains():
    assert prefill_piece_tokens(300, linear(0.1), 0.1) == MIN_PIECE_TOKENS  # even one row is over the bound
    assert prefill_piece_tokens(10, linear(0.1), 0.1) == 10  # fewer than the minimum remain: all of them
    assert prefill_piece_tokens(40, linear(0.0013), 0.1) == 40


def test_an_unmeasured_curve_takes_the_whole_prompt():
    assert prefill_piece_tokens(300, lambda rows: None, 0.1) == 300


@pytest.mark.parametrize("args", [(0, 0.1), (10, 0.0), (10, float("nan"))])
def test_bad_arguments_are_refused(args):
    remaining, bound = args
    with pytest.raises(ValueError):
        prefill_piece_tokens(remaining, linear(0.001), bound)


@given(
    st.integers(1, 4096),
    st.floats(0.0, 0.01),
    st.floats(0.0, 0.05),
    st.floats(0.001, 1.0),
)
def test_the_piece_is_the_largest_that_fits(remaining, per_row, fixed, bound):
    cost = linear(per_row, fixed)
    piece = prefill_piece_tokens(remaining, cost, bound)
    assert 1 <= piece <= remaining
    if piece == remaining:
        return
    assert piece >= MIN_PIECE_TOKENS
    assert piece == MIN_PIECE_TOKENS or cost(piece) <= bound  # it fits, or it is the floor
    assert cost(piece + 1) > bound  # one more row would not
