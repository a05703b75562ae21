"""The BackgroundStore contract (router/state/store.py): event logs, leases, cancel requests,
abandoned responses; plus the schema upgrades that brought them. On every store.

Each test taking ``backend`` runs once on SQLite and once on PostgreSQL
(tests/support/store_fixtures.py).
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
from dataclasses import replace
from typing import Any

import pytest

import router.state.postgres as postgres_mod
import router.state.sqlite as sqlite_mod
from router.protocol.replay import output_of
from router.state import postgres_background, sqlite_background
from router.state.store import Conversation, ResponseDeleted, ResponseInProgress
from tests.support import store_fixtures
from tests.support.store_fixtures import NOW, Backend, Postgres, SQLite, ids, msg, resp

backend, pg, pg_dsn, sqlite_db = store_fixtures.backend, store_fixtures.pg, store_fixtures.pg_dsn, store_fixtures.sqlite_db

ERROR = {"code": "server_error", "message": "the replica running this response went away"}


def ev(seq: int, kind: str = "response.output_text.delta") -> dict[str, Any]:
    return {"type": kind, "sequence_number": seq, "delta": f"d{seq}"}


def seqs(events: list[dict[str, Any]] | None) -> list[int] | None:
    return None if events is None else [e["sequence_number"] for e in events]


def lease(backend: Backend, rid: str) -> tuple[Any, ...]:
    """(status, lease_holder, lease_until, cancel_requested) as stored."""
    rows = backend.query(f"SELECT status, lease_holder, lease_until, cancel_requested FROM responses WHERE id = '{rid}'")
    status, holder, until, cancel = rows[0]
    return status, holder, until, bool(cancel)


# ---------------------------------------------------------------- event log


def test_events_after_limit_order(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r", status="in_progress", lease_holder="h", lease_until=NOW + 60))
        assert await s.read_events("r", "alice") == []
        await s.append_events("r", [ev(0, "response.created"), ev(1), ev(2)])
        await s.append_events("r", [])
        await s.append_events("r", [ev(k) for k in range(3, 12)])
        assert await s.read_events("r", "alice") == [ev(0, "response.created"), ev(1), *(ev(k) for k in range(2, 12))]
        assert seqs(await s.read_events("r", "alice", after=9)) == [10, 11]  # 10 after 9, numerically
        assert seqs(await s.read_events("r", "alice", after=2, limit=3)) == [3, 4, 5]
        assert seqs(await s.read_events("r", "alice", limit=1)) == [0]
        assert await s.read_events("r", "alice", after=11) == []
        with pytest.raises(ValueError):
            await s.read_events("r", "alice", limit=0)
        # Unknown, another owner's: None.
        assert await s.read_events("nope", "alice") is None
        assert await s.read_events("r", "bob") is None
        assert await s.read_events("r", "bob", after=100) is None
        # The response re-putting itself (items replaced) keeps its log.
        await s.put_response(resp("r", status="completed", outputs=[msg("final")]))
        assert seqs(await s.read_events("r", "alice", after=10)) == [11]

    backend.run(body, clock=lambda: NOW)


def test_append_events_is_atomic(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r", status="in_progress"))
        await s.append_events("r", [ev(0), ev(1)])
        with pytest.raises(ValueError):  # 1 is already there: none of the three is written
            await s.append_events("r", [ev(2), ev(1), ev(3)])
        with pytest.raises(ValueError):  # twice in one batch
            await s.append_events("r", [ev(2), ev(2)])
        with pytest.raises(ValueError):
            await s.append_events("r", [ev(2), {"type": "response.completed"}])
        with pytest.raises(TypeError):
            await s.append_events("r", [ev(2), {"type": "x", "sequence_number": 3, "bad": {1, 2}}])
        with pytest.raises(KeyError):
            await s.append_events("nope", [ev(0)])
        assert seqs(await s.read_events("r", "alice")) == [0, 1]
        await s.append_events("r", [ev(2)])  # the store is still usable
        assert seqs(await s.read_events("r", "alice")) == [0, 1, 2]

    backend.run(body)
    assert backend.raw_count("response_events") == 3


def test_events_go_with_their_response(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("keep"))
        await s.put_response(resp("gone"))
        await s.put_response(resp("old", expires_at=NOW - 1))
        for rid in ("keep", "gone", "old"):
            await s.append_events(rid, [ev(0), ev(1)])
        assert await s.read_events("old", "alice") is None  # expired: not found, like every read
        assert await s.delete_response("gone", "alice") is True
        with pytest.raises(KeyError):
            await s.append_events("gone", [ev(2)])
        assert await s.read_events("gone", "alice") is None
        assert await s.purge_expired(NOW) == 1
        assert seqs(await s.read_events("keep", "alice")) == [0, 1]

    backend.run(body, clock=lambda: NOW)
    assert backend.query("SELECT DISTINCT response_id FROM response_events") == [("keep",)]


# ---------------------------------------------------------------- leases and cancel requests


def test_renew_leases_only_by_holder(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("a", status="in_progress", lease_holder="h1", lease_until=100.0))
        await s.put_response(resp("b", status="in_progress", lease_holder="h2", lease_until=100.0))
        await s.put_response(resp("c", status="queued"))  # no lease
        await s.renew_leases(["a", "b", "c", "nope"], "h1", 200.5)
        await s.renew_leases([], "h1", 300.0)

    backend.run(body)
    assert lease(backend, "a") == ("in_progress", "h1", 200.5, False)
    assert lease(backend, "b") == ("in_progress", "h2", 100.0, False)
    assert lease(backend, "c") == ("queued", None, None, False)


def test_put_response_writes_the_lease(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r", status="queued", lease_holder="h1", lease_until=100.0))
        await s.renew_leases(["r"], "h1", 200.0)

    backend.run(body)

    # The holder re-puts with the lease it built the response with: the renewal is kept.
    backend.run(lambda s: s.put_response(resp("r", status="in_progress", lease_holder="h1", lease_until=100.0)))
    assert lease(backend, "r") == ("in_progress", "h1", 200.0, False)
    # ... and a later one of its own wins.
    backend.run(lambda s: s.put_response(resp("r", status="in_progress", lease_holder="h1", lease_until=250.0)))
    assert lease(backend, "r") == ("in_progress", "h1", 250.0, False)
    # Another replica taking it over writes its own lease, even a shorter one.
    backend.run(lambda s: s.put_response(resp("r", status="in_progress", lease_holder="h2", lease_until=150.0)))
    assert lease(backend, "r") == ("in_progress", "h2", 150.0, False)
    # The final put lets go of it.
    backend.run(lambda s: s.put_response(resp("r")))
    assert lease(backend, "r") == ("completed", None, None, False)

    async def check_body(s: Any) -> None:
        got = await s.get_response("r", "alice")
        assert got is not None and not {"lease_holder", "lease_until", "cancel_requested"} & set(got)

    backend.run(check_body)


def test_cancel_requests(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r", status="in_progress", lease_holder="h", lease_until=NOW + 60))
        await s.put_response(resp("other", status="in_progress", lease_holder="h", lease_until=NOW + 60))
        await s.put_response(resp("old", status="in_progress", expires_at=NOW))
        assert await s.cancel_requested(["r", "other"]) == set()
        assert await s.request_cancel("r", "bob") is False
        assert await s.request_cancel("nope", "alice") is False
        assert await s.request_cancel("old", "alice") is False  # expired: not found
        assert await s.cancel_requested(["r", "other", "old"]) == set()
        assert await s.request_cancel("r", "alice") is True
        assert await s.request_cancel("r", "alice") is True  # asking twice is fine
        assert await s.cancel_requested(["r", "other", "nope"]) == {"r", "nope"}  # nope: not stored, must stop
        assert await s.cancel_requested([]) == set()
        # The running response keeps re-putting itself: the request survives.
        await s.put_response(resp("r", status="in_progress", lease_holder="h", lease_until=NOW + 90, outputs=[msg("p")]))
        assert await s.cancel_requested(["r"]) == {"r"}
        got = await s.get_response("r", "alice")
        assert got is not None and got["status"] == "in_progress" and "cancel_requested" not in got
        # A deleted response must stop (its run polls this); written again under that id, it starts clean.
        await s.delete_response("r", "alice")
        assert await s.cancel_requested(["r"]) == {"r"}
        await s.put_response(resp("r", status="queued", lease_holder="h", lease_until=NOW + 60))
        assert await s.cancel_requested(["r"]) == set()

    backend.run(body, clock=lambda: NOW)


def test_history_from_an_unfinished_response_is_refused(backend: Backend) -> None:
    """A turn on a background response still running would miss its output: ResponseInProgress.
    Once it has finished, the chain loads as usual; an unfinished ancestor does not matter."""
    async def body(s: Any) -> None:
        await s.put_response(resp("done"))
        for status in ("queued", "in_progress"):
            await s.put_response(resp("run", prev="done", status=status, lease_holder="h", lease_until=NOW + 60))
            with pytest.raises(ResponseInProgress):
                await s.load_history("run", "alice")
        await s.put_response(resp("run", prev="done", outputs=[msg("answer", role="assistant")]))
        assert await ids(s, "run") == ["done-in", "done-out", "run-in", "answer"]
        assert await s.load_history("run", "bob") is None  # another owner's: not found, as ever

    backend.run(body, clock=lambda: NOW)


def test_a_put_of_an_existing_response_never_brings_a_deleted_one_back(backend: Backend) -> None:
    """A background run writes its progress with ``existing``: once the response is deleted, its
    puts raise ResponseDeleted and write nothing (the row, its items, its events stay gone)."""
    async def body(s: Any) -> None:
        running = resp("r", status="in_progress", lease_holder="h", lease_until=NOW + 60)
        await s.put_response(running)
        done = replace(resp("r", outputs=[msg("answer", role="assistant")]), existing=True)
        await s.put_response(done)  # there: replaced as usual
        assert (await s.get_response("r", "alice"))["status"] == "completed"
        assert await s.delete_response("r", "alice") is True
        with pytest.raises(ResponseDeleted):
            await s.put_response(done)
        assert await s.get_response("r", "alice") is None and await s.load_history("r", "alice") is None
        with pytest.raises(ResponseDeleted):  # never stored at all: the same
            await s.put_response(replace(resp("new"), existing=True))
        assert await s.get_response("new", "alice") is None

    backend.run(body, clock=lambda: NOW)


# ---------------------------------------------------------------- abandoned responses


def test_fail_abandoned(backend: Backend) -> None:
    now = NOW + 0.5

    async def body(s: Any) -> None:
        await s.put_response(resp("queued-unleased", status="queued"))
        await s.put_response(resp("running-unleased", status="in_progress"))
        await s.put_response(resp("queued-lapsed", status="queued", lease_holder="h", lease_until=NOW))
        await s.put_response(resp("running-lapsed", status="in_progress", lease_holder="h", lease_until=NOW + 0.25))
        await s.put_response(resp("running-edge", status="in_progress", lease_holder="h", lease_until=now))  # not before now
        await s.put_response(resp("running-live", status="in_progress", lease_holder="h", lease_until=NOW + 30))
        await s.put_response(resp("queued-live", status="queued", lease_holder="h", lease_until=NOW + 30))
        await s.put_response(resp("done", status="completed", lease_holder="h", lease_until=NOW - 100))
        await s.put_response(resp("done-unleased"))
        await s.put_response(resp("cancelled", status="cancelled"))
        await s.put_response(resp("failed", status="failed"))
        await s.put_response(resp("incomplete", status="incomplete", lease_holder="h", lease_until=NOW - 1))
        await s.append_events("running-lapsed", [ev(0)])

        failed = await s.fail_abandoned(now, ERROR)
        assert sorted(failed) == ["queued-lapsed", "queued-unleased", "running-lapsed", "running-unleased"]
        assert await s.fail_abandoned(now, ERROR) == []  # each one once
        for rid in failed:
            before = resp(rid).body
            assert await s.get_response(rid, "alice") == {**before, "status": "failed", "error": ERROR}
            assert await ids(s, rid) == [f"{rid}-in", f"{rid}-out"]  # items untouched
        for rid in ("running-edge", "running-live", "queued-live"):
            got = await s.get_response(rid, "alice")
            assert got is not None and got["status"] != "failed" and "error" not in got
        for rid in ("done", "done-unleased", "cancelled", "failed", "incomplete"):
            assert await s.get_response(rid, "alice") == resp(rid, status=rid if rid in ("cancelled", "failed", "incomplete") else "completed").body
        assert seqs(await s.read_events("running-lapsed", "alice")) == [0]
        # Later the live leases lapse too (nobody renewed them).
        assert sorted(await s.fail_abandoned(NOW + 31, ERROR)) == ["queued-live", "running-edge", "running-live"]

    backend.run(body, clock=lambda: NOW)
    assert lease(backend, "running-lapsed") == ("failed", None, None, False)  # the lease is let go
    assert lease(backend, "running-live") == ("failed", None, None, False)
    assert lease(backend, "done") == ("completed", "h", NOW - 100, False)
    n = backend.query("SELECT count(*) FROM responses WHERE status = 'failed'")[0][0]
    assert n == 8


def test_fail_abandoned_in_batches(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    module = sqlite_background if backend.kind == "sqlite" else postgres_background
    monkeypatch.setattr(module, "FAIL_BATCH", 3)

    async def body(s: Any) -> None:
        for k in range(10):
            await s.put_response(resp(f"r{k}", status="in_progress", lease_holder="h", lease_until=NOW - k))
        await s.put_response(resp("live", status="in_progress", lease_holder="h", lease_until=NOW + 1))
        assert sorted(await s.fail_abandoned(NOW, ERROR)) == sorted(f"r{k}" for k in range(1, 10))
        assert await s.fail_abandoned(NOW + 0.5, ERROR) == ["r0"]
        assert await s.fail_abandoned(NOW + 0.5, ERROR) == []
        # A sweep at start-up of the only replica: every unfinished response, however long its lease.
        await s.put_response(resp("far", status="queued", lease_holder="h", lease_until=1e300))
        assert sorted(await s.fail_abandoned(math.inf, ERROR)) == ["far", "live"]

    backend.run(body)


def test_fail_abandoned_refuses_an_unserializable_error(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r", status="queued"))
        with pytest.raises(TypeError):
            await s.fail_abandoned(NOW, {"bad": {1, 2}})
        assert (await s.get_response("r", "alice") or {})["status"] == "queued"

    backend.run(body)


def test_postgres_replicas_fail_each_response_once(pg: Postgres, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas sweeping at once (small batches, so they interleave): every abandoned response
    is failed by exactly one of them, and the live ones by neither."""
    monkeypatch.setattr(postgres_background, "FAIL_BATCH", 7)
    n = 300

    async def main() -> None:
        stores = [pg.store(), pg.store()]
        await asyncio.gather(*(s.open() for s in stores))
        try:
            await asyncio.gather(
                *(
                    stores[k % 2].put_response(resp(f"r{k}", status="in_progress", lease_holder="h", lease_until=NOW - 1))
                    for k in range(n)
                )
            )
            await stores[0].put_response(resp("live", status="in_progress", lease_holder="h", lease_until=NOW + 60))
            for _ in range(3):  # several rounds, each from a fresh start
                results = await asyncio.gather(*(s.fail_abandoned(NOW, ERROR) for s in stores for _ in range(2)))
                all_ids = [rid for result in results for rid in result]
                assert len(all_ids) == len(set(all_ids)) == n
                assert set(all_ids) == {f"r{k}" for k in range(n)}
                await asyncio.gather(
                    *(
                        stores[k % 2].put_response(
                            resp(f"r{k}", status="in_progress", lease_holder="h", lease_until=NOW - 1)
                        )
                        for k in range(n)
                    )
                )
            got = await stores[1].get_response("r7", "alice")
            assert got is not None and got["status"] == "in_progress"
        finally:
            await asyncio.gather(*(s.close() for s in stores))

    asyncio.run(main())
    assert pg.fetch("SELECT status FROM responses WHERE id = 'live'") == [("in_progress",)]


