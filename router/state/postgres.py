"""The multi-replica Store: PostgreSQL through an asyncpg connection pool.

Same semantics as the SQLite store (see the contract in router/state/store.py):
owner isolation at every hop, ``previous_response_id`` a plain column (a
deleted or expired ancestor ends a chain), items replaced wholesale on every
``put_response``, history in one recursive query.

JSON (response bodies and items) is stored as ``bytea`` holding orjson's
bytes, not as JSONB: nothing queries inside it, the router only writes and
reads it back whole, and the bytes round-trip exactly (JSONB reorders keys,
rewrites numbers and refuses ``\\u0000`` in strings). It is also faster,
measured with bench/chain_load.py's chains against a JSONB variant (asyncpg
binary jsonb codec, orjson on both ends; PostgreSQL 15, a busy 2-CPU box):
loading 1,000 turns took 17-26 ms median with bytea against 30-42 ms with
JSONB, and a put ~1.9 ms against ~2.5-4 ms (the server parses JSONB on write).

Schema migrations run at ``open()`` inside one transaction holding a
``pg_advisory_xact_lock``, so replicas starting at once apply them one at a
time; ``schema_migrations`` records each version applied.

A restart or a short outage of the server is ridden out: every call goes
through ``Retrier`` (router/state/retry.py), which tries it again on a
connection error for up to ``retry_s``, then raises ``StoreUnavailable``.
A connection the server closed is never handed out again: asyncpg's pool
replaces a closed connection when it is next acquired, and closes one that
broke in use; and after any connection failure every pooled connection made
before it is closed rather than reused (``_expire``), including one whose
end asyncpg has not seen yet (found mid-restart). Every retried call is idempotent as a whole, including
when an attempt's COMMIT was sent and its answer lost: a put is an upsert that
replaces the items; reads and lease renewals run again; an event append or a
conversation append checks, after an attempt that may have committed, whether
its rows are there (``postgres_background``, ``postgres_conversations``). A
delete retried after such an attempt may report False (the row is gone either
way). ``fail_abandoned`` is never retried (see ``BackgroundStore``).

The class is split by concern: this module holds the pool, the schema and
responses; ``postgres_conversations`` and ``postgres_background`` hold the
conversation and background-response methods as mixins over the same pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import asyncpg
import orjson
from asyncpg.pool import PoolConnectionProxy

from router.state.common import UNFINISHED, check_page, decode_bodies, item_id
from router.state.postgres_background import INSERT_ITEMS_SQL, PostgresBackground
from router.state.postgres_conversations import PostgresConversations
from router.state.retry import Retrier
from router.state.store import Item, ItemPage, Order, ResponseDeleted, ResponseInProgress, StoredResponse, StoreUnavailable

INPUT, OUTPUT = 0, 1
# A chain deeper than this is treated as corrupt (a cycle written by a bug)
# and cut, so the recursive query can never run forever.
MAX_CHAIN_DEPTH = 100_000
# Expired responses deleted per purge transaction (rows locked by a writer are skipped).
PURGE_BATCH = 1000
# The advisory lock key held while migrating ("RespRout").
MIGRATION_LOCK = 0x52657370526F7574
# A new connection must be up within this long (asyncpg's default is 60 s): a server that does not
# answer at all costs one attempt this long, not the whole retry budget.
CONNECT_TIMEOUT_S = 10.0
# ``ping`` (/health) answers within about this long, whatever the server does.
PING_TIMEOUT_S = 3.0
# Errors that say the server went away or is not there yet, and nothing about the statement: a
# restart ends every session (57P01 admin shutdown), refuses connections while it is down, or
# answers "starting up"/"shutting down" (57P03); a connection may break mid-operation (class 08)
# or be found closed (InterfaceError). Not "pool is closing": that is the router's own stop.
_TRANSIENT = (
    OSError,  # refused, reset, timed out (TimeoutError is an OSError), a socket file gone
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is the connection's failure (worth another try), not the statement's.
    PermissionError is an OSError, but the store's own answer (another owner's id), or a socket
    file the router may not open: neither goes away by trying again."""
    if isinstance(exc, _TRANSIENT):
        return not isinstance(exc, PermissionError)
    if isinstance(exc, asyncpg.InterfaceError):
        message = str(exc)
        return "connection is closed" in message or "connection was closed" in message
    # A connection that got the server's goodbye (57P01) while idle and is handed out before its
    # socket's end is seen: its next statement finds the protocol still consuming that error.
    return isinstance(exc, asyncpg.InternalClientError) and str(exc).startswith("cannot switch to state")


