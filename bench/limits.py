"""What one claim of a shared budget costs in Redis against PostgreSQL, and how close two replicas
sharing a budget keep to its limit: the measurement router/limits/shared.py cites for Redis.

    .venv/bin/python bench/limits.py [--claims 5000] [--limit 600] [--lease-fraction 0.05]
        [--redis redis://127.0.0.1:6379] [--pg postgresql://postgres@127.0.0.1:5432/postgres]

Latency: ``--claims`` claims per store from one client, each one round trip, in blocks of 250
alternating between the stores (what else the machine runs weighs on both alike), after a
warm-up: Redis running the router's own script (``SharedBudgets._claim``, CLAIM in
router/limits/shared.py), PostgreSQL the same claim as one statement (``PG_CLAIM``: a CTE reads
the previous window's count and locks the current one's row, and the current count is upserted
only when the sliding window has room) in a throwaway database the run makes and drops. Both
give the same answers to the same claims (checked before the timing); the timed claims are
asked with a limit none reaches, so every one writes. p50, p99 and mean per claim, and
PostgreSQL's over Redis's.

Drift: two ``SharedBudgets`` (two replicas, one event loop, a connection pool each) taking from
one budget at once, 16 tasks each, until both are refused: requests (cost 1, ``--limit``) and
tokens (costs 1 to 40, 20 x ``--limit``). Admitted by each, in all against the limit, and the
claims (round trips) granted and refused. The window is an hour here, so that the run falls in
one; the arithmetic is a minute's.

Numbers move with the machine: the ratios are the figures to read. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
from redis.commands.core import AsyncScript  # noqa: E402

from router.limits.shared import SharedBudgets  # noqa: E402

HOUR = 3600.0
NEVER_REACHED = 10**15  # a limit the timed claims never reach: every one is granted, and writes
COSTS = [1 + (i * 7) % 40 for i in range(997)]  # tokens: the same spread of costs every run

# One claim, as CLAIM in router/limits/shared.py: $1 name, $2 window, $3 need, $4 want, $5 limit,
# $6 elapsed (0..1). Returns the grant and the two counts after it. The current window's row is
# locked as it is read (FOR UPDATE), so the room is checked against the count the upsert adds to;
# a window's first claims race to insert its row, and the loser's upsert is checked again in its
# WHERE (refused rather than over the limit).
PG_CLAIM = """
WITH prev AS (
    SELECT coalesce((SELECT used FROM budget WHERE name = $1 AND "window" = $2 - 1), 0) AS used
), cur AS (
    SELECT used FROM budget WHERE name = $1 AND "window" = $2 FOR UPDATE
), room AS (
    SELECT prev.used AS prev, coalesce((SELECT used FROM cur), 0) AS cur,
           $5::bigint - prev.used * (1 - $6::float8) - coalesce((SELECT used FROM cur), 0) AS room
    FROM prev
), claim AS (
    SELECT prev, cur, CASE WHEN room < $3 THEN 0 ELSE greatest($3::bigint, least($4::bigint, floor(room)::bigint)) END AS n
    FROM room
), up AS (
    INSERT INTO budget (name, "window", used)
    SELECT $1, $2, n FROM claim WHERE n > 0
    ON CONFLICT (name, "window") DO UPDATE SET used = budget.used + excluded.used
    WHERE budget.used + excluded.used <= $5::bigint - (SELECT prev FROM claim) * (1 - $6::float8)
    RETURNING used
)
SELECT CASE WHEN EXISTS (SELECT FROM up) THEN n ELSE 0 END AS granted, prev,
       coalesce((SELECT used FROM up), cur) AS cur
FROM claim
"""
PG_TABLE = 'CREATE TABLE budget (name text, "window" bigint, used bigint, PRIMARY KEY (name, "window"))'


class CountedScript(AsyncScript):
    """A ``SharedBudgets``' claim script that counts its round trips: granted, refused."""

    granted = refused = 0

    async def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None,
                       client: Any = None) -> Any:
        answer = await super().__call__(keys, args, client)
        if int(answer[0]):
            self.granted += 1
        else:
            self.refused += 1
        return answer


def counted(budgets: SharedBudgets) -> CountedScript:
    script = CountedScript(budgets._claim.registered_client, budgets._claim.script)
    budgets._claim = script
    return script


@dataclass(frozen=True, slots=True)
class Latency:
    """Seconds per claim, over the timed claims."""

    p50: float
    p99: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Latency:
        ordered = sorted(samples)
        return cls(ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
                   statistics.fmean(ordered))


