"""Each store's own machinery (router/state/sqlite*.py, postgres*.py): schema versions and
migrations, transactions, very deep chains written directly, SQLite's write path and WAL.

The contract every store keeps is tests/unit/test_store.py's; the backends and builders are shared
(tests/support/store_fixtures.py). PostgreSQL runs in the throwaway database of tests/support/pg.py.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

import router.state.postgres as postgres_mod
import router.state.sqlite as sqlite_mod
from router.state import sqlite_puts
from router.state.sqlite import SQLiteStore
from router.state.store import Store
from tests.support import store_fixtures
from tests.support.store_fixtures import Postgres, SQLite, ids, msg, resp

# The shared fixtures, bound here so pytest finds them for this module's tests.
backend, pg, pg_dsn, sqlite_db = store_fixtures.backend, store_fixtures.pg, store_fixtures.pg_dsn, store_fixtures.sqlite_db

# ---------------------------------------------------------------- one store's own machinery


def test_sqlite_wal_and_schema_version(sqlite_db: SQLite) -> None:
    sqlite_db.run(lambda s: s.put_response(resp("r")))
    with sqlite3.connect(sqlite_db.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(sqlite_mod.MIGRATIONS)


def test_sqlite_migrates_a_v1_file(sqlite_db: SQLite) -> None:
    """A file written before retention existed gets the expires_at column, data kept."""
    with sqlite3.connect(sqlite_db.path) as conn:
        for statement in sqlite_mod.MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("INSERT INTO responses VALUES ('r', 'alice', NULL, 0, 'completed', '{\"id\":\"r\"}')")
        conn.execute("PRAGMA user_version = 1")
    assert sqlite_db.run(lambda s: s.get_response("r", "alice")) == {"id": "r"}
    with sqlite3.connect(sqlite_db.path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(sqlite_mod.MIGRATIONS)


def test_sqlite_migrates_item_rows_into_their_responses(sqlite_db: SQLite) -> None:
    """A v5 file (one row per item, the output also in the body) reads the same after migration 6,
    and what is written to it afterwards keeps its item ids exact."""
    a = resp("a", inputs=[msg("a-in"), msg("a-in2", "two")], outputs=[msg("a-out", role="assistant")])
    b = resp("b", prev="a", inputs=[{"type": "message", "role": "user", "content": "no id"}])
    with sqlite3.connect(sqlite_db.path) as conn:
        for migration in sqlite_mod.MIGRATIONS[:5]:
            for statement in migration:
                conn.execute(statement)
        for r in (a, b):  # as the v5 code wrote them
            conn.execute("INSERT INTO responses (id, owner, previous_response_id, created_at, status, body) "
                         "VALUES (?, ?, ?, 0, ?, ?)", (r.id, r.owner, r.previous_response_id, r.status,
                                                       orjson.dumps(r.body)))
            for kind, items in ((0, r.input_items), (1, r.body["output"])):
                conn.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)",
                                 [(r.id, kind, k, item.get("id"), orjson.dumps(item)) for k, item in enumerate(items)])
        conn.execute("INSERT INTO responses (id, owner, created_at, status, body) VALUES "
                     "('empty', 'alice', 0, 'failed', '{\"id\":\"empty\",\"output\":[]}'), "
                     "('broken', 'alice', 0, 'failed', 'not json')")
        conn.execute("PRAGMA user_version = 5")

    async def body(s: Store) -> None:
        assert await s.get_response("empty", "alice") == {"id": "empty", "output": []}
        assert await s.load_history("empty", "alice") == []
        with pytest.raises(orjson.JSONDecodeError):  # as before the migration: that one read fails, no other
            await s.get_response("broken", "alice")
        assert await s.get_response("a", "alice") == a.body
        assert await s.get_response("b", "alice") == b.body
        assert await s.load_history("b", "alice") == [*a.input_items, *a.body["output"], *b.input_items,
                                                       *b.body["output"]]
        assert await s.get_items(["a-in2", "b-out", "nope"], "alice") == {"a-in2": msg("a-in2", "two"),
                                                                         "b-out": b.body["output"][0]}
        page = await s.list_input_items("a", "alice", order="asc", limit=1)
        assert page is not None and page.data == [msg("a-in")] and page.has_more
        await s.put_response(resp("a", inputs=[msg("a-new")], outputs=[]))  # a replace
        assert await s.get_items(["a-in", "a-new"], "alice") == {"a-new": msg("a-new")}
        assert await s.delete_response("b", "alice")

    sqlite_db.run(body)
    assert sqlite_db.raw_items("a") == [(0, 0, "a-new")]  # and item_ids holds just that id for it
    assert sqlite_db.raw_items("b") == []
    assert sqlite_db.query("SELECT item_id, response_id FROM item_ids") == [("a-new", "a")]
    with sqlite3.connect(sqlite_db.path) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'items'").fetchone() == (0,)
        (stored,) = conn.execute("SELECT body FROM responses WHERE id = 'a'").fetchone()
        assert orjson.loads(stored)["output"] is None  # the output is stored once, in its column


def test_sqlite_memory_database_works() -> None:
    async def body(s: Store) -> None:
        await s.put_response(resp("a"))
        await s.put_response(resp("b", prev="a"))
        assert await ids(s, "b") == ["a-in", "a-out", "b-in", "b-out"]

    SQLite(Path(":memory:")).run(body)


def test_sqlite_very_deep_chain_written_directly(sqlite_db: SQLite) -> None:
    """20,000 hops: the recursive CTE has no recursion limit to hit."""
    n = 20_000
    sqlite_db.run(lambda s: s.get_response("x", "alice"))  # create the schema
    with sqlite3.connect(sqlite_db.path) as conn:
        conn.executemany(
            "INSERT INTO responses (id, owner, previous_response_id, created_at, status, body, output)"
            " VALUES (?, 'alice', ?, 0, 'completed', x'7b7d', ?)",
            [(f"r{k}", f"r{k - 1}" if k else None, b'[{"id":"o%d"}]' % k) for k in range(n)],
        )
    history = sqlite_db.run(lambda s: s.load_history(f"r{n - 1}", "alice"))
    assert history is not None and [i["id"] for i in history] == [f"o{k}" for k in range(n)]


def test_sqlite_failure_inside_transaction_rolls_back(sqlite_db: SQLite) -> None:
    """A failure after the response row and the item delete are written leaves the old version."""
    old = resp("r", inputs=[msg("i0"), msg("i1")], outputs=[msg("o0")])
    sqlite_db.run(lambda s: s.put_response(old))
    # Make the database itself refuse one insert, mid-way through put_response's transaction.
    with sqlite3.connect(sqlite_db.path) as conn:
        conn.execute(
            "CREATE TRIGGER boom BEFORE INSERT ON item_ids WHEN NEW.item_id = 'bad' BEGIN SELECT RAISE(ABORT, 'boom'); END"
        )
    new = resp("r", status="failed", inputs=[msg("j0"), msg("j1")], outputs=[msg("p0"), msg("bad"), msg("p2")])

    async def body(s: Store) -> None:
        with pytest.raises(sqlite3.IntegrityError, match="boom"):
            await s.put_response(new)
        assert await s.get_response("r", "alice") == old.body
        assert await ids(s, "r") == ["i0", "i1", "o0"]
        await s.put_response(resp("after", prev="r"))  # the connection is usable (no dangling transaction)

    sqlite_db.run(body)
    assert sqlite_db.raw_items("r") == [(0, 0, "i0"), (0, 1, "i1"), (1, 0, "o0")]


def test_sqlite_newer_schema_is_refused(sqlite_db: SQLite) -> None:
    with sqlite3.connect(sqlite_db.path) as conn:
        conn.execute(f"PRAGMA user_version = {len(sqlite_mod.MIGRATIONS) + 1}")

    async def main() -> None:
        store = sqlite_db.store()
        with pytest.raises(RuntimeError, match="newer"):
            await store.open()
        with pytest.raises(RuntimeError, match="not open"):
            await store.get_response("x", "alice")

    asyncio.run(main())


def test_postgres_replicas_migrate_at_once(pg: Postgres) -> None:
    """Eight replicas opening a fresh database together: the advisory lock lets one migrate."""

    async def main() -> None:
        stores = [pg.store() for _ in range(8)]
        await asyncio.gather(*(s.open() for s in stores))
        try:
            await stores[3].put_response(resp("r"))
            assert (await stores[5].get_response("r", "alice") or {})["id"] == "r"
        finally:
            await asyncio.gather(*(s.close() for s in stores))

    asyncio.run(main())
    versions = [v for (v,) in pg.fetch("SELECT version FROM schema_migrations ORDER BY version")]
    assert versions == list(range(1, len(postgres_mod.MIGRATIONS) + 1))


def test_postgres_very_deep_chain_written_directly(pg: Postgres) -> None:
    """20,000 hops in one recursive query."""
    n = 20_000
    pg.run(lambda s: s.get_response("x", "alice"))  # create the schema
    pg.fetch(
        "INSERT INTO responses (id, owner, previous_response_id, created_at, status, body)"
        " SELECT 'r' || k, 'alice', CASE WHEN k > 0 THEN 'r' || (k - 1) END, 0, 'completed', '\\x7b7d'::bytea"
        " FROM generate_series(0, $1 - 1) AS k",
        n,
    )
    pg.fetch(
        "INSERT INTO items SELECT 'r' || k, 1, 0, 'o' || k, convert_to('{\"id\":\"o' || k || '\"}', 'UTF8')"
        " FROM generate_series(0, $1 - 1) AS k",
        n,
    )
    history = pg.run(lambda s: s.load_history(f"r{n - 1}", "alice"))
    assert history is not None and [i["id"] for i in history] == [f"o{k}" for k in range(n)]


def test_postgres_failure_inside_transaction_rolls_back(pg: Postgres) -> None:
    """The database refuses one item mid-way through put_response: the old version stays whole."""
    old = resp("r", inputs=[msg("i0"), msg("i1")], outputs=[msg("o0")])
    pg.run(lambda s: s.put_response(old))
    pg.fetch(
        """CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.item_id = 'bad' THEN RAISE EXCEPTION 'boom'; END IF;
            RETURN NEW;
        END $$"""
    )
    pg.fetch("CREATE TRIGGER boom BEFORE INSERT ON items FOR EACH ROW EXECUTE FUNCTION boom()")
    new = resp("r", status="failed", inputs=[msg("j0"), msg("j1")], outputs=[msg("p0"), msg("bad"), msg("p2")])

    async def body(s: Store) -> None:
        with pytest.raises(asyncpg.RaiseError, match="boom"):
            await s.put_response(new)
        assert await s.get_response("r", "alice") == old.body
        assert await ids(s, "r") == ["i0", "i1", "o0"]
        # The pool's connections are usable (no transaction left open on any of them).
        await asyncio.gather(*(s.put_response(resp(f"after{k}", prev="r")) for k in range(10)))
        assert await ids(s, "after7") == ["i0", "i1", "o0", "after7-in", "after7-out"]

    pg.run(body)
    assert pg.raw_items("r") == [(0, 0, "i0"), (0, 1, "i1"), (1, 0, "o0")]


def test_postgres_newer_schema_is_refused(pg: Postgres) -> None:
    pg.run(lambda s: s.get_response("x", "alice"))
    pg.fetch("INSERT INTO schema_migrations (version) VALUES ($1)", len(postgres_mod.MIGRATIONS) + 1)

    async def main() -> None:
        store = pg.store()
        with pytest.raises(RuntimeError, match="newer"):
            await store.open()
        with pytest.raises(RuntimeError, match="not open"):
            await store.get_response("x", "alice")

    asyncio.run(main())


def test_sqlite_group_of_new_responses_in_multi_row_inserts(sqlite_db: SQLite, monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent puts of new responses go in a few multi-row INSERTs (chunks of 256, 128, ...
    rows); one re-put among them sends that group put by put. Every response and item lands."""
    groups: list[int] = []
    real = sqlite_puts._put_group

    def counting(conn: sqlite3.Connection, batch: list[Any]) -> None:
        groups.append(len(batch))
        real(conn, batch)

    monkeypatch.setattr(sqlite_puts, "_put_group", counting)

    async def body(s: Store) -> None:
        await s.put_response(resp("old"))
        many = [resp(f"n{i}", inputs=[msg(f"n{i}-a"), msg(f"n{i}-b")]) for i in range(300)]
        assert await asyncio.gather(*(s.put_response(r) for r in many)) == [None] * 300
        assert max(groups) > 1  # grouped, the case under test
        for i in (0, 137, 299):
            assert await ids(s, f"n{i}") == [f"n{i}-a", f"n{i}-b", f"n{i}-out"]
        mixed = [resp(f"m{i}") for i in range(5)] + [resp("old", outputs=[msg("new-out", role="assistant")])]
        assert await asyncio.gather(*(s.put_response(r) for r in mixed)) == [None] * 6
        assert await ids(s, "old") == ["old-in", "new-out"]  # replaced, not doubled
        assert [await ids(s, f"m{i}") for i in range(5)] == [[f"m{i}-in", f"m{i}-out"] for i in range(5)]

    sqlite_db.run(body)


