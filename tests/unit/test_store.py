"""The Store contract (router/state/store.py), run against every store.

Each test taking ``backend`` runs once on SQLite (a temp file) and once on
PostgreSQL (an empty schema in the throwaway database of tests/support/pg.py; the
server must be reachable, these tests fail otherwise). Tests named
``test_sqlite_*`` / ``test_postgres_*`` (tests/unit/test_store_engines.py) are about one
store's internals. The backends and builders are shared with tests/test_store_*.py
(tests/support/store_fixtures.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import ConfigError, StoreConfig
from router.protocol.ids import ItemIds, response_id
from router.state import make_store
from router.state.postgres import PostgresStore
from router.state.sqlite import SQLiteStore
from router.state.store import Item, Store
from tests.support import store_fixtures
from tests.support.store_fixtures import NOW, Backend, ids, msg, resp

# The shared fixtures, bound here so pytest finds them for this module's tests.
backend, pg, pg_dsn, sqlite_db = store_fixtures.backend, store_fixtures.pg, store_fixtures.pg_dsn, store_fixtures.sqlite_db

# ---------------------------------------------------------------- the contract, on every store


def test_roundtrip(backend: Backend) -> None:
    r = resp("resp_1")

    async def body(s: Store) -> None:
        await s.put_response(r)
        assert await s.get_response("resp_1", "alice") == r.body
        assert await s.get_response("nope", "alice") is None
        assert await s.load_history("nope", "alice") is None
        assert await s.list_input_items("nope", "alice") is None
        assert await s.delete_response("nope", "alice") is False

    backend.run(body)


def test_owner_isolation_on_every_method(backend: Backend) -> None:
    async def body(s: Store) -> None:
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
        assert await ids(s, "resp_a") == ["resp_a-in", "resp_a-out"]
        # A chain never crosses owners: bob's response naming alice's as previous sees only its own items.
        await s.put_response(resp("resp_b", owner="bob", prev="resp_a"))
        assert await ids(s, "resp_b", "bob") == ["resp_b-in", "resp_b-out"]
        # ... not even in the middle: alice -> bob -> alice stops at bob's hop.
        await s.put_response(resp("resp_c", prev="resp_b"))
        assert await ids(s, "resp_c") == ["resp_c-in", "resp_c-out"]

    backend.run(body)
    assert backend.raw_items("resp_a") == [(0, 0, "resp_a-in"), (1, 0, "resp_a-out")]


def test_history_order_three_hops(backend: Backend) -> None:
    async def body(s: Store) -> list[str] | None:
        # Written newest first to show order comes from the chain, not insertion.
        await s.put_response(resp("r3", prev="r2", inputs=[msg("r3-i0"), msg("r3-i1")], outputs=[msg("r3-o0")]))
        await s.put_response(resp("r2", prev="r1", inputs=[msg("r2-i0")], outputs=[msg("r2-o0"), msg("r2-o1")]))
        await s.put_response(resp("r1", inputs=[msg("r1-i0"), msg("r1-i1")], outputs=[msg("r1-o0")]))
        await s.put_response(resp("other", prev="r1"))  # a sibling branch must not leak in
        return await ids(s, "r3")

    assert backend.run(body) == [
        "r1-i0", "r1-i1", "r1-o0",
        "r2-i0", "r2-o0", "r2-o1",
        "r3-i0", "r3-i1", "r3-o0",
    ]  # fmt: skip


def test_history_orders_positions_numerically(backend: Backend) -> None:
    """Twelve items: position 10 comes after 9, not after 1."""
    inputs = [msg(f"i{k}") for k in range(12)]

    async def body(s: Store) -> list[str] | None:
        await s.put_response(resp("r", inputs=inputs, outputs=[msg(f"o{k}") for k in range(12)]))
        return await ids(s, "r")

    assert backend.run(body) == [f"i{k}" for k in range(12)] + [f"o{k}" for k in range(12)]


def test_response_without_items_has_empty_history(backend: Backend) -> None:
    async def body(s: Store) -> None:
        await s.put_response(resp("empty", inputs=[], outputs=[]))
        assert await s.load_history("empty", "alice") == []
        await s.put_response(resp("child", prev="empty"))
        assert await ids(s, "child") == ["child-in", "child-out"]
        # An item-less response in the middle of a chain does not cut it.
        await s.put_response(resp("root"))
        await s.put_response(resp("mid", prev="root", inputs=[], outputs=[]))
        await s.put_response(resp("leaf", prev="mid"))
        assert await ids(s, "leaf") == ["root-in", "root-out", "leaf-in", "leaf-out"]

    backend.run(body)


def test_thousand_long_chain(backend: Backend) -> None:
    n = 1_000

    async def body(s: Store) -> list[str] | None:
        for k in range(n):
            await s.put_response(resp(f"r{k}", prev=f"r{k - 1}" if k else None))
        return await ids(s, f"r{n - 1}")

    history = backend.run(body)
    assert history is not None and len(history) == 2 * n
    assert history[:4] == ["r0-in", "r0-out", "r1-in", "r1-out"] and history[-1] == f"r{n - 1}-out"


def test_cycle_does_not_hang(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend.module, "MAX_CHAIN_DEPTH", 50)

    async def body(s: Store) -> list[Item] | None:
        await s.put_response(resp("a"))
        await s.put_response(resp("b", prev="a"))
        await s.put_response(resp("a", prev="b"))  # a buggy upsert closes a loop
        return await s.load_history("b", "alice")

    history = backend.run(body)
    assert history is not None and len(history) == 2 * 51


def test_upsert_replaces_items(backend: Backend) -> None:
    async def body(s: Store) -> None:
        await s.put_response(
            resp("r", status="in_progress", inputs=[msg("i0"), msg("i1")], outputs=[msg("o0"), msg("o1"), msg("o2")])
        )
        final = resp("r", inputs=[msg("j0")], outputs=[msg("p0")])
        await s.put_response(final)
        assert await s.get_response("r", "alice") == final.body
        assert await ids(s, "r") == ["j0", "p0"]
        page = await s.list_input_items("r", "alice")
        assert page is not None and [i["id"] for i in page.data] == ["j0"]

    backend.run(body)
    assert backend.raw_items("r") == [(0, 0, "j0"), (1, 0, "p0")]


def test_delete_cascades_and_child_history_stops_at_gap(backend: Backend) -> None:
    async def body(s: Store) -> None:
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
        assert await ids(s, "r3") == ["r3-in", "r3-out"]
        assert await ids(s, "r1") == ["r1-in", "r1-out"]

    backend.run(body)
    assert backend.raw_items("r2") == []  # cascade: the foreign key is enforced
    assert len(backend.raw_items("r3")) == 2


def test_list_input_items_pagination(backend: Backend) -> None:
    item_ids = ["a", "b", "c", "d", "e"]

    async def body(s: Store) -> None:
        await s.put_response(resp("r", inputs=[msg(i) for i in item_ids]))

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
        assert await page(order="asc", limit=5) == (item_ids, False)
        assert await page(order="asc", limit=4) == (item_ids[:4], True)
        with pytest.raises(KeyError) as err:
            await s.list_input_items("r", "alice", after="zzz")
        assert err.value.args == ("zzz",)
        with pytest.raises(KeyError):  # an output item's id is not an input item
            await s.list_input_items("r", "alice", after="r-out")
        with pytest.raises(ValueError):
            await s.list_input_items("r", "alice", limit=0)
        with pytest.raises(ValueError):
            await s.list_input_items("r", "alice", order="sideways")  # type: ignore[arg-type]
        # Unknown beats a bad ``after``: another owner learns nothing.
        assert await s.list_input_items("r", "bob", after="zzz") is None
        await s.put_response(resp("none", inputs=[]))
        empty = await s.list_input_items("none", "alice")
        assert empty is not None and (empty.data, empty.has_more) == ([], False)
        with pytest.raises(KeyError):
            await s.list_input_items("none", "alice", after="a")

    backend.run(body)


def test_unserializable_item_writes_nothing(backend: Backend) -> None:
    old = resp("r", inputs=[msg("i0")], outputs=[msg("o0")])
    bad = resp("r", inputs=[msg("j0")], outputs=[msg("p0"), {"type": "message", "id": "x", "content": {1, 2}}])

    async def body(s: Store) -> None:
        await s.put_response(old)
        with pytest.raises(TypeError):  # orjson.JSONEncodeError is a TypeError
            await s.put_response(bad)
        assert await s.get_response("r", "alice") == old.body
        assert await ids(s, "r") == ["i0", "o0"]

    backend.run(body)
    assert backend.raw_items("r") == [(0, 0, "i0"), (1, 0, "o0")]


def test_concurrent_puts(backend: Backend) -> None:
    async def body(s: Store) -> None:
        distinct = [resp(f"r{k}", inputs=[msg(f"r{k}-i{j}") for j in range(3)]) for k in range(100)]
        # Many versions of one response racing: the winner must be whole, never a mix.
        versions = [resp("hot", outputs=[msg(f"v{v}-o{j}") for j in range(v % 4 + 1)]) for v in range(50)]
        await asyncio.gather(
            *(s.put_response(r) for r in distinct + versions),
            *(s.load_history(f"r{k}", "alice") for k in range(100)),
        )
        for r in distinct:
            assert await s.get_response(r.id, "alice") == r.body
            assert await ids(s, r.id) == [*(f"{r.id}-i{j}" for j in range(3)), f"{r.id}-out"]
        hot = await s.get_response("hot", "alice")
        assert hot is not None
        assert await s.load_history("hot", "alice") == [msg("hot-in"), *hot["output"]]

    backend.run(body)


def test_survives_close_and_reopen(backend: Backend) -> None:
    async def write(s: Store) -> None:
        await s.put_response(resp("r1"))
        await s.put_response(resp("r2", prev="r1"))
        await s.close()
        await s.close()  # idempotent
        with pytest.raises(RuntimeError):
            await s.get_response("r1", "alice")

    backend.run(write)

    async def read(s: Store) -> None:
        await s.open()  # a second open is a no-op
        assert (await s.get_response("r2", "alice") or {})["id"] == "r2"
        assert await ids(s, "r2") == ["r1-in", "r1-out", "r2-in", "r2-out"]

    backend.run(read)
    backend.run(read)  # reopening again re-runs no migration


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


@settings(
    max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(inputs=items, outputs=items)
def test_property_put_then_history_is_inputs_then_outputs(
    backend: Backend, inputs: list[Item], outputs: list[Item]
) -> None:
    """Any JSON round-trips exactly (NUL characters, huge ints, float precision), in order.

    The backend is shared by the examples: each one overwrites response "r".
    """
    r = resp("r", inputs=inputs, outputs=outputs)

    async def body(s: Store) -> tuple[list[Item] | None, dict[str, Any] | None]:
        await s.put_response(r)
        return await s.load_history("r", "alice"), await s.get_response("r", "alice")

    assert backend.run(body) == (inputs + outputs, r.body)


def test_items_named_after_their_response_are_found_by_id(backend: Backend) -> None:
    """Items named by their response's ``ItemIds`` (most items: the output, input the client left
    unnamed) are found by id as any other, by their owner only, while the response lives. On
    SQLite they have no ``item_ids`` rows: the response's row is found from the id."""
    first, second = response_id(), response_id()
    a, b = ItemIds(first), ItemIds(second)
    asked, answered, never_stored = a("msg"), a("msg"), a("msg")
    echoed, own = msg(answered, "a", role="assistant"), b("msg")  # the answer, sent back as input by the client
    r1 = resp(first, inputs=[msg(asked, "q")], outputs=[dict(echoed)])
    r2 = resp(second, inputs=[echoed, msg("client-named", "c")], outputs=[msg(own, "d", role="assistant")])

    async def body(s: Store) -> None:
        await s.put_response(r1)
        await s.put_response(r2)
        found = await s.get_items([asked, answered, own, never_stored, "client-named"], "alice")
        assert found == {asked: r1.input_items[0], answered: echoed, own: r2.body["output"][0],
                         "client-named": r2.input_items[1]}
        assert await s.get_items([asked, answered, own], "bob") == {}
        assert await s.delete_response(first, "alice")
        # The echo is second's own input item, under another response's id: it is indexed, and stays.
        assert await s.get_items([asked, answered], "alice") == {answered: echoed}

    backend.run(body)
    if backend.kind == "sqlite":
        assert backend.query("SELECT item_id, response_id FROM item_ids ORDER BY item_id") == sorted(
            [(answered, second), ("client-named", second)])
    backend.raw_items(second)  # and the ids SQLite keeps rows for are exactly the others


