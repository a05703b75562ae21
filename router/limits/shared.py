"""Budgets the replicas share through Redis, leased so that most requests need no round trip.

Each budget is a sliding window (policies/limits.py) whose two counts live in Redis, one key per
fixed window (``{prefix}:rate:{name}:{index}``, expiring after two periods). A replica does not
ask Redis for every request: it claims a lease, ``lease_fraction`` of the limit (at least what
the request needs), in one atomic script that checks the window's room, and spends it locally.
One claim per budget is in flight at a time: the takes that come meanwhile wait for its answer
(a lease, or a refusal that is theirs too) rather than each claiming a lease of its own, which
would hoard the budget on this replica. What a lease holds unspent when its window ends goes
back to that window's count; a debt (tokens settled above what was taken) is added to it.

Accuracy: a lease counts as used from the moment it is claimed, so the replicas together never
admit more than the limit (beyond the sliding window's own approximation); while leases sit
unspent they may refuse up to replicas x lease early in a window's last moments, and a request's
tokens settled above its reservation are added to the window it was admitted in.

The service away (refused, timed out): this replica keeps its own windows (``LocalBudgets``)
with one log line, tries the service again after ``retry_s``, and says so once it is back. No
request is refused because the service is away.

Redis, not PostgreSQL, by measurement (bench/limits.py): a claim is one round trip either way,
but a script keeps the check and the count in one step without a transaction, and a rate
window's counts are not state worth a table's writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from policies.limits import reset_after, wait_for, weighted, window_of
from router.limits.budgets import PERIOD_S, LocalBudgets, Standing, Taken

log = logging.getLogger("router.limits")

# KEYS: the current window's count, the previous one's. ARGV: need, want, limit, elapsed (0..1),
# ttl (ms). Grants at least need and at most want while the sliding window has room; returns the
# grant and the two counts after it.
CLAIM = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local prev = tonumber(redis.call('GET', KEYS[2]) or '0')
local need = tonumber(ARGV[1])
local room = tonumber(ARGV[3]) - (prev * (1 - tonumber(ARGV[4])) + cur)
if room < need then
  return {0, prev, cur}
end
local grant = math.max(need, math.min(tonumber(ARGV[2]), math.floor(room)))
cur = redis.call('INCRBY', KEYS[1], grant)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {grant, prev, cur}
"""

# KEYS: one window's count. ARGV: how much to take off it (never below 0; < 0: a debt added). A
# window already expired is left alone: a count made here would have no expiry.
GIVE_BACK = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local left = redis.call('DECRBY', KEYS[1], ARGV[1])
if left < 0 then
  redis.call('SET', KEYS[1], 0, 'KEEPTTL')
end
return left
"""

# A request waits at most this long for the service before its replica decides alone.
TIMEOUT_S = 0.5


@dataclass(slots=True)
class Lease:
    """What this replica holds of one budget's current window, and what the window held when last seen."""

    index: int
    left: int = 0  # < 0: a debt, claimed first
    previous: int = 0
    current: int = 0
    # The claim in flight for it: resolves to the need it was refused (0: granted, or no answer).
    claim: asyncio.Future[int] | None = None