@dataclass(frozen=True, slots=True)
class Drift:
    """Two replicas on one budget: what each admitted, against the limit, and the round trips
    (claims granted, claims refused)."""

    what: str
    limit: int
    admitted: tuple[int, int]
    granted: int
    refused: int

    @property
    def total(self) -> int:
        return sum(self.admitted)


def redis_args(need: int, want: int, limit: int, elapsed: float) -> list[Any]:
    return [need, want, limit, elapsed, int(HOUR * 2000)]


async def redis_claims(url: str, claims: Sequence[tuple[int, int, int, int, float]]) -> list[tuple[int, int, int]]:
    """``claims`` (window, need, want, limit, elapsed) on one fresh budget, in order, through the
    router's script; the answers."""
    budgets = SharedBudgets(url, prefix=f"rr-bench-{uuid.uuid4().hex[:12]}", lease_fraction=0.05, retry_s=5.0,
                            period_s=HOUR)
    try:
        out = []
        for index, need, want, limit, elapsed in claims:
            answer = await budgets._claim(keys=[budgets._key("k", index), budgets._key("k", index - 1)],
                                          args=redis_args(need, want, limit, elapsed))
            out.append((int(answer[0]), int(answer[1]), int(answer[2])))
        return out
    finally:
        await forget(budgets)


async def pg_claims(conn: asyncpg.Connection, claims: Sequence[tuple[int, int, int, int, float]]) -> list[tuple[int, int, int]]:
    """The same, through ``PG_CLAIM`` on a fresh budget name."""
    name = uuid.uuid4().hex
    out = []
    for index, need, want, limit, elapsed in claims:
        row = await conn.fetchrow(PG_CLAIM, name, index, need, want, limit, elapsed)
        out.append((int(row["granted"]), int(row["prev"]), int(row["cur"])))
    return out


# Claims both must answer alike: leases granted whole, cut to the room, refused; a previous window
# weighing on the next.
AGREEMENT = [(7, 1, 4, 10, 0.0), (7, 1, 4, 10, 0.2), (7, 1, 4, 10, 0.5), (7, 3, 4, 10, 0.6), (7, 1, 4, 10, 0.9),
             (8, 1, 4, 10, 0.5), (8, 1, 4, 10, 0.5), (8, 2, 2, 10, 0.9), (9, 5, 9, 10, 0.1)]


async def forget(budgets: SharedBudgets) -> None:
    """Deletes a budget's keys (the bench's prefix alone) and closes it."""
    keys = [key async for key in budgets._redis.scan_iter(match=f"{budgets.prefix}:*")]
    if keys:
        await budgets._redis.delete(*keys)
    await budgets.close()


async def timed(claim: Callable[[], Awaitable[Any]], n: int, into: list[float]) -> None:
    for _ in range(n):
        started = time.perf_counter()
        await claim()
        into.append(time.perf_counter() - started)


async def time_claims(redis_url: str, conn: asyncpg.Connection, n: int, block: int = 250) -> tuple[list[float], list[float]]:
    """``n`` claims on each store, in alternate blocks of ``block`` (what else the machine runs
    weighs on both alike), after a warm-up block each: seconds per claim, Redis's and PostgreSQL's."""
    budgets = SharedBudgets(redis_url, prefix=f"rr-bench-{uuid.uuid4().hex[:12]}", lease_fraction=0.05, retry_s=5.0,
                            period_s=HOUR)
    keys = [budgets._key("k", 1), budgets._key("k", 0)]
    args = redis_args(1, 50, NEVER_REACHED, 0.5)

    def redis_claim() -> Awaitable[Any]:
        return budgets._claim(keys=keys, args=args)

    def pg_claim() -> Awaitable[Any]:
        return conn.fetchrow(PG_CLAIM, "k", 1, 1, 50, NEVER_REACHED, 0.5)

    redis: list[float] = []
    pg: list[float] = []
    try:
        await timed(redis_claim, min(block, n), [])
        await timed(pg_claim, min(block, n), [])
        for start in range(0, n, block):
            await timed(redis_claim, min(block, n - start), redis)
            await timed(pg_claim, min(block, n - start), pg)
    finally:
        await forget(budgets)
    return redis, pg


