"""Which worker of a pool takes the next request.

Policies see workers only through ``Candidate``: this package imports
nothing else of the project, so it can be tested and swapped alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Candidate(Protocol):
    @property
    def in_flight(self) -> int: ...


C = TypeVar("C", bound=Candidate)


class Balancer(Protocol):
    def choose(self, candidates: Sequence[C]) -> C:
        """Pick one of a non-empty list of healthy candidates."""


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[C]) -> C:
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return choice


class LeastInFlight:
    """Fewest requests in flight; ties rotate so idle pools still spread load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[C]) -> C:
        n = len(candidates)
        start = self._next % n
        self._next += 1
        best = candidates[start]
        for i in range(1, n):
            candidate = candidates[(start + i) % n]
            if candidate.in_flight < best.in_flight:
                best = candidate
        return best


def make_balancer(name: str) -> Balancer:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_in_flight":
        return LeastInFlight()
    raise ValueError(f"unknown balance policy {name!r}")