class SharedBudgets:
    def __init__(self, url: str, *, prefix: str, lease_fraction: float, retry_s: float,
                 period_s: float = PERIOD_S) -> None:
        self.prefix = prefix
        self.lease_fraction = lease_fraction
        self.retry_s = retry_s
        self.period_s = period_s
        self._redis = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self._claim = self._redis.register_script(CLAIM)
        self._give_back = self._redis.register_script(GIVE_BACK)
        self._leases: dict[str, Lease] = {}
        self._local = LocalBudgets(period_s)
        self._down_until = 0.0  # while the service is away: this replica's own windows
        self._gone = False  # said so in the log; said again only once it is back
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def shared(self) -> bool:
        """Whether the budgets are the replicas' (else this replica's own, the service away)."""
        return time.monotonic() >= self._down_until

    async def take(self, name: str, limit: int, cost: int) -> Taken:
        refused: tuple[Lease, int] | None = None  # a claim this take waited for, refused for so much
        while True:
            index, elapsed = window_of(time.time(), self.period_s)
            lease = self._leases.get(name)
            if lease is not None and lease.index != index:
                self._return(name, lease)
                lease = None
            if lease is not None and lease.left >= cost:
                lease.left -= cost
                return Taken(True, index)
            if not self.shared:
                return self._local.take_now(name, limit, cost)
            if lease is None:
                if len(self._leases) >= 100_000:
                    self._leases.clear()
                lease = self._leases[name] = Lease(index)
            if refused is not None and refused[0] is lease and cost - lease.left >= refused[1]:
                # The window had no room for what another take needed, and this one needs as much.
                return self._refused(lease, limit, cost, elapsed)
            claim = lease.claim
            if claim is None:
                return await self._lease(name, lease, limit, cost, elapsed)
            await asyncio.shield(claim)  # this take cancelled: the claim goes on for the others
            refused = (lease, claim.result()) if claim.result() else None

    async def _lease(self, name: str, lease: Lease, limit: int, cost: int, elapsed: float) -> Taken:
        """The one claim in flight for ``lease``: it holds what the lease has left (a debt too) while
        its answer comes, and the takes that come meanwhile wait for it."""
        held, lease.left = lease.left, 0
        need = cost - held  # a debt (tokens settled over) comes first
        want = max(need, int(limit * self.lease_fraction))
        refused = 0
        lease.claim = claim = asyncio.get_running_loop().create_future()
        try:
            try:
                answer = await asyncio.wait_for(self._claim(
                    keys=[self._key(name, lease.index), self._key(name, lease.index - 1)],
                    args=[need, want, limit, elapsed, int(self.period_s * 2000)]), TIMEOUT_S)
            except (TimeoutError, RedisError, OSError) as exc:
                self._away(exc)
                return self._local.take_now(name, limit, cost)
            except asyncio.CancelledError:
                lease.left += held
                raise
            grant, previous, current = (int(n) for n in cast(list[int], answer))
            if self._gone:
                self._gone = False
                log.warning("the shared budget service is back; the replicas share one budget per key again")
            lease.previous, lease.current = previous, current
            if not grant:
                lease.left += held
                refused = need
                return self._refused(lease, limit, cost, elapsed)
            lease.left += held + grant - cost
            return Taken(True, lease.index)
        finally:
            lease.claim = None
            claim.set_result(refused)
            if self._leases.get(name) is not lease:  # its window ended meanwhile: what it holds goes back
                self._return(name, lease)

    def _refused(self, lease: Lease, limit: int, cost: int, elapsed: float) -> Taken:
        """A refusal, told how long until ``cost`` fits; a debt this replica holds counts as used."""
        current = lease.current + max(0, -lease.left)
        return Taken(False, lease.index, wait_for(limit, lease.previous, current, elapsed, cost, self.period_s))

    def settle(self, name: str, taken: Taken, amount: int) -> None:
        """``amount`` < 0: given back, spent by this replica's next takes; > 0: used beyond what
        was taken, a debt the next claim pays. Either goes to the window in Redis once the lease
        it was taken from has ended."""
        if not taken.ok or not amount:
            return
        lease = self._leases.get(name)
        if lease is not None and lease.index == taken.index:
            lease.left -= amount
        elif self.shared:
            self._spawn(self._give(self._key(name, taken.index), -amount))
        self._local.settle(name, taken, amount)

    def standing(self, name: str, limit: int) -> Standing:
        lease = self._leases.get(name)
        if not self.shared or lease is None:
            return self._local.standing(name, limit)
        index, elapsed = window_of(time.time(), self.period_s)
        previous, current = (lease.previous, lease.current) if lease.index == index else (lease.current, 0)
        used = weighted(previous, current, elapsed) - max(0, lease.left if lease.index == index else 0)
        return Standing(max(0, int(limit - used)), reset_after(previous, current, elapsed, self.period_s))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._redis.aclose()

    def _key(self, name: str, index: int) -> str:
        return f"{self.prefix}:rate:{name}:{index}"

    def _return(self, name: str, lease: Lease) -> None:
        """A lease whose window has ended: what it holds unspent goes back to that window (a debt
        is added to it). A claim in flight for it returns what it brings when it ends."""
        if self._leases.get(name) is lease:
            del self._leases[name]
        amount, lease.left = lease.left, 0
        if amount and self.shared:
            self._spawn(self._give(self._key(name, lease.index), amount))

    async def _give(self, key: str, amount: int) -> None:
        try:
            await asyncio.wait_for(self._give_back(keys=[key], args=[amount]), TIMEOUT_S)
        except (TimeoutError, RedisError, OSError) as exc:
            self._away(exc)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _away(self, exc: BaseException) -> None:
        if not self._gone:
            self._gone = True
            log.warning("the shared budget service is unreachable (%s); each replica keeps its own for %g s, "
                        "then tries again", type(exc).__name__ if not str(exc) else exc, self.retry_s)
        self._down_until = time.monotonic() + self.retry_s
        self._leases.clear()