def test_items_named_after_an_expired_response_are_not_found(backend: Backend) -> None:
    rid = response_id()
    named = ItemIds(rid)("msg")

    async def body(s: Store) -> None:
        await s.put_response(resp(rid, inputs=[msg(named)], expires_at=NOW - 1))
        assert await s.get_items([named], "alice") == {}

    backend.run(body, clock=lambda: NOW)


# ---------------------------------------------------------------- retention


def test_expired_response_is_not_found(backend: Backend) -> None:
    async def body(s: Store) -> None:
        await s.put_response(resp("past", expires_at=NOW - 1))
        await s.put_response(resp("edge", expires_at=NOW))  # expires_at <= now: gone
        await s.put_response(resp("future", expires_at=NOW + 1))
        await s.put_response(resp("forever"))
        for rid in ("past", "edge"):
            assert await s.get_response(rid, "alice") is None
            assert await s.load_history(rid, "alice") is None
            assert await s.list_input_items(rid, "alice") is None
            assert await s.list_input_items(rid, "alice", after="nope") is None
        for rid in ("future", "forever"):
            assert (await s.get_response(rid, "alice") or {})["id"] == rid
            assert await ids(s, rid) == [f"{rid}-in", f"{rid}-out"]
        # Ids stay unique while an expired response waits for the purge.
        with pytest.raises(PermissionError):
            await s.put_response(resp("past", owner="bob"))
        # Its owner may write it again, with a new expiry: it is back.
        await s.put_response(resp("past", expires_at=NOW + 60, outputs=[msg("again")]))
        assert await ids(s, "past") == ["past-in", "again"]

    backend.run(body, clock=lambda: NOW + 0.5)


