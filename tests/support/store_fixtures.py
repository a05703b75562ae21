"""What the store contract tests share: a ``Backend`` per kind of store, its fixtures, and
small builders of responses and items.

A test module binds the fixtures it uses to module names, where pytest finds them::

    from tests.support import store_fixtures
    backend, pg_dsn = store_fixtures.backend, store_fixtures.pg_dsn

(an assignment rather than an import, so a test's parameter of that name is no
redefinition to the linter). ``backend`` runs a test once on SQLite (a temp file)
and once on PostgreSQL (an empty schema in the throwaway database of tests/support/pg.py,
which needs ``pg_dsn`` bound too).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import asyncpg
import orjson
import pytest

import router.state.postgres as postgres_mod
import router.state.sqlite as sqlite_mod
from router.protocol.ids import made_for
from router.state.postgres import PostgresStore
from router.state.sqlite import SQLiteStore
from router.state.store import Item, Store, StoredResponse
from tests.support.pg import fresh_schema, pg_dsn  # noqa: F401  (pg_dsn is a fixture)

T = TypeVar("T")
Clock = Callable[[], float]
NOW = 1_700_000_000


class Backend:
    """One kind of store under test, plus raw access to what it wrote."""

    kind: str
    module: ModuleType

    def store(self, clock: Clock | None = None) -> Store:
        raise NotImplementedError

    def raw_items(self, rid: str) -> list[tuple[int, int, str | None]]:
        """What is really in the items table, read through a second connection."""
        raise NotImplementedError

    def raw_count(self, table: str) -> int:
        raise NotImplementedError

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` (no parameters: write SQL both databases read), through a second connection."""
        raise NotImplementedError

    def run(self, body: Callable[[Any], Awaitable[T]], clock: Clock | None = None) -> T:
        """Open a store, run ``body`` with it, and always close it."""

        async def main() -> T:
            store = self.store(clock)
            await store.open()
            try:
                return await body(store)
            finally:
                await store.close()

        return asyncio.run(main())


class SQLite(Backend):
    kind, module = "sqlite", sqlite_mod

    def __init__(self, path: Path) -> None:
        self.path = path

    def store(self, clock: Clock | None = None) -> Store:
        return SQLiteStore(str(self.path), **({"clock": clock} if clock else {}))

    def raw_items(self, rid: str) -> list[tuple[int, int, str | None]]:
        """From the response's own row (its ``input`` and ``output``); checks that ``item_ids``
        holds exactly their ids for it, but those its ``ItemIds`` made, none left behind by a
        replace or a delete."""
        with sqlite3.connect(self.path) as conn:
            row = conn.execute("SELECT input, output FROM responses WHERE id = ?", (rid,)).fetchone()
            indexed = sorted(iid for (iid,) in conn.execute("SELECT item_id FROM item_ids WHERE response_id = ?", (rid,)))
        rows: list[tuple[int, int, str | None]] = []
        for kind, blob in enumerate(row or ()):
            for position, item in enumerate(orjson.loads(blob) if blob else []):
                rows.append((kind, position, item["id"] if isinstance(item.get("id"), str) else None))
        assert indexed == sorted({iid for _, _, iid in rows if iid is not None and not made_for(iid, rid)})
        return rows

    def raw_count(self, table: str) -> int:
        if table == "items":
            table = "item_ids"  # a response's items are in its own row; their ids, one row each, here
        with sqlite3.connect(self.path) as conn:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.path) as conn:
            return conn.execute(sql).fetchall()


class Postgres(Backend):
    kind, module = "postgres", postgres_mod

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def store(self, clock: Clock | None = None) -> Store:
        return PostgresStore(self.dsn, min_size=1, max_size=8, **({"clock": clock} if clock else {}))

    def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        async def main() -> list[tuple[Any, ...]]:
            conn = await asyncpg.connect(self.dsn)
            try:
                return [tuple(r) for r in await conn.fetch(sql, *args)]
            finally:
                await conn.close()

        return asyncio.run(main())

    def raw_items(self, rid: str) -> list[tuple[int, int, str | None]]:
        sql = "SELECT kind, position, item_id FROM items WHERE response_id = $1 ORDER BY kind, position"
        return self.fetch(sql, rid)  # type: ignore[return-value]

    def raw_count(self, table: str) -> int:
        return self.fetch(f"SELECT count(*) FROM {table}")[0][0]

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        return self.fetch(sql)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return SQLite(tmp_path / "store.db")
    return Postgres(fresh_schema(request.getfixturevalue("pg_dsn")))


@pytest.fixture
def sqlite_db(tmp_path: Path) -> SQLite:
    return SQLite(tmp_path / "store.db")


@pytest.fixture
def pg(pg_dsn: str) -> Postgres:  # noqa: F811
    return Postgres(fresh_schema(pg_dsn))


def msg(item_id: str, text: str = "", role: str = "user") -> Item:
    return {"type": "message", "id": item_id, "role": role, "content": [{"type": "input_text", "text": text or item_id}]}


def resp(
    rid: str,
    *,
    owner: str = "alice",
    prev: str | None = None,
    inputs: list[Item] | None = None,
    outputs: list[Item] | None = None,
    status: str = "completed",
    expires_at: int | None = None,
    lease_holder: str | None = None,
    lease_until: float | None = None,
) -> StoredResponse:
    body: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "status": status,
        "previous_response_id": prev,
        "output": outputs if outputs is not None else [msg(f"{rid}-out", role="assistant")],
    }
    return StoredResponse(
        id=rid,
        owner=owner,
        previous_response_id=prev,
        created_at=1_700_000_000,
        status=status,
        body=body,
        input_items=inputs if inputs is not None else [msg(f"{rid}-in")],
        expires_at=expires_at,
        lease_holder=lease_holder,
        lease_until=lease_until,
    )


async def ids(s: Store, rid: str, owner: str = "alice") -> list[str] | None:
    history = await s.load_history(rid, owner)
    return None if history is None else [i["id"] for i in history]