# MIGRATIONS[n] takes the schema from version n to n + 1. Append only.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            previous_response_id TEXT,
            created_at BIGINT,
            status TEXT,
            expires_at BIGINT,
            body BYTEA NOT NULL
        )""",
        "CREATE INDEX responses_by_expiry ON responses (expires_at) WHERE expires_at IS NOT NULL",
        # The primary key serves every lookup: the chain walk, history, and a
        # response's input items (an ``after`` id is found among them).
        """CREATE TABLE items (
            response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE,
            kind SMALLINT NOT NULL,
            position INTEGER NOT NULL,
            item_id TEXT,
            body BYTEA NOT NULL,
            PRIMARY KEY (response_id, kind, position)
        )""",
    ],
    [
        # Background responses: who runs it until when, and whether someone asked it to stop.
        """ALTER TABLE responses
            ADD COLUMN lease_holder TEXT,
            ADD COLUMN lease_until DOUBLE PRECISION,
            ADD COLUMN cancel_requested BOOLEAN NOT NULL DEFAULT false""",
        "CREATE INDEX responses_unfinished ON responses (lease_until) WHERE status IN ('queued', 'in_progress')",
        """CREATE TABLE response_events (
            response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE,
            sequence_number BIGINT NOT NULL,
            body BYTEA NOT NULL,
            PRIMARY KEY (response_id, sequence_number)
        )""",
        # Conversations; next_position hands out the positions of appended items.
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            metadata BYTEA NOT NULL,
            next_position INTEGER NOT NULL DEFAULT 0
        )""",
        """CREATE TABLE conversation_items (
            conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            item_id TEXT,
            body BYTEA NOT NULL,
            PRIMARY KEY (conversation_id, position)
        )""",
        # get_items looks items up by id alone (and a conversation page its ``after`` item).
        "CREATE INDEX items_by_id ON items (item_id)",
        "CREATE INDEX conversation_items_by_id ON conversation_items (item_id)",
    ],
    [
        # Which pool, arm and worker served a response: continuations stick to them.
        """CREATE TABLE response_routing (
            response_id TEXT PRIMARY KEY REFERENCES responses (id) ON DELETE CASCADE,
            body BYTEA NOT NULL
        )""",
    ],
    [
        # A response created in a conversation: where its own items went there. A chain from it
        # continues the conversation's items before that position, then its own.
        "ALTER TABLE responses ADD COLUMN conversation_id TEXT, ADD COLUMN conversation_position INTEGER",
        # Responses made in a conversation before: the position their own input took there (a body
        # that is not JSON, or a response that never reached its conversation, keeps none).
        """DO $$
        DECLARE rec record; cid text; pos integer;
        BEGIN
            FOR rec IN SELECT id, body FROM responses WHERE position('"conversation":{"id":'::bytea IN body) > 0 LOOP
                BEGIN
                    cid := convert_from(rec.body, 'UTF8')::jsonb -> 'conversation' ->> 'id';
                EXCEPTION WHEN others THEN
                    cid := NULL;
                END;
                IF cid IS NOT NULL THEN
                    SELECT min(ci.position) INTO pos FROM conversation_items ci
                    JOIN items i ON i.item_id = ci.item_id AND i.response_id = rec.id AND i.kind = 0
                    WHERE ci.conversation_id = cid;
                    IF pos IS NOT NULL THEN
                        UPDATE responses SET conversation_id = cid, conversation_position = pos WHERE id = rec.id;
                    END IF;
                END IF;
            END LOOP;
        END $$""",
    ],
]

_MIGRATIONS_TABLE = """CREATE TABLE schema_migrations (
    version INTEGER PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)"""

# "Not expired", with the store's clock as $3 (every query below puts it there).
_LIVE = "(expires_at IS NULL OR expires_at > $3)"

_GET_SQL = f"SELECT body FROM responses WHERE id = $1 AND owner = $2 AND {_LIVE}"