async def drift(url: str, what: str, limit: int, costs: Sequence[int], lease_fraction: float,
                concurrency: int = 16) -> Drift:
    """Two replicas taking ``costs`` (each its own copy), ``concurrency`` tasks each, at once."""
    prefix = f"rr-bench-{uuid.uuid4().hex[:12]}"
    replicas = [SharedBudgets(url, prefix=prefix, lease_fraction=lease_fraction, retry_s=5.0, period_s=HOUR)
                for _ in range(2)]
    scripts = [counted(r) for r in replicas]

    async def replica(budgets: SharedBudgets) -> int:
        todo, admitted = list(costs), 0

        async def task() -> None:
            nonlocal admitted
            while todo:
                cost = todo.pop()
                if (await budgets.take("k", limit, cost)).ok:
                    admitted += cost

        await asyncio.gather(*(task() for _ in range(concurrency)))
        return admitted

    try:
        a, b = await asyncio.gather(replica(replicas[0]), replica(replicas[1]))
    finally:
        for r in replicas:
            await forget(r)
    return Drift(what, limit, (a, b), sum(s.granted for s in scripts), sum(s.refused for s in scripts))


def one_window(need_s: float = 30.0) -> None:
    """The drift runs in one window: wait out this one's end when it is near."""
    left = HOUR - time.time() % HOUR
    if left < need_s:
        time.sleep(left + 0.01)


@asynccontextmanager
async def budget_database(server: str) -> AsyncIterator[str]:
    """A throwaway database on the server of ``server`` (a DSN) with the ``budget`` table: its DSN."""
    name = f"rr_bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = urlunsplit(urlsplit(server)._replace(path="/" + name))
        try:
            conn = await asyncpg.connect(dsn, timeout=10)
            try:
                await conn.execute(PG_TABLE)
            finally:
                await conn.close()
            yield dsn
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def measure(args: argparse.Namespace) -> tuple[dict[str, Latency], list[Drift]]:
    async with budget_database(args.pg) as dsn:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            ours, theirs = await redis_claims(args.redis, AGREEMENT), await pg_claims(conn, AGREEMENT)
            if ours != theirs:
                raise SystemExit(f"PostgreSQL's claim answers differently from Redis's:\n{ours}\n{theirs}")
            redis, pg = await time_claims(args.redis, conn, args.claims)
            latencies = {"Redis (SharedBudgets' script)": Latency.of(redis),
                         "PostgreSQL (one upsert statement)": Latency.of(pg)}
        finally:
            await conn.close()
    one_window()
    drifts = [await drift(args.redis, "requests (cost 1)", args.limit, [1] * (4 * args.limit), args.lease_fraction),
              await drift(args.redis, "tokens (cost 1-40)", 20 * args.limit,
                          COSTS * max(1, (8 * args.limit) // len(COSTS)), args.lease_fraction)]
    return latencies, drifts


def report(latencies: dict[str, Latency], drifts: Sequence[Drift], claims: int, lease_fraction: float) -> str:
    lines = [f"One claim, one client, {claims} per store:", "",
             "| store | p50 us | p99 us | mean us |", "|---|---:|---:|---:|"]
    for name, lat in latencies.items():
        lines.append(f"| {name} | {lat.p50 * 1e6:.0f} | {lat.p99 * 1e6:.0f} | {lat.mean * 1e6:.0f} |")
    redis, pg = latencies.values()
    lines += ["", f"PostgreSQL / Redis: p50 {pg.p50 / redis.p50:.2f}x, p99 {pg.p99 / redis.p99:.2f}x, "
                  f"mean {pg.mean / redis.mean:.2f}x", "",
              f"Two replicas on one budget, leases of {lease_fraction:g} of the limit:", "",
              "| budget | limit | replica a | replica b | admitted | admitted / limit | claims granted | refused |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for d in drifts:
        lines.append(f"| {d.what} | {d.limit} | {d.admitted[0]} | {d.admitted[1]} | {d.total} | {d.total / d.limit:.3f} "
                     f"| {d.granted} | {d.refused} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--claims", type=int, default=5000, help="timed claims per store")
    p.add_argument("--limit", type=int, default=600, help="the drift's requests per window (tokens: 20x)")
    p.add_argument("--lease-fraction", type=float, default=0.05)
    p.add_argument("--redis", default="redis://127.0.0.1:6379")
    p.add_argument("--pg", default=os.environ.get("RESPONSES_ROUTER_TEST_PG") or "postgresql://postgres@127.0.0.1:5432/postgres",
                   help="a server where the run may create and drop a database")
    args = p.parse_args(argv)
    latencies, drifts = asyncio.run(measure(args))
    print(report(latencies, drifts, args.claims, args.lease_fraction))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
