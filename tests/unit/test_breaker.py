"""The circuit breaker's state machine alone (backends/breaker.py), on a clock the test moves.

End to end (a worker killed under 20 streams, a poisoned request on every worker):
tests/e2e/test_e2e_breaker.py.
"""

from __future__ import annotations

from backends.breaker import CIRCUIT_COOLDOWN_MAX_S, CIRCUIT_COOLDOWN_S, CIRCUIT_FAILURES, ECHO_S, Breaker


def fail_in_a_row(breaker: Breaker, now: float, n: int) -> float | None:
    """``n`` calls, one after the other, each failing: the last one's verdict."""
    opened = None
    for _ in range(n):
        opened = breaker.failure(breaker.admit(now), now)
    return opened


def test_consecutive_failures_open_it_and_a_success_in_between_starts_over() -> None:
    b = Breaker()
    assert fail_in_a_row(b, 0.0, CIRCUIT_FAILURES - 1) is None and b.state(0.0) == "closed"
    b.success(b.admit(0.0), 0.0)
    assert fail_in_a_row(b, 0.0, CIRCUIT_FAILURES - 1) is None and b.state(0.0) == "closed"
    assert fail_in_a_row(b, 0.0, 1) == CIRCUIT_COOLDOWN_S
    assert b.state(0.0) == "open" and not b.admits(0.0)


def test_one_crash_breaking_twenty_streams_is_one_failure() -> None:
    b = Breaker()
    streams = [b.admit(0.0) for _ in range(20)]  # all running when the worker dies
    verdicts = [b.failure(ticket, 100.0) for ticket in streams]
    assert verdicts == [None] * 20 and b.failures == 1 and b.state(100.0) == "closed"
    # A stream admitted long before that breaks later, on its own, is a failure of its own.
    assert b.failure(streams[0], 100.0 + ECHO_S) is None and b.failures == 2


def test_failures_while_open_neither_rearm_nor_double_it() -> None:
    b = Breaker()
    running = [b.admit(0.0) for _ in range(15)]
    assert fail_in_a_row(b, 0.0, CIRCUIT_FAILURES) == CIRCUIT_COOLDOWN_S
    for ticket in running:  # the stragglers of the event that opened it
        assert b.failure(ticket, 1.0) is None
    assert b.open_until == CIRCUIT_COOLDOWN_S and b.opened == 1


def test_half_open_admits_one_trial_whose_failure_doubles_and_success_resets() -> None:
    b = Breaker()
    fail_in_a_row(b, 0.0, CIRCUIT_FAILURES)
    t = CIRCUIT_COOLDOWN_S
    assert b.state(t) == "half_open" and b.admits(t)
    trial = b.admit(t)
    assert not b.admits(t)  # one trial at a time
    assert b.failure(trial, t) == 2 * CIRCUIT_COOLDOWN_S and b.state(t) == "open"
    t += 2 * CIRCUIT_COOLDOWN_S
    trial = b.admit(t)
    assert b.success(trial, t) and b.state(t) == "closed" and b.opened == 0
    assert fail_in_a_row(b, t, CIRCUIT_FAILURES) == CIRCUIT_COOLDOWN_S  # the backoff started over


def test_a_trial_without_a_verdict_makes_room_for_the_next() -> None:
    b = Breaker()
    fail_in_a_row(b, 0.0, CIRCUIT_FAILURES)
    t = CIRCUIT_COOLDOWN_S
    trial = b.admit(t)
    b.done(trial)  # the client left, or the worker said 4xx
    assert b.admits(t)
    late = b.admit(t)
    b.done(late)
    assert b.failure(trial, t) is None  # a verdict on an older trial counts for nothing
    assert b.failure(late, t) == 2 * CIRCUIT_COOLDOWN_S  # the latest one's, freed or not, does


def test_the_cooldown_stops_doubling_at_its_maximum() -> None:
    b = Breaker()
    t = 0.0
    cooldowns = []
    for _ in range(8):
        cooldowns.append(fail_in_a_row(b, t, CIRCUIT_FAILURES if not b.opened else 1))
        t = b.open_until
    assert cooldowns[:3] == [CIRCUIT_COOLDOWN_S, 2 * CIRCUIT_COOLDOWN_S, 4 * CIRCUIT_COOLDOWN_S]
    assert max(c for c in cooldowns if c is not None) == CIRCUIT_COOLDOWN_MAX_S == cooldowns[-1]


def test_a_worker_back_from_a_restart_half_opens_at_once() -> None:
    b = Breaker()
    fail_in_a_row(b, 0.0, CIRCUIT_FAILURES)
    assert b.recovered(1.0) and b.state(1.0) == "half_open"
    assert b.success(b.admit(1.0), 1.0) and b.state(1.0) == "closed"
    assert not b.recovered(2.0)  # closed: nothing to do


def test_a_stale_success_does_not_close_or_reset() -> None:
    b = Breaker()
    before = b.admit(0.0)
    fail_in_a_row(b, 0.0, CIRCUIT_FAILURES - 1)
    b.success(before, 0.0)  # admitted before the failures: says nothing about the worker since
    assert b.failures == CIRCUIT_FAILURES - 1
