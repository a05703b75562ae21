"""Chain-load time: ``Store.load_history`` at the end of chains of 1 to 1,000 turns.

``python bench/chain_load.py [--runs N]`` prints a table; ``run()`` returns its
rows (one dict per store and chain length) for bench/run.py.

Each turn is one input message (~300 characters) and one output message
(~700 characters), written through ``put_response`` like the router does.
Every load is timed on its own after one warm-up load; the table shows the
median (``p50_ms``) and the fastest (``min_ms``) of ``runs`` loads.

SQLite: a file in a temporary folder. PostgreSQL: a throwaway database on
the server named by ``RESPONSES_ROUTER_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``), dropped at the end; an
unreachable server gives a row saying why instead of numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from router.state.store import Store, StoredResponse  # noqa: E402

TURNS = (1, 10, 100, 1_000)
RUNS = 15
PG_ENV = "RESPONSES_ROUTER_TEST_PG"
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


def turn(chain: str, k: int) -> StoredResponse:
    rid = f"resp_{chain}_{k:04d}"
    user = {
        "type": "message", "id": f"msg_{chain}_{k}_in", "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": f"Question {k}: " + "how does this work? " * 15}],
    }  # fmt: skip
    answer = {
        "type": "message", "id": f"msg_{chain}_{k}_out", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": f"Answer {k}: " + "it works like this. " * 35}],
    }  # fmt: skip
    prev = f"resp_{chain}_{k - 1:04d}" if k else None
    body = {
        "id": rid, "object": "response", "created_at": 1_700_000_000 + k, "status": "completed",
        "model": "bench", "previous_response_id": prev, "output": [answer],
        "usage": {"input_tokens": 100 * k, "output_tokens": 150, "total_tokens": 100 * k + 150},
    }  # fmt: skip
    return StoredResponse(
        id=rid, owner="bench", previous_response_id=prev, created_at=body["created_at"], status="completed",
        body=body, input_items=[user],
    )  # fmt: skip


async def measure(store: Store, name: str, turns: tuple[int, ...], runs: int) -> list[dict[str, Any]]:
    rows = []
    for n in turns:
        chain = f"c{n}"
        for k in range(n):
            await store.put_response(turn(chain, k))
        last = f"resp_{chain}_{n - 1:04d}"
        history = await store.load_history(last, "bench")  # warm-up, and a check
        assert history is not None and len(history) == 2 * n, (name, n)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            await store.load_history(last, "bench")
            times.append((time.perf_counter() - t0) * 1000)
        rows.append({
            "store": name, "turns": n, "items": 2 * n,
            "p50_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3), "runs": runs,
        })  # fmt: skip
    return rows


async def _sqlite(turns: tuple[int, ...], runs: int) -> list[dict[str, Any]]:
    from router.state.sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="chain_load_") as tmp:
        store = SQLiteStore(str(Path(tmp) / "bench.db"))
        await store.open()
        try:
            return await measure(store, "sqlite", turns, runs)
        finally:
            await store.close()


async def _postgres(turns: tuple[int, ...], runs: int) -> list[dict[str, Any]]:
    import asyncpg

    from router.state.postgres import PostgresStore

    server = os.environ.get(PG_ENV) or PG_DEFAULT
    name = f"rr_bench_{uuid.uuid4().hex[:12]}"
    try:
        admin = await asyncpg.connect(server, timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        return [{"store": "postgres", "error": f"cannot connect ({type(exc).__name__}: {exc}); set {PG_ENV}"}]
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        store = PostgresStore(urlunsplit(urlsplit(server)._replace(path="/" + name)), min_size=1, max_size=4)
        await store.open()
        try:
            return await measure(store, "postgres", turns, runs)
        finally:
            await store.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def run_async(turns: tuple[int, ...] = TURNS, runs: int = RUNS) -> list[dict[str, Any]]:
    return [*await _sqlite(turns, runs), *await _postgres(turns, runs)]


def run(turns: tuple[int, ...] = TURNS, runs: int = RUNS) -> list[dict[str, Any]]:
    """One row per store and chain length: store, turns, items, p50_ms, min_ms, runs."""
    return asyncio.run(run_async(turns, runs))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'store':<10} {'turns':>6} {'items':>6} {'p50 ms':>9} {'min ms':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['store']:<10} {r['error']}")
        else:
            lines.append(f"{r['store']:<10} {r['turns']:>6} {r['items']:>6} {r['p50_ms']:>9.3f} {r['min_ms']:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=RUNS, help=f"timed loads per chain (default {RUNS})")
    args = parser.parse_args(argv)
    print(table(run(runs=args.runs)))


if __name__ == "__main__":
    main()
