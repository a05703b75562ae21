"""The rate windows' arithmetic (policies/limits.py), with plain data and hypothesis: a request
told to wait ``w`` fits after ``w`` and not before; any minute holds about the limit."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from policies.limits import Window, duration, reset_after, wait_for, weighted


def test_a_fresh_window_admits_the_limit_and_no_more() -> None:
    window = Window(3, 60.0, index=0)
    assert [window.take(1, 1.0) for _ in range(4)] == [True, True, True, False]
    assert window.used(1.0) == 3
    # Not in this window: once the next begins, as the previous one slides out.
    assert 59.0 < window.wait(1, 1.0) <= 60.0 + 20.0


def test_the_previous_window_slides_out() -> None:
    window = Window(10, 60.0, index=0)
    for _ in range(10):
        assert window.take(1, 30.0)
    # Half into the next window, half of the previous one's count remains.
    assert window.used(90.0) == 5
    assert window.take(5, 90.0) and not window.take(1, 90.0)
    assert window.used(180.0) == 0  # two windows on: nothing


def test_settle_corrects_the_window_it_took_from() -> None:
    window = Window(100, 60.0, index=0)
    assert window.take(80, 10.0)
    window.settle(-70, 0)  # reserved 80, used 10
    assert window.used(10.0) == 10
    window.settle(-1000, 0)
    assert window.used(10.0) == 0  # never below nothing
    window.settle(5, 7)  # a window long gone: left alone
    assert window.used(10.0) == 0


def test_a_cost_over_the_limit_never_fits() -> None:
    assert wait_for(10, 0, 0, 0.5, 11, 60.0) == math.inf


def test_reset_and_duration() -> None:
    assert reset_after(0, 0, 0.3, 60.0) == 0
    assert reset_after(4, 0, 0.5, 60.0) == 30.0
    assert reset_after(0, 1, 0.5, 60.0) == 90.0
    assert [duration(s) for s in (0.0, 0.02, 1.0, 1.25, 59.99, 60.0, 360.0, 90.5)] == \
        ["0ms", "20ms", "1s", "1.3s", "60s", "1m0s", "6m0s", "1m31s"]


counts = st.integers(min_value=0, max_value=1000)


@given(limit=st.integers(min_value=1, max_value=1000), previous=counts, current=counts,
       elapsed=st.floats(min_value=0.0, max_value=0.999), cost=st.integers(min_value=1, max_value=1000))
def test_a_wait_is_exactly_when_the_cost_fits(limit: int, previous: int, current: int, elapsed: float, cost: int) -> None:
    period = 60.0
    wait = wait_for(limit, previous, current, elapsed, cost, period)
    if cost > limit:
        assert wait == math.inf
        return
    assert wait >= 0

    def fits(after: float) -> bool:
        """Whether cost fits ``after`` seconds on, nothing else taken meanwhile."""
        position = elapsed + after / period
        if position < 1:
            return weighted(previous, current, position) + cost <= limit + 1e-6
        if position < 2:
            return weighted(current, 0, position - 1) + cost <= limit + 1e-6
        return True

    assert fits(wait + 1e-6)
    if wait > 0.01:
        assert not fits(wait - 0.01)


@given(limit=st.integers(min_value=1, max_value=200),
       times=st.lists(st.floats(min_value=0.0, max_value=600.0), min_size=1, max_size=400))
def test_any_minute_holds_about_the_limit(limit: int, times: list[float]) -> None:
    """Whatever the arrivals, no 60 s span admits more than twice the limit, and a fixed window
    (a minute of the clock) never more than the limit: the approximation's known bound."""
    window = Window(limit, 60.0, index=0)
    admitted = [t for t in sorted(times) if window.take(1, t)]
    for start in range(0, 600, 60):
        assert sum(1 for t in admitted if start <= t < start + 60) <= limit
    for t in admitted:
        assert sum(1 for u in admitted if t <= u < t + 60) <= 2 * limit
