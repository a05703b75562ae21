"""Which worker of a pool takes the next request.

Policies see workers only through ``Candidate``: this package imports
nothing else of the project, so it can be tested and swapped alone.

Every ``choose`` runs once per request on the event loop: no locks, no
allocation beyond a few locals, O(n) in the number of healthy candidates.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """A healthy worker as the policies see it.

    ``in_flight`` (required): requests this router has sent to the worker
    and not yet seen finish, an int >= 0.

    ``load`` (optional, see ``Loaded``): how busy the worker is, a plain
    number where LOWER IS BETTER. The pool sets it to the router's
    ``in_flight`` plus the queue depth it last scraped from the engine
    (requests waiting, not yet scheduled), so it counts other routers'
    traffic too, plus half the scraped KV-cache usage (0..1), which only
    breaks ties; in units of requests, never negative. A candidate without
    a ``load`` attribute (or with ``load = None``) counts as
    ``load == in_flight``; policies read it only through ``load_of``.
    """

    @property
    def in_flight(self) -> int: ...


class Loaded(Candidate, Protocol):
    """A candidate that carries the load signal."""

    @property
    def load(self) -> float: ...


C = TypeVar("C", bound=Candidate)


def load_of(candidate: Candidate) -> float:
    """The candidate's ``load``, or its ``in_flight`` when it has no load signal."""
    load: float | None = getattr(candidate, "load", None)
    return candidate.in_flight if load is None else load


class Balancer(Protocol):
    def choose(self, candidates: Sequence[C]) -> C:
        """Pick one of a non-empty list of healthy candidates."""
        ...


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
        return _least(self, candidates, _in_flight)


def _in_flight(candidate: Candidate) -> float:
    return candidate.in_flight


def _least(rotor: LeastInFlight | LeastLoad, candidates: Sequence[C], key: Callable[[Candidate], float]) -> C:
    """The candidate with the lowest ``key``, scanning from a rotating start so ties spread."""
    n = len(candidates)
    start = rotor._next % n
    rotor._next += 1
    best = candidates[start]
    best_key = key(best)
    for i in range(1, n):
        candidate = candidates[(start + i) % n]
        value = key(candidate)
        if value < best_key:
            best, best_key = candidate, value
    return best


class LeastLoad:
    """Lowest ``load`` (in flight + engine queue); ties rotate like ``LeastInFlight``."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[C]) -> C:
        return _least(self, candidates, load_of)


class PowerOfTwo:
    """Power of two choices: two distinct candidates at random, the less loaded.

    With two candidates this always takes the less loaded one; with more it
    never takes the single most loaded one (it can only win a draw against
    a candidate at least as loaded). Ties go to the first drawn, which is
    random. ``seed`` (or an own ``rng``) makes the draws reproducible.
    """

    def __init__(self, seed: int | None = None, *, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random(seed)

    def choose(self, candidates: Sequence[C]) -> C:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:  # distinct without building a sample list
            j += 1
        a, b = candidates[i], candidates[j]
        return b if load_of(b) < load_of(a) else a


BALANCERS = ("round_robin", "least_in_flight", "least_load", "power_of_two")


def make_balancer(name: str, *, seed: int | None = None) -> Balancer:
    """A balancer by its config name: round_robin | least_in_flight | least_load | power_of_two."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_in_flight":
        return LeastInFlight()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"unknown balance policy {name!r}; expected one of {', '.join(BALANCERS)}")