def test_chain_stops_at_an_expired_hop(backend: Backend) -> None:
    async def body(s: Store) -> None:
        await s.put_response(resp("r1"))
        await s.put_response(resp("r2", prev="r1", expires_at=NOW - 10))
        await s.put_response(resp("r3", prev="r2", expires_at=NOW + 10))
        await s.put_response(resp("r4", prev="r3"))
        assert await ids(s, "r4") == ["r3-in", "r3-out", "r4-in", "r4-out"]
        assert await ids(s, "r1") == ["r1-in", "r1-out"]

    backend.run(body, clock=lambda: NOW)
    # Later r3 expires too: r4 stands alone.
    assert backend.run(lambda s: ids(s, "r4"), clock=lambda: NOW + 10) == ["r4-in", "r4-out"]


def test_delete_of_an_expired_response(backend: Backend) -> None:
    async def body(s: Store) -> None:
        await s.put_response(resp("old", expires_at=NOW - 1))
        assert await s.delete_response("old", "bob") is False
        assert await s.delete_response("old", "alice") is False  # already gone for the caller...

    backend.run(body, clock=lambda: NOW)
    assert backend.raw_items("old") == []  # ... and now gone from the disk too


def test_purge_expired(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend.module, "PURGE_BATCH", 3)  # several batches

    async def body(s: Store) -> None:
        for k in range(10):  # two owners, one chain, expiring at NOW - 9 .. NOW
            owner = "alice" if k % 2 else "bob"
            await s.put_response(resp(f"x{k}", owner=owner, prev=f"x{k - 2}" if k > 1 else None, expires_at=NOW - k))
        await s.put_response(resp("later", expires_at=NOW + 1))
        await s.put_response(resp("forever", prev="x9"))
        assert await s.purge_expired(NOW - 8) == 2  # x9, x8
        assert await s.purge_expired(NOW) == 8
        assert await s.purge_expired(NOW) == 0
        assert await ids(s, "forever") == ["forever-in", "forever-out"]
        assert await s.purge_expired(NOW + 1) == 1
        assert (await s.get_response("forever", "alice") or {})["id"] == "forever"

    backend.run(body, clock=lambda: 0)  # reads see nothing expired: only the purge's ``now`` counts
    assert backend.raw_count("responses") == 1
    assert backend.raw_count("items") == 2


