"""Per-minute budgets by name (a key's requests, its tokens, per model): one interface, kept in
this process (``LocalBudgets``) or shared by the replicas (router/limits/shared.py).

A take is all or nothing, counted at once; ``settle`` corrects it later (tokens reserved against
tokens used, a request refused by a later check). The arithmetic is policies/limits.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from policies.limits import Window, window_of

PERIOD_S = 60.0


@dataclass(frozen=True, slots=True)
class Taken:
    """What a take did: ``ok`` (counted, in window ``index``), else ``wait_s`` until it would fit."""

    ok: bool
    index: int
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Standing:
    """A budget as the ``x-ratelimit-*`` headers report it."""

    remaining: int
    reset_s: float


class Budgets(Protocol):
    async def take(self, name: str, limit: int, cost: int) -> Taken: ...

    def settle(self, name: str, taken: Taken, amount: int) -> None: ...

    def standing(self, name: str, limit: int) -> Standing: ...

    async def close(self) -> None: ...


class LocalBudgets:
    """Every budget in this process's memory: the embedded default, and a replica's own while
    the shared service is away."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period_s = period_s
        self._windows: dict[str, Window] = {}

    def _window(self, name: str, limit: int) -> Window:
        window = self._windows.get(name)
        if window is None:
            if len(self._windows) >= 100_000:  # a bound: the idle ones first would need a scan; all go
                self._windows.clear()
            window = self._windows[name] = Window(limit, self.period_s, index=window_of(time.time(), self.period_s)[0])
        window.limit = limit  # a limit changed by a reload applies at once
        return window

    def take_now(self, name: str, limit: int, cost: int) -> Taken:
        now = time.time()
        window = self._window(name, limit)
        if window.take(cost, now):
            return Taken(True, window.index)
        return Taken(False, window.index, window.wait(cost, now))

    async def take(self, name: str, limit: int, cost: int) -> Taken:
        return self.take_now(name, limit, cost)

    def settle(self, name: str, taken: Taken, amount: int) -> None:
        window = self._windows.get(name)
        if window is not None and taken.ok and amount:
            window.settle(amount, taken.index)

    def standing(self, name: str, limit: int) -> Standing:
        now = time.time()
        window = self._window(name, limit)
        return Standing(max(0, int(limit - window.used(now))), window.reset(now))

    async def close(self) -> None:
        return None