def test_sqlite_put_while_another_process_holds_the_write_lock(sqlite_db: SQLite) -> None:
    """An idle store commits on the loop without waiting; a locked file sends the put to the
    store's thread, which waits for the lock while the loop goes on."""

    async def body(s: Store) -> None:
        assert isinstance(s, SQLiteStore)
        s.quiet = lambda: True  # as the app sets it while no request is being served
        await s.put_response(resp("a"))
        assert s._inline_puts == 1  # committed on the loop
        other = sqlite3.connect(sqlite_db.path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        put = asyncio.ensure_future(s.put_response(resp("b", prev="a")))
        ticks = 0
        for _ in range(20):  # the loop keeps turning while the put waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20 and not put.done()
        other.execute("COMMIT")
        other.close()
        await put
        assert s._inline_puts == 1  # the locked put went through the thread
        assert await ids(s, "b") == ["a-in", "a-out", "b-in", "b-out"]

    sqlite_db.run(body)


def test_sqlite_wal_stays_bounded_under_steady_inline_puts(sqlite_db: SQLite) -> None:
    """Puts that never pause (each on the loop, a checkpoint now and then on the thread) must let
    the WAL start over: before the fix it grew ~34 KB per put for as long as traffic lasted."""
    puts = 8 * sqlite_mod.INLINE_CHECKPOINT_PUTS
    big = "x" * 2000  # ~2 pages per item: each put writes several WAL pages

    async def body(s: Store) -> None:
        assert isinstance(s, SQLiteStore)
        s.quiet = lambda: True
        for n in range(puts):
            await s.put_response(resp(f"r{n}", inputs=[msg(f"i{n}", big)], outputs=[msg(f"o{n}", big)]))
            await asyncio.sleep(0)  # the checkpoint, on the thread, runs meanwhile
        assert s._inline_puts > puts // 2  # most went inline, the case under test
        assert await ids(s, f"r{puts - 1}") == [f"i{puts - 1}", f"o{puts - 1}"]
        # Two checkpoint intervals of puts at most (unbounded, it would be ~8 intervals' worth).
        wal = Path(str(sqlite_db.path) + "-wal").stat().st_size  # noqa: ASYNC240 - one stat, in a test
        assert wal < 2 * sqlite_mod.INLINE_CHECKPOINT_PUTS * 10 * 4120, wal

    sqlite_db.run(body)


def test_sqlite_open_failure_names_the_file(tmp_path: Path) -> None:
    """A store path that is a folder (or unreadable): start-up's one line must say which file."""
    folder = tmp_path / "responses.db"
    folder.mkdir()

    async def body() -> None:
        store = SQLiteStore(str(folder))
        with pytest.raises(sqlite3.OperationalError) as err:
            await store.open()
        assert str(folder) in str(err.value)
        await store.close()

    asyncio.run(body())
