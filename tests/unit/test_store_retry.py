"""The PostgreSQL store across a server restart and outage (a server of the test's own, tests/support/pg.py
``PgServer``), and its retried writes when an attempt's answer is lost after its COMMIT.

Calls ride out a restart; past ``retry_s`` they raise StoreUnavailable, and work again once the
server is back. A retried write has the effect of one write: an append (events, conversation
items) or a conversation create whose COMMIT went through but whose answer was lost with the
connection is found done by the next attempt, not written twice nor refused as a duplicate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from router.state.postgres import PostgresStore
from router.state.store import Conversation, StoreUnavailable
from tests.support import store_fixtures
from tests.support.pg import PgServer, pg_server  # noqa: F401 - the fixture
from tests.support.store_fixtures import Postgres, msg, resp
from tests.support.waits import async_wait_until

pg, pg_dsn = store_fixtures.pg, store_fixtures.pg_dsn


def on(server: PgServer, body: Callable[[PostgresStore], Awaitable[Any]], retry_s: float) -> Any:
    async def main() -> Any:
        store = PostgresStore(server.dsn, min_size=2, max_size=8, retry_s=retry_s)
        await store.open()
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def test_calls_ride_out_a_restart(pg_server: PgServer) -> None:  # noqa: F811
    """Puts and reads keep going while the server restarts (every session ended): none fails
    (those on connections the restart broke run again on new ones), and every put is there after."""

    async def body(store: PostgresStore) -> None:
        done: list[str] = []
        stop = asyncio.Event()

        written = [0] * 6  # each writer's puts so far

        async def writer(k: int) -> None:
            n = 0
            while not stop.is_set():
                rid = f"r{k}-{n}"
                await store.put_response(resp(rid))
                assert (await store.get_response(rid, "alice"))["id"] == rid
                done.append(rid)
                n += 1
                written[k] = n

        writers = [asyncio.create_task(writer(k)) for k in range(6)]

        def failed() -> bool:  # a writer ended: its error is raised by the gather below
            return any(w.done() for w in writers)

        await async_wait_until(lambda: failed() or all(written), 30, "a put and a read by every writer", interval=0.01)
        before = len(done)
        await asyncio.to_thread(pg_server.restart)
        at_restart = list(written)
        await async_wait_until(lambda: failed() or all(now > then for now, then in zip(written, at_restart, strict=True)),
                               30, "a put and a read by every writer after the restart", interval=0.01)
        stop.set()
        await asyncio.gather(*writers)  # any error of theirs fails the test here
        assert len(done) > before
        assert store.reachable_s() > 0
        await store.ping()
        for rid in done:
            assert await store.get_response(rid, "alice") is not None

    on(pg_server, body, retry_s=30)


def test_past_the_budget_calls_raise_store_unavailable_then_work_again(pg_server: PgServer) -> None:  # noqa: F811
    async def body(store: PostgresStore) -> None:
        await store.put_response(resp("before"))
        await asyncio.to_thread(pg_server.stop)
        with pytest.raises(StoreUnavailable) as raised:
            await store.put_response(resp("during"))
        assert raised.value.status == 503 and raised.value.code == "store_unavailable"
        with pytest.raises(StoreUnavailable):
            await store.get_response("before", "alice")
        with pytest.raises(StoreUnavailable):
            await store.ping()
        assert store.reachable_s() == 0.0
        await asyncio.to_thread(pg_server.start)
        await store.put_response(resp("after"))
        assert await store.get_response("before", "alice") is not None
        assert await store.get_response("after", "alice") is not None
        assert await store.get_response("during", "alice") is None
        assert 0.0 <= store.reachable_s() < float("inf")

    on(pg_server, body, retry_s=0.5)


def test_the_sweep_is_never_retried(pg_server: PgServer) -> None:  # noqa: F811
    """``fail_abandoned`` on a server that is down raises at once, whatever the budget: the
    sweep must not run the moment the server is back, before the holders renew their leases."""

    async def body(store: PostgresStore) -> None:
        await asyncio.to_thread(pg_server.stop)
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.fail_abandoned(0.0, {"code": "x", "message": "y"}), 60)
        await asyncio.to_thread(pg_server.start)

    on(pg_server, body, retry_s=600)


class _LostAnswer:
    """Stands in for the store's pool: the first statement (or transaction) that ``hit`` picks runs
    and commits, then fails as a connection that broke before its answer came back."""

    def __init__(self, pool: asyncpg.Pool, hit: Callable[[str], bool]) -> None:
        self._real = pool
        self._hit = hit
        self.lost = 0

    def _lose(self, query: str) -> bool:
        if self.lost == 0 and self._hit(query):
            self.lost += 1
            return True
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def execute(self, query: str, *args: Any) -> str:
        status = await self._real.execute(query, *args)
        if self._lose(query):
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
        return status

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        async with self._real.acquire() as conn:
            yield _Conn(conn, self)


class _Conn:
    def __init__(self, conn: Any, pool: _LostAnswer) -> None:
        self._conn = conn
        self._pool = pool
        self._queries: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def fetchval(self, query: str, *args: Any) -> Any:
        self._queries.append(query)
        return await self._conn.fetchval(query, *args)

    async def execute(self, query: str, *args: Any) -> Any:
        self._queries.append(query)
        return await self._conn.execute(query, *args)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        async with self._conn.transaction():
            yield
        if any(self._pool._lose(q) for q in self._queries):  # committed: now the answer is "lost"
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")


def _lossy(store: PostgresStore, hit: Callable[[str], bool]) -> _LostAnswer:
    lossy = _LostAnswer(store._pool, hit)
    store._pool_ = lossy  # type: ignore[assignment]
    return lossy


def test_an_event_append_whose_answer_was_lost_is_logged_once(pg: Postgres) -> None:
    async def body(store: PostgresStore) -> None:
        await store.put_response(resp("r1", status="in_progress", lease_holder="me", lease_until=2e9))
        events = [{"type": "response.created", "sequence_number": 0}, {"type": "response.in_progress", "sequence_number": 1}]
        lossy = _lossy(store, lambda q: "INSERT INTO response_events" in q)
        await store.append_events("r1", events)
        assert lossy.lost == 1
        assert await store.read_events("r1", "alice") == events
        with pytest.raises(ValueError):  # a true duplicate is still refused
            await store.append_events("r1", events[:1])

    pg.run(body)


def test_a_conversation_append_whose_answer_was_lost_is_appended_once(pg: Postgres) -> None:
    async def body(store: PostgresStore) -> None:
        await store.create_conversation(Conversation("conv_1", "alice", 1), [msg("a")])
        lossy = _lossy(store, lambda q: "INSERT INTO conversation_items" in q)
        assert await store.add_conversation_items("conv_1", "alice", [msg("b"), msg("c")]) == 1
        assert lossy.lost == 1
        assert [i["id"] for i in await store.load_conversation("conv_1", "alice")] == ["a", "b", "c"]

    pg.run(body)


def test_a_conversation_create_whose_answer_was_lost_is_not_refused(pg: Postgres) -> None:
    async def body(store: PostgresStore) -> None:
        lossy = _lossy(store, lambda q: "INSERT INTO conversations" in q)
        await store.create_conversation(Conversation("conv_1", "alice", 1, {"k": "v"}), [msg("a")])
        assert lossy.lost == 1
        assert [i["id"] for i in await store.load_conversation("conv_1", "alice")] == ["a"]
        with pytest.raises(ValueError):  # taken: still refused to anyone else
            await store.create_conversation(Conversation("conv_1", "bob", 1, {"k": "v"}), [])

    pg.run(body)


def test_a_put_whose_answer_was_lost_is_stored_once(pg: Postgres) -> None:
    async def body(store: PostgresStore) -> None:
        lossy = _lossy(store, lambda q: "INSERT INTO responses" in q)
        await store.put_response(resp("r1", inputs=[msg("i1"), msg("i2")]))
        assert lossy.lost == 1
        assert [i["id"] for i in await store.load_history("r1", "alice")] == ["i1", "i2", "r1-out"]

    pg.run(body)
