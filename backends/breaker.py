"""A worker's circuit breaker: a pure state machine over calls' outcomes (no I/O, no clock of its own).

closed -> open after ``CIRCUIT_FAILURES`` counted failures in a row; open -> half_open when the
cool-down ends, or at once when a health check passes after the worker was seen down (it
restarted: waiting out the cool-down would only shut a working worker out); half_open admits one
trial call: its success closes the circuit and resets the backoff, its failure reopens it with
the cool-down doubled (up to ``CIRCUIT_COOLDOWN_MAX_S``).

What counts is evidence, not the number of errors: one crash breaks every stream open on the
worker at once, and those are one failure, not twenty. So a call carries a ticket (the breaker's
``mark`` when it was admitted; the mark moves with each counted failure, opening and trial): a
failure whose ticket is stale (the call was already running when a failure was counted) and that
comes within ``ECHO_S`` of it is that failure's echo, and does not count again; while the circuit
is open nothing counts (no call was admitted since it opened), so the stragglers of the event
that opened it neither re-arm nor double it. Stale successes are ignored the same way: a call
admitted before a counted failure says nothing about the worker after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CIRCUIT_FAILURES = 5
CIRCUIT_COOLDOWN_S = 5.0
CIRCUIT_COOLDOWN_MAX_S = 60.0
ECHO_S = 1.0  # failures of calls that were running when one was counted, this soon after it, are one event


@dataclass(slots=True)
class Breaker:
    failures: int = 0  # counted failures in a row
    opened: int = 0  # openings in a row without a success in between (the cool-down doubles); 0: closed
    open_until: float = 0.0
    mark: int = 0
    counted_at: float = -math.inf  # when the last failure was counted
    trial: int | None = None  # the ticket of the half-open trial in flight

    def state(self, now: float) -> str:
        if not self.opened:
            return "closed"
        return "open" if now < self.open_until else "half_open"

    def admits(self, now: float) -> bool:
        """Whether a new call may go to the worker: closed, or half-open with no trial running."""
        if not self.opened:  # closed: every call of a healthy worker asks, so it is said first
            return True
        state = self.state(now)
        return state == "closed" or (state == "half_open" and self.trial is None)

    def admit(self, now: float) -> int:
        """A call starts; its ticket. Half-open, it is the trial (one at a time: ``admits`` says so)."""
        if self.opened and self.state(now) == "half_open":
            self.mark += 1
            self.trial = self.mark
        return self.mark

    def done(self, ticket: int) -> None:
        """A call ended, whatever its outcome: a trial that ended without a verdict (the client left,
        a 4xx) makes room for the next one."""
        if self.trial == ticket:
            self.trial = None

    def success(self, ticket: int, now: float) -> bool:
        """A call the worker served; True when it closed the circuit (the trial succeeded)."""
        if ticket != self.mark:
            return False
        if not self.opened:  # closed
            self.failures = 0
            return False
        state = self.state(now)
        if state == "half_open":  # the latest trial (its slot may have been freed by ``done`` already)
            self.failures = self.opened = 0
            self.open_until = 0.0
            self.trial = None
            return True
        return False

    def failure(self, ticket: int, now: float) -> float | None:
        """A call failed through the worker's fault; the cool-down when this opened the circuit."""
        state = self.state(now)
        if state == "open":
            return None
        if state == "half_open":
            return self._open(now) if ticket == self.mark else None
        if ticket != self.mark and now - self.counted_at < ECHO_S:
            return None
        self.failures += 1
        self.mark += 1
        self.counted_at = now
        return self._open(now) if self.failures >= CIRCUIT_FAILURES else None

    def recovered(self, now: float) -> bool:
        """A health check passed after the worker was seen down (it restarted): an open circuit
        half-opens now. True when it did."""
        if self.state(now) != "open":
            return False
        self.open_until = now
        return True

    def remaining(self, now: float) -> float:
        """Seconds until an open circuit half-opens."""
        return max(0.0, self.open_until - now) if self.opened else 0.0

    def _open(self, now: float) -> float:
        cooldown = min(CIRCUIT_COOLDOWN_MAX_S, CIRCUIT_COOLDOWN_S * 2**self.opened)
        self.opened += 1
        self.open_until = now + cooldown
        self.mark += 1
        self.counted_at = now
        self.trial = None
        return cooldown
