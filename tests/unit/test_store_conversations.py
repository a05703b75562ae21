"""The ConversationStore contract and ``Store.get_items`` (router/state/store.py), on every store.

Each test taking ``backend`` runs once on SQLite and once on PostgreSQL
(tests/support/store_fixtures.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import orjson
import pytest

import router.state.postgres as postgres_mod
import router.state.sqlite as sqlite_mod
from router.state.store import Conversation
from tests.support import store_fixtures
from tests.support.store_fixtures import NOW, Backend, Postgres, SQLite, ids, msg, resp

backend, pg_dsn = store_fixtures.backend, store_fixtures.pg_dsn
sqlite_db, pg = store_fixtures.sqlite_db, store_fixtures.pg


def conv(cid: str = "conv_1", owner: str = "alice", **metadata: str) -> Conversation:
    return Conversation(id=cid, owner=owner, created_at=NOW, metadata=dict(metadata))


async def conv_ids(s: Any, cid: str = "conv_1", owner: str = "alice") -> list[str] | None:
    items = await s.load_conversation(cid, owner)
    return None if items is None else [i["id"] for i in items]


def test_create_get_update_delete(backend: Backend) -> None:
    async def body(s: Any) -> None:
        c = conv(topic="demo")
        await s.create_conversation(c, [msg("a"), msg("b", role="assistant")])
        assert await s.get_conversation("conv_1", "alice") == c
        assert await s.load_conversation("conv_1", "alice") == [msg("a"), msg("b", role="assistant")]
        updated = await s.update_conversation("conv_1", "alice", {"topic": "other", "k": "v"})
        assert updated == Conversation(id="conv_1", owner="alice", created_at=NOW, metadata={"topic": "other", "k": "v"})
        assert await s.get_conversation("conv_1", "alice") == updated
        assert await s.update_conversation("conv_1", "alice", {}) == conv()
        # An id is taken once, whoever asks again; nothing changes.
        with pytest.raises(ValueError):
            await s.create_conversation(conv(), [msg("x")])
        with pytest.raises(ValueError):
            await s.create_conversation(conv(owner="bob"), [msg("x")])
        assert await conv_ids(s) == ["a", "b"]
        assert await s.delete_conversation("conv_1", "alice") is True
        assert await s.delete_conversation("conv_1", "alice") is False
        assert await s.get_conversation("conv_1", "alice") is None
        assert await s.load_conversation("conv_1", "alice") is None
        assert await s.update_conversation("conv_1", "alice", {"k": "v"}) is None
        assert await s.add_conversation_items("conv_1", "alice", [msg("c")]) is None
        assert await s.list_conversation_items("conv_1", "alice") is None
        assert await s.get_conversation_item("conv_1", "alice", "a") is None
        assert await s.delete_conversation_item("conv_1", "alice", "a") is False
        # The id is free again.
        await s.create_conversation(conv(), [])
        assert await s.load_conversation("conv_1", "alice") == []

    backend.run(body)


def test_owner_isolation_on_every_method(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.create_conversation(conv(k="v"), [msg("a")])
        assert await s.get_conversation("conv_1", "bob") is None
        assert await s.update_conversation("conv_1", "bob", {"evil": "1"}) is None
        assert await s.add_conversation_items("conv_1", "bob", [msg("evil")]) is None
        assert await s.load_conversation("conv_1", "bob") is None
        assert await s.list_conversation_items("conv_1", "bob") is None
        assert await s.list_conversation_items("conv_1", "bob", after="zzz") is None  # unknown beats a bad after
        assert await s.get_conversation_item("conv_1", "bob", "a") is None
        assert await s.delete_conversation_item("conv_1", "bob", "a") is False
        assert await s.delete_conversation("conv_1", "bob") is False
        assert await s.get_items(["a"], "bob") == {}
        # Alice's conversation is untouched.
        assert await s.get_conversation("conv_1", "alice") == conv(k="v")
        assert await conv_ids(s) == ["a"]

    backend.run(body)


def test_add_items_appends_in_order(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.create_conversation(conv(), [msg("a"), msg("b")])
        # Each append says where its first item went: positions 0, 1 are a and b.
        assert await s.add_conversation_items("conv_1", "alice", [msg("c"), msg("d")]) == 2
        assert await s.add_conversation_items("conv_1", "alice", []) == 4
        assert await s.delete_conversation_item("conv_1", "alice", "b") is True
        assert await s.delete_conversation_item("conv_1", "alice", "b") is False
        assert await s.get_conversation_item("conv_1", "alice", "b") is None
        # After a deletion, appends still go to the end.
        assert await s.add_conversation_items("conv_1", "alice", [msg(f"e{k}") for k in range(11)]) == 4
        assert await conv_ids(s) == ["a", "c", "d", *(f"e{k}" for k in range(11))]
        assert await s.get_conversation_item("conv_1", "alice", "e10") == msg("e10")
        # An empty conversation, and one emptied, load as [].
        await s.create_conversation(conv("conv_2"), [])
        assert await s.load_conversation("conv_2", "alice") == []
        await s.add_conversation_items("conv_2", "alice", [msg("z")])
        await s.delete_conversation_item("conv_2", "alice", "z")
        assert await s.load_conversation("conv_2", "alice") == []

    backend.run(body)


def test_concurrent_appends_lose_nothing(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.create_conversation(conv(), [])
        await asyncio.gather(
            *(s.add_conversation_items("conv_1", "alice", [msg(f"t{k}-0"), msg(f"t{k}-1")]) for k in range(40))
        )
        got = await conv_ids(s)
        assert got is not None and len(got) == 80 and set(got) == {f"t{k}-{j}" for k in range(40) for j in (0, 1)}
        for k in range(40):  # each append's items stay together, in order
            assert got.index(f"t{k}-1") == got.index(f"t{k}-0") + 1

    backend.run(body)


def test_list_conversation_items_pagination(backend: Backend) -> None:
    item_ids = ["a", "b", "c", "d", "e"]

    async def body(s: Any) -> None:
        await s.create_conversation(conv(), [msg(i) for i in item_ids[:2]])
        await s.add_conversation_items("conv_1", "alice", [msg(i) for i in item_ids[2:]])

        async def page(**kw: Any) -> tuple[list[str], bool]:
            p = await s.list_conversation_items("conv_1", "alice", **kw)
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
            await s.list_conversation_items("conv_1", "alice", after="zzz")
        assert err.value.args == ("zzz",)
        with pytest.raises(ValueError):
            await s.list_conversation_items("conv_1", "alice", limit=0)
        with pytest.raises(ValueError):
            await s.list_conversation_items("conv_1", "alice", order="sideways")
        # A deleted item is no longer a valid ``after``, and the page closes over its gap.
        await s.delete_conversation_item("conv_1", "alice", "c")
        with pytest.raises(KeyError):
            await s.list_conversation_items("conv_1", "alice", after="c")
        assert await page(order="asc", after="b") == (["d", "e"], False)
        await s.create_conversation(conv("empty"), [])
        empty = await s.list_conversation_items("empty", "alice")
        assert empty is not None and (empty.data, empty.has_more) == ([], False)
        with pytest.raises(KeyError):
            await s.list_conversation_items("empty", "alice", after="a")

    backend.run(body)


def test_delete_cascades_and_leaves_responses(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.create_conversation(conv(), [msg("a"), msg("b")])
        await s.create_conversation(conv("conv_2"), [msg("x")])
        await s.put_response(resp("r1", inputs=[msg("a")], outputs=[msg("b")]))
        assert await s.delete_conversation("conv_1", "alice") is True
        assert await s.get_response("r1", "alice") is not None
        assert await s.get_items(["a", "b", "x"], "alice") == {"a": msg("a"), "b": msg("b"), "x": msg("x")}
        assert await conv_ids(s, "conv_2") == ["x"]

    backend.run(body)
    assert backend.raw_count("conversation_items") == 1  # cascade: the foreign key is enforced
    assert backend.raw_count("conversations") == 1


def test_unserializable_items_write_nothing(backend: Backend) -> None:
    bad = {"type": "message", "id": "bad", "content": {1, 2}}

    async def body(s: Any) -> None:
        with pytest.raises(TypeError):
            await s.create_conversation(conv(), [msg("a"), bad])
        assert await s.get_conversation("conv_1", "alice") is None
        await s.create_conversation(conv(), [msg("a")])
        with pytest.raises(TypeError):
            await s.add_conversation_items("conv_1", "alice", [msg("b"), bad])
        await s.add_conversation_items("conv_1", "alice", [msg("c")])
        assert await conv_ids(s) == ["a", "c"]

    backend.run(body)


# ---------------------------------------------------------------- get_items


def test_get_items_across_responses_and_conversations(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r1", inputs=[msg("in1"), msg("in2")], outputs=[msg("out1", role="assistant")]))
        await s.put_response(resp("r2", prev="r1", inputs=[msg("in3")], outputs=[]))
        await s.put_response(resp("old", inputs=[msg("expired-in")], outputs=[msg("expired-out")], expires_at=NOW))
        await s.put_response(resp("rb", owner="bob", inputs=[msg("bob-in")], outputs=[msg("bob-out")]))
        await s.create_conversation(conv(), [msg("c1")])
        await s.add_conversation_items("conv_1", "alice", [msg("c2", role="assistant")])
        await s.create_conversation(conv("conv_b", owner="bob"), [msg("bob-c")])
        wanted = ["in1", "out1", "in3", "c1", "c2", "expired-in", "expired-out", "bob-in", "bob-out", "bob-c", "nope"]
        assert await s.get_items(wanted, "alice") == {
            "in1": msg("in1"),
            "out1": msg("out1", role="assistant"),
            "in3": msg("in3"),
            "c1": msg("c1"),
            "c2": msg("c2", role="assistant"),
        }
        assert await s.get_items(wanted, "bob") == {"bob-in": msg("bob-in"), "bob-out": msg("bob-out"), "bob-c": msg("bob-c")}
        assert await s.get_items([], "alice") == {}
        assert await s.get_items(["in1", "in1"], "alice") == {"in1": msg("in1")}
        # An id kept in a response and (as a copy) in a conversation comes back once.
        await s.add_conversation_items("conv_1", "alice", [msg("in1")])
        assert await s.get_items(["in1"], "alice") == {"in1": msg("in1")}
        # A deleted response's items are gone; a deleted conversation item too.
        await s.delete_response("r2", "alice")
        await s.delete_conversation_item("conv_1", "alice", "c2")
        assert await s.get_items(["in3", "c2", "c1"], "alice") == {"c1": msg("c1")}

    backend.run(body, clock=lambda: NOW)


def test_history_from_a_response_made_in_a_conversation(backend: Backend) -> None:
    """A chain whose first response was made in a conversation starts with the conversation's items
    that response saw (as they are now: a deleted one is gone), never later ones."""
    async def body(s: Any) -> None:
        await s.create_conversation(conv(), [msg("c0"), msg("c1")])
        await s.delete_conversation_item("conv_1", "alice", "c0")
        assert await s.load_conversation_with_end("conv_1", "alice") == ([msg("c1")], 2)  # what r sees
        assert await s.load_conversation_with_end("conv_1", "bob") is None
        await s.add_conversation_items("conv_1", "alice", [msg("meanwhile")])  # while r runs
        assert await s.add_conversation_items("conv_1", "alice", [msg("r-in"), msg("r-out", role="assistant")]) == 3
        r = resp("r", inputs=[msg("r-in")], outputs=[msg("r-out", role="assistant")])
        r.conversation_id, r.conversation_position = "conv_1", 2
        await s.put_response(r)
        await s.add_conversation_items("conv_1", "alice", [msg("later")])
        await s.put_response(resp("child", prev="r"))
        assert await ids(s, "child") == ["c1", "r-in", "r-out", "child-in", "child-out"]
        assert await ids(s, "r") == ["c1", "r-in", "r-out"]
        assert await s.load_history("r", "bob") is None  # the owner's, as every chain
        await s.delete_conversation("conv_1", "alice")
        assert await ids(s, "child") == ["r-in", "r-out", "child-in", "child-out"]

    backend.run(body)


def _old_conversation_rows() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """A conversation [seed, r's input, r's output] as a router before conversation positions left it,
    with r (made in it) and f (made in it too, failed: its items never reached it)."""
    items = [(0, msg("seed")), (1, msg("r-in")), (2, msg("r-out", role="assistant"))]
    conversation_items = [("conv", k, item["id"], orjson.dumps(item)) for k, item in items]
    bodies = {"r": {"id": "r", "conversation": {"id": "conv"}, "status": "completed", "output": [msg("r-out", role="assistant")]},
              "f": {"id": "f", "conversation": {"id": "conv"}, "status": "failed", "output": []}}
    responses = [(rid, "alice", 0, b["status"], orjson.dumps(b)) for rid, b in bodies.items()]
    response_items = [("r", 0, 0, "r-in", orjson.dumps(msg("r-in"))),
                      ("r", 1, 0, "r-out", orjson.dumps(msg("r-out", role="assistant"))),
                      ("f", 0, 0, "f-in", orjson.dumps(msg("f-in")))]
    return conversation_items, responses, response_items


async def _check_old_conversation_chains(s: Any) -> None:
    assert await ids(s, "r") == ["seed", "r-in", "r-out"]  # the position its input took, found by the migration
    assert await ids(s, "f") == ["f-in"]  # nothing to find: as before
    await s.put_response(resp("child", prev="r"))
    assert await ids(s, "child") == ["seed", "r-in", "r-out", "child-in", "child-out"]


def test_sqlite_migration_finds_old_conversation_positions(sqlite_db: SQLite) -> None:
    conversation_items, responses, response_items = _old_conversation_rows()
    with sqlite3.connect(sqlite_db.path) as conn:
        for migration in sqlite_mod.MIGRATIONS[:5]:
            for statement in migration:
                conn.execute(statement)
        conn.execute("INSERT INTO conversations VALUES ('conv', 'alice', 0, x'7b7d', 3)")
        conn.executemany("INSERT INTO conversation_items VALUES (?, ?, ?, ?)", conversation_items)
        conn.executemany("INSERT INTO responses (id, owner, created_at, status, body) VALUES (?, ?, ?, ?, ?)", responses)
        conn.execute("INSERT INTO responses (id, owner, created_at, status, body) VALUES "
                     "('x', 'alice', 0, 'completed', '\"conversation\":{\"id\": not json')")
        conn.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", response_items)
        conn.execute("PRAGMA user_version = 5")
    sqlite_db.run(_check_old_conversation_chains)


def test_postgres_migration_finds_old_conversation_positions(pg: Postgres) -> None:
    conversation_items, responses, response_items = _old_conversation_rows()
    pg.fetch("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
    for n in range(3):
        for statement in postgres_mod.MIGRATIONS[n]:
            pg.fetch(statement)
        pg.fetch("INSERT INTO schema_migrations (version) VALUES ($1)", n + 1)
    pg.fetch("INSERT INTO conversations VALUES ('conv', 'alice', 0, '\\x7b7d', 3)")
    for row in conversation_items:
        pg.fetch("INSERT INTO conversation_items VALUES ($1, $2, $3, $4)", *row)
    for row in responses:
        pg.fetch("INSERT INTO responses (id, owner, created_at, status, body) VALUES ($1, $2, $3, $4, $5)", *row)
    pg.fetch("INSERT INTO responses (id, owner, created_at, status, body) VALUES "
             "('x', 'alice', 0, 'completed', convert_to('\"conversation\":{\"id\": not json', 'UTF8'))")
    for row in response_items:
        pg.fetch("INSERT INTO items VALUES ($1, $2, $3, $4, $5)", *row)
    pg.run(_check_old_conversation_chains)