_HISTORY_SQL = f"""
WITH RECURSIVE chain (id, prev, depth, unfinished, conversation_id, conversation_position) AS (
    SELECT id, previous_response_id, 0, status IN {UNFINISHED!r}, conversation_id, conversation_position
    FROM responses WHERE id = $1 AND owner = $2 AND {_LIVE}
    UNION ALL
    SELECT r.id, r.previous_response_id, c.depth + 1, false, r.conversation_id, r.conversation_position
    FROM chain c JOIN responses r ON r.id = c.prev
    WHERE r.owner = $2 AND (r.expires_at IS NULL OR r.expires_at > $3) AND c.depth < $4
)
SELECT i.body, c.unfinished, c.conversation_id, c.conversation_position FROM chain c LEFT JOIN items i ON i.response_id = c.id
ORDER BY c.depth DESC, i.kind, i.position
"""

# The items a response created in a conversation saw there: those before its own.
_CONVERSATION_BEFORE_SQL = """
SELECT ci.body FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
WHERE c.id = $1 AND c.owner = $2 AND ci.position < $3 ORDER BY ci.position
"""

# The lease is written too, but the same holder re-putting its response never
# shortens it (a renewal may have extended it since the StoredResponse was
# built); ``cancel_requested`` is left alone.
_UPSERT_SQL = """
INSERT INTO responses AS r (id, owner, previous_response_id, created_at, status, expires_at, body, lease_holder, lease_until,
    conversation_id, conversation_position)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
ON CONFLICT (id) DO UPDATE SET
    previous_response_id = excluded.previous_response_id,
    created_at = excluded.created_at,
    status = excluded.status,
    expires_at = excluded.expires_at,
    body = excluded.body,
    lease_holder = excluded.lease_holder,
    lease_until = CASE WHEN excluded.lease_holder = r.lease_holder
        THEN greatest(r.lease_until, excluded.lease_until) ELSE excluded.lease_until END,
    conversation_id = excluded.conversation_id,
    conversation_position = excluded.conversation_position
WHERE r.owner = excluded.owner
RETURNING 1
"""

# Items by id ($1) from the owner's live responses and conversations.
_GET_ITEMS_SQL = """
SELECT i.item_id, i.body FROM items i JOIN responses r ON r.id = i.response_id
WHERE i.item_id = ANY ($1::text[]) AND r.owner = $2 AND (r.expires_at IS NULL OR r.expires_at > $3)
UNION ALL
SELECT ci.item_id, ci.body FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
WHERE ci.item_id = ANY ($1::text[]) AND c.owner = $2
"""

# An expired response is deleted too, but reported as not there.
_DELETE_SQL = f"DELETE FROM responses WHERE id = $1 AND owner = $2 RETURNING {_LIVE}"

_PURGE_SQL = """
DELETE FROM responses WHERE id IN (
    SELECT id FROM responses WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED
)
"""

# One statement, so one snapshot: no row when the response is unknown; a NULL
# bound when ``after`` ($4) is not one of its input items; else the page.
_LIST_SQL = f"""
SELECT b.bound, ARRAY(
    SELECT i.body FROM items i
    WHERE i.response_id = $1 AND i.kind = {INPUT} AND i.position {{cmp}} b.bound
    ORDER BY i.position {{direction}} LIMIT $6
) AS page
FROM responses r, LATERAL (
    SELECT CASE WHEN $4::text IS NULL THEN $5::integer ELSE (
        SELECT position FROM items
        WHERE response_id = $1 AND kind = {INPUT} AND item_id = $4
        ORDER BY position {{direction}} LIMIT 1
    ) END AS bound
) b
WHERE r.id = $1 AND r.owner = $2 AND (r.expires_at IS NULL OR r.expires_at > $3)
"""
_LIST = {
    "asc": _LIST_SQL.format(cmp=">", direction="ASC"),
    "desc": _LIST_SQL.format(cmp="<", direction="DESC"),
}


