"""Budgets the replicas share through Redis (router/limits/shared.py), against a real server.

Two ``SharedBudgets`` on one prefix stand for two replicas. What is checked: together they never
admit more than a window's limit; a lease makes one round trip serve many takes, concurrent ones
too (each claiming its own would hoard the budget on one replica); unspent leases, and a debt,
go back to their window as it rolls; ``settle`` gives back; a refusal's wait and ``standing()``
are the window's arithmetic. Then the service going away: a server of the test's own
(``RedisServer``) is killed under a replica, which goes on alone, says so once, and shares
again once the server is back.

The machine's Redis (127.0.0.1:6379) must run: a test fails, never skips, without it. Each test
has its own key prefix, and deletes its keys at the end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import pytest
import redis

from harness import free_port
from policies.limits import reset_after, window_of
from router.limits.budgets import Taken
from router.limits.shared import TIMEOUT_S, SharedBudgets

URL = "redis://127.0.0.1:6379"
HOUR = 3600.0  # a period no test here outlives: its takes fall in one window (see fresh_window)
T = TypeVar("T")


class RedisServer:
    """A redis-server of the test's own on a free port, that the test kills and starts again
    (no persistence: a restarted server holds nothing)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: these tests stop a server of their own", pytrace=False)
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own on the machine's Redis; its keys are deleted after it."""
    client = redis.Redis.from_url(URL, socket_timeout=2.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is not reachable at {URL} ({exc}): these tests need the machine's server", pytrace=False)
    name = f"rr-test-{uuid.uuid4().hex[:12]}"
    yield name
    for key in client.scan_iter(match=f"{name}:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def count(key: str, url: str = URL) -> int | None:
    """A window's count as Redis holds it (None: no such key)."""
    client = redis.Redis.from_url(url, socket_timeout=2.0)
    try:
        value = cast(bytes | None, client.get(key))
    finally:
        client.close()
    return None if value is None else int(value)


class Claims:
    """Stands in for a ``SharedBudgets``' claim script, counting the round trips it makes."""

    def __init__(self, budgets: SharedBudgets, monkeypatch: pytest.MonkeyPatch) -> None:
        self.script = budgets._claim
        self.calls = 0
        monkeypatch.setattr(budgets, "_claim", self)

    async def __call__(self, *, keys: Sequence[str], args: Sequence[Any]) -> Any:
        self.calls += 1
        return await self.script(keys=keys, args=args)


def shared(prefix: str, *, lease_fraction: float = 0.05, period_s: float = HOUR, url: str = URL,
           retry_s: float = 5.0) -> SharedBudgets:
    return SharedBudgets(url, prefix=prefix, lease_fraction=lease_fraction, retry_s=retry_s, period_s=period_s)


def fresh_window(period_s: float, need_s: float) -> None:
    """Waits out the window's end when fewer than ``need_s`` are left of it: a test that counts on
    one window gets one."""
    left = period_s - time.time() % period_s
    if left < need_s:
        time.sleep(left + 0.01)


def run(body: Callable[[], Awaitable[T]], *budgets: SharedBudgets) -> T:
    """``body`` on an event loop of its own; the budgets' connections closed on the same loop."""
    async def main() -> T:
        try:
            return await body()
        finally:
            for b in budgets:
                await b.close()
    return asyncio.run(main())


async def takes(budgets: SharedBudgets, name: str, limit: int, costs: Sequence[int], concurrency: int) -> list[int]:
    """``costs`` taken by ``concurrency`` tasks at once; the costs admitted."""
    todo = list(costs)
    admitted: list[int] = []

    async def worker() -> None:
        while todo:
            cost = todo.pop()
            if (await budgets.take(name, limit, cost)).ok:
                admitted.append(cost)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return admitted


def test_two_replicas_never_admit_more_than_the_limit_together(prefix: str) -> None:
    """Requests (cost 1): exactly the limit, since every lease ends spent; tokens (costs of 1 to
    40): at most the limit, and Redis counts what was admitted plus what the leases still hold."""
    a, b = shared(prefix), shared(prefix)
    fresh_window(HOUR, 30)

    async def body() -> None:
        got = await asyncio.gather(takes(a, "k:rpm", 200, [1] * 400, 16), takes(b, "k:rpm", 200, [1] * 400, 16))
        assert len(got[0]) + len(got[1]) == 200
        assert got[0] and got[1]  # both replicas were served
        costs = [1 + (i * 7) % 40 for i in range(300)]
        tokens = await asyncio.gather(takes(a, "k:tpm", 1000, costs, 8), takes(b, "k:tpm", 1000, costs, 8))
        admitted = sum(tokens[0]) + sum(tokens[1])
        assert 0 < admitted <= 1000
        index = window_of(time.time(), HOUR)[0]
        held = sum(lease.left for r in (a, b) if (lease := r._leases.get("k:tpm")) is not None)
        assert count(f"{prefix}:rate:k:tpm:{index}") == admitted + held <= 1000

    run(body, a, b)


def test_a_lease_serves_many_takes_concurrent_ones_too(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Limit 1000, leases of 50: 200 takes in a row make 4 round trips. 20 at once make one, and
    claim one lease, not 20: the other replica is not refused for a budget this one hoards. Once
    the budget is spent, 20 refused at once make one round trip too."""
    a, b = shared(prefix), shared(prefix)
    claims = Claims(a, monkeypatch)
    fresh_window(HOUR, 30)
    index = window_of(time.time(), HOUR)[0]

    async def body() -> None:
        assert all([(await a.take("seq", 1000, 1)).ok for _ in range(200)])
        assert claims.calls == 4
        assert count(f"{prefix}:rate:seq:{index}") == 200

        claims.calls = 0
        burst = await asyncio.gather(*(a.take("burst", 1000, 1) for _ in range(20)))
        assert all(t.ok for t in burst)
        assert claims.calls == 1
        assert count(f"{prefix}:rate:burst:{index}") == 50
        assert (await b.take("burst", 1000, 1)).ok

        spent = await takes(b, "burst", 1000, [1] * 2000, 1)
        assert len(spent) == 1000 - 50 - 1  # what a leased: 30 of it still unspent there
        claims.calls = 0
        tail = await asyncio.gather(*(a.take("burst", 1000, 1) for _ in range(60)))
        assert sum(t.ok for t in tail) == 30 and claims.calls == 1

    run(body, a, b)


def test_unspent_leases_go_back_as_the_window_rolls(prefix: str) -> None:
    """Windows of 2 s: a lease of 10 spent 3 gives 7 back to its window once the next begins."""
    period = 2.0
    a = shared(prefix, lease_fraction=0.1, period_s=period)
    fresh_window(period, 1.5)  # the three takes early in one window

    async def body() -> None:
        first = [await a.take("k", 100, 1) for _ in range(3)]
        index = first[0].index
        assert all(t.ok and t.index == index for t in first)
        assert count(f"{prefix}:rate:k:{index}") == 10
        await asyncio.sleep(period - time.time() % period + 0.01)
        later = await a.take("k", 100, 1)
        assert later.ok and later.index == index + 1
        await asyncio.gather(*a._tasks)  # the give-back runs beside the take
        assert count(f"{prefix}:rate:k:{index}") == 3
        assert count(f"{prefix}:rate:k:{index + 1}") == 10

    run(body, a)


def test_settle_gives_back_and_a_debt_is_claimed_first(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens reserved and not used are spent by the next takes without a round trip; a window
    already rolled is given back in Redis (an expired one is left alone, not made a key without an
    expiry); tokens used above the reservation are claimed with the next take."""
    a = shared(prefix, lease_fraction=0.01)
    claims = Claims(a, monkeypatch)
    fresh_window(HOUR, 30)

    async def body() -> None:
        reserved = await a.take("k", 1000, 300)
        assert reserved.ok and claims.calls == 1
        key = f"{prefix}:rate:k:{reserved.index}"
        assert count(key) == 300
        a.settle("k", reserved, -200)  # used 100 of 300
        assert (await a.take("k", 1000, 200)).ok
        assert claims.calls == 1 and count(key) == 300
        # A debt: 100 reserved, 500 used. The next take claims it with its own cost.
        over = await a.take("k", 1000, 100)
        assert claims.calls == 2 and count(key) == 400
        a.settle("k", over, 400)
        assert (await a.take("k", 1000, 10)).ok
        assert claims.calls == 3 and count(key) == 400 + 400 + 10
        refused = await a.take("k", 1000, 300)  # 810 counted: 300 more does not fit
        assert not refused.ok and refused.wait_s > 0

        # A window that rolled: given back in Redis, never below 0. One long expired: no key made.
        old = f"{prefix}:rate:k:{reserved.index - 1}"
        client = redis.Redis.from_url(URL, socket_timeout=2.0)
        client.set(old, 50, ex=60)
        a.settle("k", Taken(True, reserved.index - 1), -20)
        assert a._tasks  # given back by a task of its own, not on the request's way
        await asyncio.gather(*a._tasks)
        assert count(old) == 30
        a.settle("k", Taken(True, reserved.index - 1), -100)
        a.settle("k", Taken(True, reserved.index - 5), -20)
        await asyncio.gather(*a._tasks)
        assert count(old) == 0 and 0 < client.ttl(old) <= 60  # its expiry kept
        assert count(f"{prefix}:rate:k:{reserved.index - 5}") is None
        client.close()

    run(body, a)


def test_a_refusal_says_how_long_until_the_take_fits(prefix: str) -> None:
    """Limit 10 spent in a fresh window (nothing before it): one more fits once this window ends
    and a tenth of it has slid out, (1 - elapsed + 0.1) x period; a cost over the limit, never."""
    a, b = shared(prefix, lease_fraction=0.5), shared(prefix, lease_fraction=0.5)
    fresh_window(HOUR, 30)

    async def body() -> None:
        assert all([(await r.take("k", 10, 1)).ok for r in (a, b) for _ in range(5)])
        for r in (a, b):
            before = window_of(time.time(), HOUR)[1]
            refused = await r.take("k", 10, 1)
            after = window_of(time.time(), HOUR)[1]
            assert not refused.ok
            assert (1.1 - after) * HOUR <= refused.wait_s <= (1.1 - before) * HOUR
        too_large = await a.take("k", 10, 11)
        assert not too_large.ok and too_large.wait_s == math.inf

    run(body, a, b)


def test_standing_counts_every_replica_as_last_seen(prefix: str) -> None:
    """What the x-ratelimit-* headers say: the window's count when this replica last claimed, less
    what its lease holds unspent; before any take, the whole limit."""
    a, b = shared(prefix, lease_fraction=0.1), shared(prefix, lease_fraction=0.1)
    fresh_window(HOUR, 30)

    async def body() -> None:
        fresh = a.standing("k", 100)
        assert fresh.remaining == 100 and fresh.reset_s == 0
        assert all([(await a.take("k", 100, 1)).ok for _ in range(3)])
        before = window_of(time.time(), HOUR)[1]
        standing = a.standing("k", 100)
        after = window_of(time.time(), HOUR)[1]
        assert standing.remaining == 97
        assert reset_after(0, 10, after, HOUR) <= standing.reset_s <= reset_after(0, 10, before, HOUR)
        assert all([(await b.take("k", 100, 1)).ok for _ in range(20)])  # two leases: 30 counted
        assert a.standing("k", 100).remaining == 97  # not seen by a until its next claim
        assert all([(await a.take("k", 100, 1)).ok for _ in range(8)])  # its lease spent, one more claimed
        assert a.standing("k", 100).remaining == 100 - 31
        assert b.standing("k", 100).remaining == 100 - 30  # as it last saw the window

    run(body, a, b)


def test_the_service_away_then_back(prefix: str, own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A server of the test's own killed under a replica: every take still answers, from this
    replica's own windows, within the claim's timeout (no exception, no retries' backoff); the
    warning is logged once however long it stays away. Started again on the same port, the
    service is shared again once ``retry_s`` has passed, and that is logged once."""
    caplog.set_level(logging.WARNING, logger="router.limits")
    retry_s = 0.5
    a = shared(prefix, lease_fraction=0.1, url=own_redis.url, retry_s=retry_s)
    fresh_window(HOUR, 30)

    def lines(word: str) -> int:
        return sum(f"budget service is {word}" in r.getMessage() for r in caplog.records)

    async def timed(n: int) -> list[float]:
        """``n`` takes, every one admitted; how long each took."""
        out = []
        for _ in range(n):
            started = time.monotonic()
            assert (await a.take("k", 1000, 1)).ok
            out.append(time.monotonic() - started)
        return out

    async def body() -> None:
        await timed(1)
        index = window_of(time.time(), HOUR)[0]
        assert a.shared and count(f"{prefix}:rate:k:{index}", own_redis.url) == 100
        own_redis.kill()
        # 99 from the lease, then claims that fail: this replica's own windows from there.
        assert max(await timed(300)) < TIMEOUT_S + 0.5
        assert not a.shared and lines("unreachable") == 1
        for _ in range(3):  # tried again after retry_s, still away: said once only
            await asyncio.sleep(retry_s)
            assert max(await timed(5)) < TIMEOUT_S + 0.5
        assert lines("unreachable") == 1 and lines("back") == 0

        own_redis.start()
        await asyncio.sleep(retry_s)
        await timed(1)
        assert a.shared and lines("back") == 1
        assert count(f"{prefix}:rate:k:{index}", own_redis.url) == 100  # a lease claimed on the new server
        await timed(200)
        assert lines("back") == 1 and lines("unreachable") == 1

    run(body, a)