# ---------------------------------------------------------------- configuration


def test_make_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sqlite_store = make_store(StoreConfig(path="var/nested/r.db"), tmp_path)
    assert isinstance(sqlite_store, SQLiteStore) and sqlite_store.path == str(tmp_path / "var/nested/r.db")
    assert (tmp_path / "var/nested").is_dir()
    assert isinstance(memory := make_store(StoreConfig(path=":memory:"), tmp_path), SQLiteStore)
    assert memory.path == ":memory:"

    config = StoreConfig(kind="postgres", dsn_env="RR_TEST_DSN", pool_min=2, pool_max=5, ttl_s=3600)
    with pytest.raises(ConfigError, match="RR_TEST_DSN"):
        make_store(config, tmp_path)
    monkeypatch.setenv("RR_TEST_DSN", "postgresql://u@h/db")
    pg_store = make_store(config, tmp_path)
    assert isinstance(pg_store, PostgresStore)
    assert (pg_store.dsn, pg_store.min_size, pg_store.max_size) == ("postgresql://u@h/db", 2, 5)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "postgres"},
        {"kind": "postgres", "dsn": "postgresql://h/db", "dsn_env": "X"},
        {"dsn": "postgresql://h/db"},
        {"kind": "postgres", "dsn": "postgresql://h/db", "pool_min": 4, "pool_max": 2},
        {"ttl_s": 0},
        {"kind": "mysql"},
    ],
)
def test_store_config_refuses(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StoreConfig(**fields)


def test_concurrent_puts_fail_alone(backend: Backend) -> None:
    """Puts that are committed together (SQLite's group commit) still succeed or fail one by one."""

    async def body(s: Store) -> None:
        await s.put_response(resp("taken", owner="bob"))
        puts = [s.put_response(resp(f"r{i}")) for i in range(8)] + [s.put_response(resp("taken"))]
        results = await asyncio.gather(*puts, return_exceptions=True)
        assert results[:8] == [None] * 8
        assert isinstance(results[8], PermissionError)
        for i in range(8):
            assert await s.get_response(f"r{i}", "alice") is not None
        assert await s.get_response("taken", "bob") is not None and await s.get_response("taken", "alice") is None

    backend.run(body)