class PostgresStore(PostgresConversations, PostgresBackground):
    """``Store`` + ``ConversationStore`` + ``BackgroundStore`` over a PostgreSQL database,
    shared by any number of router replicas."""

    def __init__(
        self, dsn: str, *, min_size: int = 1, max_size: int = 10, clock: Callable[[], float] = time.time,
        retry_s: float = 30.0,
    ) -> None:
        self.dsn = dsn
        self.min_size = min_size
        self.max_size = max_size
        # Unix seconds; what "expired" is measured against.
        self.clock = clock
        self._pool_: asyncpg.Pool | None = None
        self._retry = Retrier(retry_s, transient, "PostgreSQL", on_transient=self._expire)

    def reachable_s(self) -> float:
        return self._retry.reachable_s()

    async def _expire(self) -> None:
        """After a connection failed: every pooled connection made before it is closed instead of
        reused (idle ones at their next acquire, busy ones when released), so none that a restart
        broke is handed out again, whether or not asyncpg has seen its socket close yet."""
        if self._pool_ is not None:
            await self._pool_.expire_connections()

    @property
    def _pool(self) -> asyncpg.Pool:
        if self._pool_ is None:
            raise RuntimeError("PostgresStore is not open")
        return self._pool_

    def _now(self) -> int:
        return int(self.clock())

    async def open(self) -> None:
        """Create the pool and bring the schema up to date (a server still starting is waited for,
        up to ``retry_s``). A second open is a no-op."""
        if self._pool_ is not None:
            return
        try:
            self._pool_ = await self._retry.run(self._open_pool)
        except StoreUnavailable as exc:  # start-up says why, in one line (router/cli.py)
            raise RuntimeError(f"PostgreSQL cannot be reached: {exc.__cause__}") from exc.__cause__

    async def _open_pool(self) -> asyncpg.Pool:
        # Plan every query with its actual parameters. A prepared statement's cached
        # generic plan is made once per connection, from the table sizes of that
        # moment: one made while the tables were small (a fresh database) kept a
        # nested loop of seq scans and loaded a 1,000-turn chain in ~900 ms instead
        # of ~20 ms. Planning each time costs ~0.2 ms on the history query.
        defaults = {"application_name": "responses-router", "plan_cache_mode": "force_custom_plan"}
        settings = {k: v for k, v in defaults.items() if k not in self.dsn}  # the DSN may choose otherwise
        pool = await asyncpg.create_pool(
            self.dsn, min_size=self.min_size, max_size=self.max_size, server_settings=settings,
            timeout=CONNECT_TIMEOUT_S,
        )
        try:
            async with pool.acquire() as conn:
                await self._migrate(conn)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def ping(self) -> None:
        """One round trip on a pooled connection, no retry: StoreUnavailable when it fails, or when no
        connection answers within PING_TIMEOUT_S (a probe must not hang)."""
        await self._retry.once(self._ping)

    async def _ping(self) -> None:
        try:
            async with self._pool.acquire(timeout=PING_TIMEOUT_S) as conn:
                await conn.fetchval("SELECT 1", timeout=PING_TIMEOUT_S)
        except TimeoutError as exc:  # slow or busy, not seen to fail: no connection is dropped for it
            raise StoreUnavailable(f"PostgreSQL did not answer within {PING_TIMEOUT_S:g} s") from exc

    @staticmethod
    async def _migrate(conn: PoolConnectionProxy) -> None:
        """Apply the missing migrations in one transaction, under the advisory lock."""
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
                await conn.execute(_MIGRATIONS_TABLE)  # no DDL (nor its privilege) once there
            version = await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_migrations")
            if version > len(MIGRATIONS):
                raise RuntimeError(f"database schema v{version} is newer than this code's v{len(MIGRATIONS)}")
            for n in range(version, len(MIGRATIONS)):
                for statement in MIGRATIONS[n]:
                    await conn.execute(statement)
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", n + 1)

    async def close(self) -> None:
        """Close the pool (waiting for connections in use to come back). Idempotent."""
        pool, self._pool_ = self._pool_, None
        if pool is not None:
            await pool.close()

    async def put_response(self, response: StoredResponse) -> None:
        """Upsert the response and replace all its items in one transaction.

        Raises PermissionError when the id exists under another owner. The
        lease columns are written too; a pending cancel request is kept. The
        upsert locks the response's row, so concurrent puts of one id run one
        after the other and the last one's items win whole.
        """
        r = response
        # Serialize before touching the database: a bad item fails with nothing written.
        body = orjson.dumps(r.body)
        kinds: list[int] = []
        positions: list[int] = []
        item_ids: list[str | None] = []
        bodies: list[bytes] = []
        for kind, items in ((INPUT, r.input_items), (OUTPUT, r.body.get("output") or [])):
            for position, item in enumerate(items):
                kinds.append(kind)
                positions.append(position)
                item_ids.append(item_id(item))
                bodies.append(orjson.dumps(item))
        await self._retry.run(self._put, r, body, kinds, positions, item_ids, bodies)

    async def _put(self, r: StoredResponse, body: bytes, kinds: list[int], positions: list[int],
                   item_ids: list[str | None], bodies: list[bytes]) -> None:
        """One attempt of ``put_response``: idempotent, so a retry after a lost COMMIT is harmless."""
        async with self._pool.acquire() as conn, conn.transaction():
            if r.existing and await conn.fetchval("SELECT 1 FROM responses WHERE id = $1 FOR UPDATE", r.id) is None:
                raise ResponseDeleted(r.id)
            lease_until = None if r.lease_until is None else float(r.lease_until)
            row = (r.id, r.owner, r.previous_response_id, r.created_at, r.status, r.expires_at, body)
            if await conn.fetchval(_UPSERT_SQL, *row, r.lease_holder, lease_until, r.conversation_id,
                                   r.conversation_position) is None:
                # The id exists under another owner: never let one key overwrite another's.
                raise PermissionError(f"response {r.id!r} belongs to another owner")
            # A statement of its own: its snapshot sees the items of a put we waited for.
            await conn.execute("DELETE FROM items WHERE response_id = $1", r.id)
            if bodies:
                await conn.execute(INSERT_ITEMS_SQL, r.id, kinds, positions, item_ids, bodies)

    async def get_response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        body = await self._retry.run(self._pool.fetchval, _GET_SQL, response_id, owner, self._now())
        return None if body is None else orjson.loads(body)

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        """One recursive query; a missing (deleted, expired) ancestor ends the chain there."""
        rows = await self._retry.run(self._pool.fetch, _HISTORY_SQL, response_id, owner, self._now(), MAX_CHAIN_DEPTH)
        if not rows:
            return None  # the LEFT JOIN yields >= 1 row for every response found
        if rows[-1][1]:
            raise ResponseInProgress(response_id)
        # A response without items yields one row with a NULL body: skip it.
        items = decode_bodies(rows)
        conversation_id, position = rows[0][2:]
        if conversation_id is None:
            return items
        before = await self._retry.run(self._pool.fetch, _CONVERSATION_BEFORE_SQL, conversation_id, owner, position)
        return decode_bodies(before) + items

    async def get_items(self, item_ids: list[str], owner: str) -> dict[str, Item]:
        """One query over response and conversation items; an id stored in several places
        (a conversation keeps copies of its responses' items) yields one of its copies."""
        if not item_ids:
            return {}
        rows = await self._retry.run(self._pool.fetch, _GET_ITEMS_SQL, list(item_ids), owner, self._now())
        return {iid: orjson.loads(body) for iid, body in rows}

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Items and events go by ON DELETE CASCADE; children keep their own rows."""
        return bool(await self._retry.run(self._pool.fetchval, _DELETE_SQL, response_id, owner, self._now()))

    async def purge_expired(self, now: int) -> int:
        """Delete expired responses (items, events by cascade), PURGE_BATCH per transaction."""
        total = 0
        while True:
            status = await self._retry.run(self._pool.execute, _PURGE_SQL, now, PURGE_BATCH)
            n = int(status.split()[-1])  # "DELETE <n>"
            total += n
            if n < PURGE_BATCH:
                return total

    async def list_input_items(
        self,
        response_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: Order = "desc",
    ) -> ItemPage | None:
        """A page of input items in ``order``, strictly after item ``after``.

        Raises KeyError(after) when ``after`` is not one of this response's
        input items, ValueError for a limit below 1 or an unknown order.
        """
        check_page(limit, order)
        start = -1 if order == "asc" else 2**31 - 1
        args = (response_id, owner, self._now(), after, start, limit + 1)
        row = await self._retry.run(self._pool.fetchrow, _LIST[order], *args)
        if row is None:
            return None
        if row["bound"] is None:
            raise KeyError(after)
        page = row["page"]
        return ItemPage(data=[orjson.loads(body) for body in page[:limit]], has_more=len(page) > limit)

    async def set_routing(self, response_id: str, routing: dict[str, Any]) -> None:
        """Record where a stored response was served (ignored when the response is not stored)."""
        await self._retry.run(
            self._pool.execute,
            "INSERT INTO response_routing (response_id, body) SELECT id, $1 FROM responses WHERE id = $2 "
            "ON CONFLICT (response_id) DO UPDATE SET body = excluded.body", orjson.dumps(routing), response_id)

    async def get_routing(self, response_id: str, owner: str) -> dict[str, Any] | None:
        body = await self._retry.run(
            self._pool.fetchval,
            "SELECT g.body FROM response_routing g JOIN responses r ON r.id = g.response_id "
            "WHERE g.response_id = $1 AND r.owner = $2", response_id, owner)
        return None if body is None else orjson.loads(body)
