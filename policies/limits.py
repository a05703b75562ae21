"""Rate windows: how much of a per-minute limit is used, when a request would fit, when it resets.

A sliding-window counter (the approximation Cloudflare and most API gateways use): the count of
the current fixed window plus the previous window's count weighted by the share of it the
sliding window still covers. It admits about ``limit`` in any ``period_s``, where a token
bucket that starts full admits up to twice that in its first period; and it is two numbers per
window, so replicas can keep it in a shared service (router/limits/shared.py) with the same
arithmetic.

Pure: every function takes ``now`` (seconds); nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def window_of(now: float, period_s: float) -> tuple[int, float]:
    """The fixed window ``now`` falls in, and how far into it (0..1)."""
    position = now / period_s
    index = math.floor(position)
    return index, position - index


def weighted(previous: float, current: float, elapsed: float) -> float:
    """What the sliding window holds: the current window's count, and the previous one's in the
    share it still covers."""
    return previous * (1.0 - elapsed) + current


def wait_for(limit: float, previous: float, current: float, elapsed: float, cost: float, period_s: float) -> float:
    """Seconds until ``cost`` fits; 0 when it fits now; ``inf`` when it never can (over the limit alone)."""
    if cost > limit:
        return math.inf
    if current + cost <= limit:  # in this window, once enough of the previous one has slid out
        if previous <= 0 or weighted(previous, current, elapsed) + cost <= limit:
            return 0.0
        return (1.0 - (limit - current - cost) / previous - elapsed) * period_s
    # Not in this window: in the next, this window's count is the previous one.
    slid = 1.0 - (limit - cost) / current if current > 0 else 0.0
    return (1.0 - elapsed + max(0.0, slid)) * period_s


def reset_after(previous: float, current: float, elapsed: float, period_s: float) -> float:
    """Seconds until the window holds nothing (OpenAI's ``x-ratelimit-reset-*``)."""
    if current > 0:
        return (2.0 - elapsed) * period_s
    if previous > 0:
        return (1.0 - elapsed) * period_s
    return 0.0


@dataclass(slots=True)
class Window:
    """One limit's sliding window, kept in this process."""

    limit: float
    period_s: float = 60.0
    index: int = 0  # the current fixed window
    current: float = 0.0
    previous: float = 0.0

    def _roll(self, now: float) -> float:
        index, elapsed = window_of(now, self.period_s)
        if index != self.index:
            self.previous = self.current if index == self.index + 1 else 0.0
            self.current = 0.0
            self.index = index
        return elapsed

    def used(self, now: float) -> float:
        elapsed = self._roll(now)
        return weighted(self.previous, self.current, elapsed)

    def take(self, cost: float, now: float) -> bool:
        """Count ``cost`` if it fits the limit now; else count nothing."""
        elapsed = self._roll(now)
        if weighted(self.previous, self.current, elapsed) + cost > self.limit:
            return False
        self.current += cost
        return True

    def settle(self, amount: float, index: int) -> None:
        """Correct what window ``index`` counted by ``amount`` (a reservation against what was
        used, or a request refused after it was counted); a window already gone is left alone."""
        if index == self.index:
            self.current = max(0.0, self.current + amount)
        elif index == self.index - 1:
            self.previous = max(0.0, self.previous + amount)

    def wait(self, cost: float, now: float) -> float:
        elapsed = self._roll(now)
        return wait_for(self.limit, self.previous, self.current, elapsed, cost, self.period_s)

    def reset(self, now: float) -> float:
        elapsed = self._roll(now)
        return reset_after(self.previous, self.current, elapsed, self.period_s)


def duration(seconds: float) -> str:
    """A wait as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60.0:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
