"""One worker: what the router knows of it (health, load, its circuit) and the counting of calls.

A ``Worker`` is data the pool (backends/pools.py) and its policy read, changed in two places
only: the pool's health loop and a worker call (backends/calls.py), which counts a call with
``take`` and ``end``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.breaker import Breaker


class Process(Protocol):
    """A managed worker's process, as the launcher keeps it (backends/launcher.py ``ManagedWorker``)."""

    restarts: int

    def describe(self) -> dict[str, Any]: ...


# What a completely full KV cache adds to a worker's load, in requests: under 1, a tie-breaker.
KV_LOAD_WEIGHT = 0.5


@dataclass(eq=False, slots=True)
class Worker:
    url: str
    in_flight: int = 0
    healthy: bool = False
    last_error: str | None = None
    served: int = 0
    health_failures: int = 0  # consecutive failed health checks
    waiting: float = 0.0  # requests queued inside the engine, when its metrics are scraped
    kv_usage: float = 0.0  # the engine's KV cache usage, 0..1, when its metrics are scraped
    process: Process | None = None  # the launcher's ManagedWorker, for managed pools
    breaker: Breaker = field(default_factory=Breaker)  # failed calls through the worker's fault
    # Paths it answered 404/405/501 (an endpoint its engine build lacks, e.g. vLLM's /tokenize); forgotten
    # when it comes back after being seen down (it may have been upgraded).
    lacks: set[str] = field(default_factory=set)

    def take(self, now: float) -> int:
        """A call to it starts: counted in flight, admitted by its breaker; the ticket to end it with."""
        self.in_flight += 1
        return self.breaker.admit(now)

    def end(self, ticket: int, *, served: bool) -> None:
        """A call to it is over (``served``: an answer was had): no longer counted, the breaker's
        ticket returned (a half-open trial that ended without a verdict frees its slot)."""
        self.in_flight -= 1
        if served:
            self.served += 1
        self.breaker.done(ticket)

    @property
    def circuit(self) -> str:
        """closed, open (no calls) or half_open (one trial call)."""
        return self.breaker.state(time.monotonic())

    @property
    def load(self) -> float:
        """What balancing compares: our in-flight requests plus the engine's own queue, plus
        less than one request's worth for a full KV cache, so between equally busy workers
        the one with room wins (a full cache evicts prefixes and may preempt)."""
        return self.in_flight + self.waiting + KV_LOAD_WEIGHT * self.kv_usage

    def describe(self) -> dict[str, Any]:
        out = {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "last_error": self.last_error,
            "circuit": self.circuit,
            "waiting": self.waiting,
            "kv_usage": round(self.kv_usage, 4),
        }
        if self.process is not None:
            out["process"] = self.process.describe()
        return out
