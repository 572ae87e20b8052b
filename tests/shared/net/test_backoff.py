import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.net.backoff import Backoff


def test_doubles_from_initial_up_to_the_cap():
    assert list(itertools.islice(Backoff(0.25, 2.0).delays(), 6)) == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]


def test_after_starts_at_initial_and_follows_the_factor():
    backoff = Backoff(1.0, 30.0, factor=3.0)
    assert backoff.after(None) == 1.0
    assert backoff.after(1.0) == 3.0
    assert backoff.after(27.0) == 30.0


@given(st.floats(0.001, 10), st.floats(1, 100), st.floats(1, 4), st.integers(1, 40))
def test_delays_never_shrink_and_never_pass_the_cap(initial, span, factor, n):
    backoff = Backoff(initial, initial * span, factor)
    delays = list(itertools.islice(backoff.delays(), n))
    assert delays[0] == initial
    assert all(a <= b <= backoff.max_s for a, b in itertools.pairwise(delays))


@pytest.mark.parametrize("args", [(0, 1), (2, 1), (1, 2, 0.5), (-1, 1)])
def test_bad_schedules_are_refused(args):
    with pytest.raises(ValueError):
        Backoff(*args)