# ---------------------------------------------------------------- schema upgrades in place


def test_sqlite_upgrades_a_v2_file(sqlite_db: SQLite) -> None:
    """A file from before conversations and background responses: data kept, new features work on it."""
    with sqlite3.connect(sqlite_db.path) as conn:
        for statement in sqlite_mod.MIGRATIONS[0] + sqlite_mod.MIGRATIONS[1]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO responses VALUES ('r', 'alice', NULL, 0, 'in_progress', '{\"id\":\"r\",\"status\":\"in_progress\"}', NULL)"
        )
        conn.execute("INSERT INTO items VALUES ('r', 0, 0, 'i0', '{\"id\":\"i0\"}')")
        conn.execute("PRAGMA user_version = 2")

    async def body(s: Any) -> None:
        assert await s.get_items(["i0"], "alice") == {"i0": {"id": "i0"}}
        assert await s.cancel_requested(["r"]) == set()
        assert await s.request_cancel("r", "alice") is True
        await s.append_events("r", [ev(0)])
        assert seqs(await s.read_events("r", "alice")) == [0]
        await s.create_conversation(Conversation(id="c", owner="alice", created_at=0), [msg("m")])
        assert await s.load_conversation("c", "alice") == [msg("m")]
        assert await s.fail_abandoned(NOW, ERROR) == ["r"]  # an old row has no lease

    sqlite_db.run(body)
    with sqlite3.connect(sqlite_db.path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(sqlite_mod.MIGRATIONS)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def test_postgres_upgrades_a_v1_database(pg: Postgres) -> None:
    """A database from before conversations and background responses: data kept, new features work on it."""
    statements = [
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        *postgres_mod.MIGRATIONS[0],
        "INSERT INTO schema_migrations (version) VALUES (1)",
        (
            "INSERT INTO responses (id, owner, created_at, status, body)"
            " VALUES ('r', 'alice', 0, 'queued', convert_to('{\"id\":\"r\",\"status\":\"queued\"}', 'UTF8'))"
        ),
        "INSERT INTO items VALUES ('r', 0, 0, 'i0', convert_to('{\"id\":\"i0\"}', 'UTF8'))",
    ]
    for statement in statements:
        pg.fetch(statement)

    async def body(s: Any) -> None:
        assert await s.get_items(["i0"], "alice") == {"i0": {"id": "i0"}}
        assert await s.request_cancel("r", "alice") is True
        assert await s.cancel_requested(["r"]) == {"r"}
        await s.append_events("r", [ev(0)])
        assert seqs(await s.read_events("r", "alice")) == [0]
        await s.create_conversation(Conversation(id="c", owner="alice", created_at=0), [msg("m")])
        assert await s.load_conversation("c", "alice") == [msg("m")]
        assert await s.fail_abandoned(NOW, ERROR) == ["r"]
        assert (await s.get_response("r", "alice") or {}).get("error") == ERROR

    pg.run(body)
    versions = [v for (v,) in pg.fetch("SELECT version FROM schema_migrations ORDER BY version")]
    assert versions == list(range(1, len(postgres_mod.MIGRATIONS) + 1))


def test_fail_abandoned_keeps_what_the_event_log_says_was_produced(backend: Backend) -> None:
    """A run that died after logging part of its answer: the failed response holds that part (its
    message incomplete), as the log replays it, not the empty output it was put with."""
    message = {"type": "message", "id": "msg_a", "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    log = [
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": message},
        {"type": "response.content_part.added", "sequence_number": 3, "output_index": 0, "content_index": 0,
         "item_id": "msg_a", "part": part},
        *({"type": "response.output_text.delta", "sequence_number": 4 + k, "output_index": 0, "content_index": 0,
           "item_id": "msg_a", "delta": word, "logprobs": []} for k, word in enumerate(["half", " an", " answer"])),
    ]

    async def body(s: Any) -> None:
        for rid in ("died", "silent"):
            await s.put_response(resp(rid, status="in_progress", inputs=[msg(f"{rid}-in")], outputs=[],
                                      lease_holder="h", lease_until=NOW - 1))
        await s.append_events("died", log)
        assert sorted(await s.fail_abandoned(NOW, ERROR, output_of)) == ["died", "silent"]
        died = await s.get_response("died", "alice") or {}
        assert died["status"] == "failed" and died["error"] == ERROR
        assert died["output"] == [{**message, "status": "incomplete",
                                   "content": [{**part, "text": "half an answer"}]}]
        assert await ids(s, "died") == ["died-in", "msg_a"]
        assert await s.get_items(["msg_a"], "alice") == {"msg_a": died["output"][0]}
        assert (await s.get_response("silent", "alice") or {})["output"] == []  # nothing logged: as it was

    backend.run(body)
    assert backend.raw_items("died") == [(0, 0, "died-in"), (1, 0, "msg_a")]
