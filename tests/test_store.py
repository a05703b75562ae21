"""SQLiteStore against the Store contract (router/state/store.py)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.state.sqlite as sqlite_mod
from router.state.sqlite import SQLiteStore
from router.state.store import Item, StoredResponse

T = TypeVar("T")


def run(path: Path | str, body: Callable[[SQLiteStore], Awaitable[T]]) -> T:
    """Open a store, run ``body`` with it, and always close it."""

    async def main() -> T:
        store = SQLiteStore(str(path))
        await store.open()
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


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
    )


def raw_items(path: Path, rid: str) -> list[tuple[int, int, str | None]]:
    """What is really in the items table, read through a second connection."""
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT kind, position, item_id FROM items WHERE response_id = ? ORDER BY kind, position", (rid,)
        ).fetchall()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


def test_roundtrip_wal_and_schema_version(db: Path) -> None:
    r = resp("resp_1")

    async def body(s: SQLiteStore) -> None:
        await s.put_response(r)
        assert await s.get_response("resp_1", "alice") == r.body
        assert await s.get_response("nope", "alice") is None

    run(db, body)
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(sqlite_mod.MIGRATIONS)


def test_memory_database_works() -> None:
    async def body(s: SQLiteStore) -> None:
        await s.put_response(resp("a"))
        await s.put_response(resp("b", prev="a"))
        assert [i["id"] for i in await s.load_history("b", "alice") or []] == ["a-in", "a-out", "b-in", "b-out"]

    run(":memory:", body)


def test_owner_isolation_on_every_method(db: Path) -> None:
    async def body(s: SQLiteStore) -> None:
        r = resp("resp_a")
        await s.put_response(r)
        assert await s.get_response("resp_a", "bob") is None
        assert await s.load_history("resp_a", "bob") is None
        assert await s.list_input_items("resp_a", "bob") is None
        assert await s.delete_response("resp_a", "bob") is False
        # Another owner cannot overwrite the response either.
        with pytest.raises(PermissionError):
            await s.put_response(resp("resp_a", owner="bob", outputs=[msg("evil")]))
        assert await s.get_response("resp_a", "alice") == r.body
        assert [i["id"] for i in await s.load_history("resp_a", "alice") or []] == ["resp_a-in", "resp_a-out"]
        # A chain never crosses owners: bob's response naming alice's as previous sees only its own items.
        await s.put_response(resp("resp_b", owner="bob", prev="resp_a"))
        assert [i["id"] for i in await s.load_history("resp_b", "bob") or []] == ["resp_b-in", "resp_b-out"]

    run(db, body)


def test_history_order_three_hops(db: Path) -> None:
    async def body(s: SQLiteStore) -> list[Item] | None:
        # Written newest first to show order comes from the chain, not insertion.
        await s.put_response(resp("r3", prev="r2", inputs=[msg("r3-i0"), msg("r3-i1")], outputs=[msg("r3-o0")]))
        await s.put_response(resp("r2", prev="r1", inputs=[msg("r2-i0")], outputs=[msg("r2-o0"), msg("r2-o1")]))
        await s.put_response(resp("r1", inputs=[msg("r1-i0"), msg("r1-i1")], outputs=[msg("r1-o0")]))
        await s.put_response(resp("other", prev="r1"))  # a sibling branch must not leak in
        return await s.load_history("r3", "alice")

    history = run(db, body)
    assert [i["id"] for i in history or []] == [
        "r1-i0", "r1-i1", "r1-o0",
        "r2-i0", "r2-o0", "r2-o1",
        "r3-i0", "r3-i1", "r3-o0",
    ]  # fmt: skip


def test_response_without_items_has_empty_history(db: Path) -> None:
    async def body(s: SQLiteStore) -> None:
        await s.put_response(resp("empty", inputs=[], outputs=[]))
        assert await s.load_history("empty", "alice") == []
        await s.put_response(resp("child", prev="empty"))
        assert [i["id"] for i in await s.load_history("child", "alice") or []] == ["child-in", "child-out"]

    run(db, body)


def test_thousand_long_chain(db: Path) -> None:
    n = 1_000

    async def body(s: SQLiteStore) -> list[Item] | None:
        for k in range(n):
            await s.put_response(resp(f"r{k}", prev=f"r{k - 1}" if k else None))
        return await s.load_history(f"r{n - 1}", "alice")

    history = run(db, body)
    assert history is not None and len(history) == 2 * n
    assert history[0]["id"] == "r0-in" and history[-1]["id"] == f"r{n - 1}-out"
    assert [i["id"] for i in history[:4]] == ["r0-in", "r0-out", "r1-in", "r1-out"]


def test_very_deep_chain_written_directly(db: Path) -> None:
    """20,000 hops: the recursive CTE has no recursion limit to hit."""
    n = 20_000
    run(db, lambda s: s.get_response("x", "alice"))  # create the schema
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO responses VALUES (?, 'alice', ?, 0, 'completed', x'7b7d')",
            [(f"r{k}", f"r{k - 1}" if k else None) for k in range(n)],
        )
        conn.executemany(
            "INSERT INTO items VALUES (?, 1, 0, ?, ?)", [(f"r{k}", f"o{k}", b'{"id":"o%d"}' % k) for k in range(n)]
        )
    history = run(db, lambda s: s.load_history(f"r{n - 1}", "alice"))
    assert history is not None and [i["id"] for i in history] == [f"o{k}" for k in range(n)]


def test_cycle_does_not_hang(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_mod, "MAX_CHAIN_DEPTH", 50)

    async def body(s: SQLiteStore) -> list[Item] | None:
        await s.put_response(resp("a"))
        await s.put_response(resp("b", prev="a"))
        await s.put_response(resp("a", prev="b"))  # a buggy upsert closes a loop
        return await s.load_history("b", "alice")

    history = run(db, body)
    assert history is not None and len(history) == 2 * 51


def test_upsert_replaces_items(db: Path) -> None:
    async def body(s: SQLiteStore) -> None:
        await s.put_response(
            resp("r", status="in_progress", inputs=[msg("i0"), msg("i1")], outputs=[msg("o0"), msg("o1"), msg("o2")])
        )
        final = resp("r", inputs=[msg("j0")], outputs=[msg("p0")])
        await s.put_response(final)
        assert await s.get_response("r", "alice") == final.body
        assert [i["id"] for i in await s.load_history("r", "alice") or []] == ["j0", "p0"]
        page = await s.list_input_items("r", "alice")
        assert page is not None and [i["id"] for i in page.data] == ["j0"]

    run(db, body)
    assert raw_items(db, "r") == [(0, 0, "j0"), (1, 0, "p0")]


def test_delete_cascades_and_child_history_stops_at_gap(db: Path) -> None:
    async def body(s: SQLiteStore) -> None:
        await s.put_response(resp("r1"))
        await s.put_response(resp("r2", prev="r1"))
        await s.put_response(resp("r3", prev="r2"))
        assert await s.delete_response("r2", "alice") is True
        assert await s.delete_response("r2", "alice") is False
        assert await s.get_response("r2", "alice") is None
        assert await s.load_history("r2", "alice") is None
        assert await s.list_input_items("r2", "alice") is None
        # The child keeps its own data, and its chain ends at the gap.
        assert (await s.get_response("r3", "alice") or {})["previous_response_id"] == "r2"
        assert [i["id"] for i in await s.load_history("r3", "alice") or []] == ["r3-in", "r3-out"]
        assert [i["id"] for i in await s.load_history("r1", "alice") or []] == ["r1-in", "r1-out"]

    run(db, body)
    assert raw_items(db, "r2") == []  # cascade: the foreign key is enforced
    assert len(raw_items(db, "r3")) == 2


def test_list_input_items_pagination(db: Path) -> None:
    ids = ["a", "b", "c", "d", "e"]

    async def body(s: SQLiteStore) -> None:
        await s.put_response(resp("r", inputs=[msg(i) for i in ids]))

        async def page(**kw: Any) -> tuple[list[str], bool]:
            p = await s.list_input_items("r", "alice", **kw)
            assert p is not None
            return [i["id"] for i in p.data], p.has_more

        assert await page() == (["e", "d", "c", "b", "a"], False)  # default: desc, limit 20
        assert await page(limit=2) == (["e", "d"], True)
        assert await page(limit=2, after="d") == (["c", "b"], True)
        assert await page(limit=2, after="b") == (["a"], False)
        assert await page(after="a") == ([], False)
        assert await page(order="asc", limit=2) == (["a", "b"], True)
        assert await page(order="asc", limit=2, after="b") == (["c", "d"], True)
        assert await page(order="asc", limit=2, after="d") == (["e"], False)
        assert await page(order="asc", limit=5) == (ids, False)
        assert await page(order="asc", limit=4) == (ids[:4], True)
        with pytest.raises(KeyError) as err:
            await s.list_input_items("r", "alice", after="zzz")
        assert err.value.args == ("zzz",)
        with pytest.raises(KeyError):  # an output item's id is not an input item
            await s.list_input_items("r", "alice", after="r-out")
        with pytest.raises(ValueError):
            await s.list_input_items("r", "alice", limit=0)
        await s.put_response(resp("none", inputs=[]))
        empty = await s.list_input_items("none", "alice")
        assert empty is not None and (empty.data, empty.has_more) == ([], False)

    run(db, body)


def test_failure_inside_transaction_rolls_back(db: Path) -> None:
    """A failure after the response row and the item delete are written leaves the old version."""
    old = resp("r", inputs=[msg("i0"), msg("i1")], outputs=[msg("o0")])
    run(db, lambda s: s.put_response(old))
    # Make the database itself refuse one insert, mid-way through put_response's transaction.
    with sqlite3.connect(db) as conn:
        conn.execute(
            "CREATE TRIGGER boom BEFORE INSERT ON items WHEN NEW.item_id = 'bad' BEGIN SELECT RAISE(ABORT, 'boom'); END"
        )
    new = resp("r", status="failed", inputs=[msg("j0"), msg("j1")], outputs=[msg("p0"), msg("bad"), msg("p2")])

    async def body(s: SQLiteStore) -> None:
        with pytest.raises(sqlite3.IntegrityError, match="boom"):
            await s.put_response(new)
        assert await s.get_response("r", "alice") == old.body
        assert [i["id"] for i in await s.load_history("r", "alice") or []] == ["i0", "i1", "o0"]
        await s.put_response(resp("after", prev="r"))  # the connection is usable (no dangling transaction)

    run(db, body)
    assert raw_items(db, "r") == [(0, 0, "i0"), (0, 1, "i1"), (1, 0, "o0")]


def test_unserializable_item_writes_nothing(db: Path) -> None:
    old = resp("r", inputs=[msg("i0")], outputs=[msg("o0")])
    bad = resp("r", inputs=[msg("j0")], outputs=[msg("p0"), {"type": "message", "id": "x", "content": {1, 2}}])

    async def body(s: SQLiteStore) -> None:
        await s.put_response(old)
        with pytest.raises(TypeError):  # orjson.JSONEncodeError is a TypeError
            await s.put_response(bad)
        assert await s.get_response("r", "alice") == old.body
        assert [i["id"] for i in await s.load_history("r", "alice") or []] == ["i0", "o0"]

    run(db, body)
    assert raw_items(db, "r") == [(0, 0, "i0"), (1, 0, "o0")]


def test_concurrent_puts(db: Path) -> None:
    async def body(s: SQLiteStore) -> None:
        distinct = [resp(f"r{k}", inputs=[msg(f"r{k}-i{j}") for j in range(3)]) for k in range(100)]
        # Many versions of one response racing: the winner must be whole, never a mix.
        versions = [resp("hot", outputs=[msg(f"v{v}-o{j}") for j in range(v % 4 + 1)]) for v in range(50)]
        await asyncio.gather(
            *(s.put_response(r) for r in distinct + versions),
            *(s.load_history(f"r{k}", "alice") for k in range(100)),
        )
        for r in distinct:
            assert await s.get_response(r.id, "alice") == r.body
            assert [i["id"] for i in await s.load_history(r.id, "alice") or []] == [
                *(f"{r.id}-i{j}" for j in range(3)),
                f"{r.id}-out",
            ]
        hot = await s.get_response("hot", "alice")
        assert hot is not None
        history = await s.load_history("hot", "alice")
        assert history == [msg("hot-in"), *hot["output"]]

    run(db, body)


def test_survives_close_and_reopen(db: Path) -> None:
    async def write(s: SQLiteStore) -> None:
        await s.put_response(resp("r1"))
        await s.put_response(resp("r2", prev="r1"))
        await s.close()
        await s.close()  # idempotent
        with pytest.raises(RuntimeError):
            await s.get_response("r1", "alice")

    run(db, write)

    async def read(s: SQLiteStore) -> None:
        await s.open()  # a second open is a no-op
        assert (await s.get_response("r2", "alice") or {})["id"] == "r2"
        assert [i["id"] for i in await s.load_history("r2", "alice") or []] == ["r1-in", "r1-out", "r2-in", "r2-out"]

    run(db, read)
    run(db, read)  # reopening again re-runs no migration


def test_newer_schema_is_refused(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {len(sqlite_mod.MIGRATIONS) + 1}")

    async def main() -> None:
        store = SQLiteStore(str(db))
        with pytest.raises(RuntimeError, match="newer"):
            await store.open()
        with pytest.raises(RuntimeError, match="not open"):
            await store.get_response("x", "alice")

    asyncio.run(main())


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
items = st.lists(st.dictionaries(st.text(max_size=8), json_value, max_size=4), max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=items, outputs=items)
def test_property_put_then_history_is_inputs_then_outputs(inputs: list[Item], outputs: list[Item]) -> None:
    r = resp("r", inputs=inputs, outputs=outputs)

    async def body(s: SQLiteStore) -> list[Item] | None:
        await s.put_response(r)
        return await s.load_history("r", "alice")

    assert run(":memory:", body) == inputs + outputs
