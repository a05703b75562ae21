"""bench/limits.py: its PostgreSQL claim answers as the router's Redis script does and holds the
limit under concurrent clients (so the comparison is of like with like), and a tiny run prints
its two tables."""

from __future__ import annotations

import asyncio
import re

import asyncpg
import pytest

from bench import limits

REDIS = "redis://127.0.0.1:6379"
PG = "postgresql://postgres@127.0.0.1:5432/postgres"


def test_the_postgres_claim_answers_as_the_redis_script() -> None:
    async def main() -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        async with limits.budget_database(PG) as dsn:
            conn = await asyncpg.connect(dsn)
            try:
                return await limits.redis_claims(REDIS, limits.AGREEMENT), await limits.pg_claims(conn, limits.AGREEMENT)
            finally:
                await conn.close()

    ours, theirs = asyncio.run(main())
    assert ours == theirs
    grants = [g for g, _, _ in ours]
    assert grants == [4, 4, 2, 0, 0, 4, 1, 2, 0]  # whole, whole, cut to the room, refused; the next window


def test_the_postgres_claim_holds_the_limit_under_concurrent_clients() -> None:
    """Eight connections claiming 3 at a time from one window of 100, its row not yet there."""
    async def main() -> list[int]:
        async with limits.budget_database(PG) as dsn:
            pool = await asyncpg.create_pool(dsn, min_size=8, max_size=8)
            try:
                async def client() -> list[int]:
                    async with pool.acquire() as conn:
                        return [int((await conn.fetchrow(limits.PG_CLAIM, "k", 5, 1, 3, 100, 0.0))["granted"])
                                for _ in range(30)]

                return [g for grants in await asyncio.gather(*(client() for _ in range(8))) for g in grants]
            finally:
                await pool.close()

    grants = asyncio.run(main())
    assert sum(grants) == 100  # never over; a first claim that loses the race for the row is refused, later ones fill it
    assert set(grants) <= {0, 1, 2, 3}


def test_a_tiny_run_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert limits.main(["--claims", "20", "--limit", "40", "--redis", REDIS, "--pg", PG]) == 0
    out = capsys.readouterr().out
    latency = re.findall(r"^\| (Redis|PostgreSQL) [^|]* \| (\d+) \| (\d+) \| (\d+) \|$", out, re.M)
    assert [row[0] for row in latency] == ["Redis", "PostgreSQL"]
    assert all(int(p50) <= int(p99) for _, p50, p99, _ in latency)
    assert re.search(r"^PostgreSQL / Redis: p50 [\d.]+x, p99 [\d.]+x, mean [\d.]+x$", out, re.M)
    drift = re.findall(r"^\| (requests|tokens) [^|]* \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \| (\d+) \| (\d+) \|$",
                       out, re.M)
    assert [row[0] for row in drift] == ["requests", "tokens"]
    for _, limit, a, b, total, share, granted, _ in drift:
        assert int(a) + int(b) == int(total) <= int(limit) and float(share) <= 1.0 and int(granted) > 0
