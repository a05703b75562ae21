"""The embedded Store: one SQLite file, driven from one dedicated thread.

sqlite3 calls block, so every one of them runs on a single-worker executor
that owns the connection, and the connection is never used from two threads
at once. The file is in WAL mode, so readers in other processes are not
blocked by our writes. One exception, for latency: when the router serves
nothing else (``quiet``: at most one worker call out, the caller's own) and no
write is queued, ``put_response``, ``append_events`` and ``set_routing``
commit on the event loop over a second connection that
never waits for a lock (busy_timeout 0; a busy file falls back to the
thread). Measured here, handing one put to the thread costs the loop ~100 us
of GIL hand-offs, more than the put itself; under load the puts go to the
thread in groups, where one commit serves many.

Chain semantics: ``previous_response_id`` is a plain column, not a foreign
key. Deleting a response leaves its children intact; a child's history then
stops at the gap (it holds only the responses after the deleted one). An
expired response (``expires_at <= clock()``) is a gap too, until
``purge_expired`` removes it.

The class is split by concern: this module holds the connection, migrating
and responses; ``sqlite_schema`` the migrations; ``sqlite_puts`` how responses
are written (one put, a group of them); ``sqlite_conversations`` and
``sqlite_background`` the conversation and background-response methods as
mixins over the same connection and thread.

A failure of the file itself (locked by another process past the busy
timeout, a full disk, an unwritable file, an I/O error, a corrupt page) is
what clients see of any store failure, 503 ``store_unavailable`` (or a
stream's ``response.failed``), with the SQLite error logged; a constraint
or a bug stays what it is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

from router.protocol.ids import response_prefix
from router.state.common import UNFINISHED, check_page, item_id
from router.state.sqlite_background import SQLiteBackground
from router.state.sqlite_conversations import SQLiteConversations
from router.state.sqlite_puts import decode_body, decode_items, forget_items, put_many, put_one, transaction
from router.state.sqlite_schema import MIGRATIONS
from router.state.store import Item, ItemPage, Order, ResponseInProgress, StoredResponse, StoreUnavailable

T = TypeVar("T")

# sqlite3 binds int, float, str and bytearray parameters directly; any other type, bytes and
# None included, goes through its adapter lookup, which probes ``__adapt__`` and
# ``__conform__`` and formats an AttributeError for each miss. Our rows bind bytes (bodies)
# and None on every put: identity adapters skip the probing (measured: ~3% of a create).
sqlite3.register_adapter(bytes, bytes)
sqlite3.register_adapter(type(None), lambda value: value)

# A chain deeper than this is treated as corrupt (a cycle written by a bug)
# and cut, so a recursive query can never run forever.
MAX_CHAIN_DEPTH = 100_000

# Inline puts between checkpoints: ~8 WAL pages each, so ~1,000 pages (SQLite's own default) between them.
INLINE_CHECKPOINT_PUTS = 128

# How many expired responses one purge transaction deletes: the write lock is
# released between batches so requests are not held up by a big purge.
PURGE_BATCH = 1000

# "Not expired", given the store's clock as the parameter :now.
_LIVE = "(expires_at IS NULL OR expires_at > :now)"

# One row per response of the chain, oldest first, its items in its own row; the third column
# says whether the response the chain ends at (the last row) is unfinished; the last two where
# the oldest one's items went in the conversation it was created in, if any.
_HISTORY_SQL = f"""
WITH RECURSIVE chain(id, prev, depth, input, output, unfinished, conversation_id, conversation_position) AS (
    SELECT id, previous_response_id, 0, input, output, status IN {UNFINISHED!r}, conversation_id, conversation_position
    FROM responses WHERE id = :id AND owner = :owner AND {_LIVE}
    UNION ALL
    SELECT r.id, r.previous_response_id, c.depth + 1, r.input, r.output, 0, r.conversation_id, r.conversation_position
    FROM chain c JOIN responses r ON r.id = c.prev AND r.owner = :owner
        AND (r.expires_at IS NULL OR r.expires_at > :now)
    WHERE c.depth < :max_depth
)
SELECT input, output, unfinished, conversation_id, conversation_position FROM chain ORDER BY depth DESC
"""

# The items a response created in a conversation saw there: those before its own.
_CONVERSATION_BEFORE_SQL = """
SELECT ci.body FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
WHERE c.id = ? AND c.owner = ? AND ci.position < ? ORDER BY ci.position
"""

# Items by id (:ids, a JSON array) from the owner's live responses (the rows holding them: the
# caller finds each among their items) and conversations (the item itself, as output). A response's
# rows are found through ``item_ids``, and for ids of ItemIds' shape by a range of the primary key
# per id, the responses whose ids begin as theirs do ([lo, hi) in :made).
_GET_ITEMS_SQL = """
SELECT x.item_id, r.input, r.output FROM item_ids x JOIN responses r ON r.id = x.response_id
WHERE x.item_id IN (SELECT value FROM json_each(:ids)) AND r.owner = :owner
    AND (r.expires_at IS NULL OR r.expires_at > :now)
UNION ALL
SELECT json_extract(m.value, '$[0]'), r.input, r.output FROM json_each(:made) m JOIN responses r
    ON r.id >= json_extract(m.value, '$[1]') AND r.id < json_extract(m.value, '$[2]')
WHERE r.owner = :owner AND (r.expires_at IS NULL OR r.expires_at > :now)
UNION ALL
SELECT ci.item_id, NULL, ci.body FROM conversation_items ci JOIN conversations c ON c.id = ci.conversation_id
WHERE ci.item_id IN (SELECT value FROM json_each(:ids)) AND c.owner = :owner
"""

log = logging.getLogger("router.store")


def _file_failed(exc: BaseException) -> bool:
    """A failure of the database file (OperationalError: locked, full, read-only, I/O; a bare
    DatabaseError: corrupt), not of the statement (IntegrityError, ProgrammingError, ...)."""
    return type(exc) is sqlite3.OperationalError or type(exc) is sqlite3.DatabaseError


def _unavailable(exc: BaseException) -> StoreUnavailable:
    log.warning("the SQLite store failed: %s", exc)
    unavailable = StoreUnavailable()
    unavailable.__cause__ = exc
    return unavailable


class SQLiteStore(SQLiteConversations, SQLiteBackground):
    """``Store`` + ``ConversationStore`` + ``BackgroundStore`` over a SQLite file (or ":memory:" for tests)."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        # Unix seconds; what "expired" is measured against.
        self.clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        # Group commit: puts that arrive while a write is running share the next transaction.
        self._pending: list[tuple[StoredResponse, asyncio.Future[None]]] = []
        self._writing = False
        self._inline: sqlite3.Connection | None = None  # puts on the loop while the router is quiet
        self._inline_puts = 0
        self._checkpointing = False  # a checkpoint of the inline puts' WAL frames runs on the thread
        # Set by the app: True when no other request is being served. Only then is a write
        # committed on the loop; under load, grouped commits on the thread cost far less.
        self.quiet: Callable[[], bool] | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on the store's thread."""
        if self._executor is None:
            raise RuntimeError("SQLiteStore is not open")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._call, fn, args)
        except sqlite3.DatabaseError as exc:
            if _file_failed(exc):
                raise _unavailable(exc) from exc
            raise

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._conn is None:
            raise RuntimeError("SQLiteStore is closed")
        return fn(self._conn, *args)

    def _now(self) -> int:
        return int(self.clock())

    def reachable_s(self) -> float:
        """A file this process has open: no server to lose (BackgroundStore)."""
        return math.inf

    async def ping(self) -> None:
        """Nothing to reach (the database is a file this process has open); RuntimeError when closed."""
        if self._executor is None:
            raise RuntimeError("SQLiteStore is not open")

    _write = staticmethod(transaction)

    async def open(self) -> None:
        """Connect on the store's thread and bring the schema up to date."""
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._open_sync)
        except BaseException:
            self._executor.shutdown(wait=True)
            self._executor = None
            raise

    def _open_sync(self) -> None:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves.
        try:
            conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise sqlite3.OperationalError(f"{self.path}: {exc}") from None  # start-up's one line names the file
        try:
            try:
                conn.execute("PRAGMA journal_mode=WAL")  # the first read: a folder or an unreadable file fails here
            except sqlite3.Error as exc:
                raise sqlite3.OperationalError(f"{self.path}: {exc}") from None
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA busy_timeout=5000")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        if self.path == ":memory:" or "mode=memory" in self.path:
            return  # a second connection would open another, empty database
        inline = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
        inline.execute("PRAGMA synchronous=NORMAL")
        inline.execute("PRAGMA foreign_keys=ON")
        inline.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints stay on the store's thread
        self._inline = inline

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Apply the migrations this file is missing, all in one transaction."""
        def apply() -> None:
            # Read the version inside the write lock: another process may be migrating too.
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version > len(MIGRATIONS):
                raise RuntimeError(f"database schema v{version} is newer than this code's v{len(MIGRATIONS)}")
            for n in range(version, len(MIGRATIONS)):
                for step in MIGRATIONS[n]:
                    if isinstance(step, str):
                        conn.execute(step)
                    else:
                        step(conn)
            conn.execute(f"PRAGMA user_version = {len(MIGRATIONS)}")

        SQLiteStore._write(conn, apply)

    async def close(self) -> None:
        """Close the connection on its own thread, then stop the thread. Idempotent."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(executor, self._close_sync)
        finally:
            executor.shutdown(wait=True)

    def _close_sync(self) -> None:
        conn, self._conn = self._conn, None
        inline, self._inline = self._inline, None
        if inline is not None:
            inline.close()
        if conn is not None:
            conn.close()

    async def put_response(self, response: StoredResponse) -> None:
        """Upsert the response and replace all its items in one transaction.

        Raises PermissionError when the id exists under another owner. The
        lease columns are written too; a pending cancel request is kept.
        Concurrent puts are committed together (one commit, one thread hop); one
        failing put leaves the others intact (see ``sqlite_puts.put_many``).
        """
        if self._may_write_inline() and self._put_inline(response):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((response, future))
        if not self._writing:
            self._writing = True
            asyncio.get_running_loop().create_task(self._drain())
        await future

    def _put_inline(self, response: StoredResponse) -> bool:
        """Commit on the loop; False when another connection holds the write lock."""
        return self._inline_write(put_one, response)

    def _inline_write(self, fn: Callable[..., Any], *args: Any) -> bool:
        """``fn(conn, *args)`` (a whole write transaction) on the loop's connection; False when
        another connection holds the write lock (then it is to be done on the thread)."""
        assert self._inline is not None
        try:
            fn(self._inline, *args)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return False
            raise _unavailable(exc) from exc
        self._inline_puts += 1
        if self._inline_puts % INLINE_CHECKPOINT_PUTS == 0:  # the WAL is folded back on the store's thread
            self._checkpointing = True
            asyncio.get_running_loop().create_task(self._checkpoint())
        return True

    def _may_write_inline(self) -> bool:
        """Nothing else is served (``quiet``) and no write is queued or running on the thread."""
        return (self._inline is not None and self.quiet is not None and not self._writing and not self._pending
                and not self._checkpointing and self.quiet())

    async def _checkpoint(self) -> None:
        """Copy the WAL's frames into the file, with no inline put meanwhile.

        SQLite starts the WAL over (and so reuses its pages) only when a writer
        finds every frame copied. Puts that go on writing inline while the
        checkpoint runs keep it from ever being complete: measured, the WAL
        then grows by ~34 MB per 1,000 puts for as long as traffic lasts. Puts
        queued behind the checkpoint on the store's thread start it over.
        """
        try:
            await self._run(lambda conn: conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall())
        except (sqlite3.Error, StoreUnavailable, RuntimeError):
            pass  # the next one will do it; closing stores end here
        finally:
            self._checkpointing = False

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    errors = await self._run(put_many, [r for r, _ in batch])
                except BaseException as exc:  # noqa: BLE001 - the transaction itself failed: every put of it did
                    errors = [exc] * len(batch)
                for (_, future), error in zip(batch, errors):
                    if future.done():
                        continue
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(_unavailable(error) if _file_failed(error) else error)
        finally:
            self._writing = False

    async def get_response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        return await self._run(self._get_sync, response_id, owner, self._now())

    @staticmethod
    def _get_sync(conn: sqlite3.Connection, response_id: str, owner: str, now: int) -> dict[str, Any] | None:
        sql = f"SELECT body, output FROM responses WHERE id = :id AND owner = :owner AND {_LIVE}"
        row = conn.execute(sql, {"id": response_id, "owner": owner, "now": now}).fetchone()
        return None if row is None else decode_body(*row)

    async def load_history(self, response_id: str, owner: str) -> list[Item] | None:
        """One recursive query; a missing (deleted, expired) ancestor ends the chain there."""
        return await self._run(self._history_sync, response_id, owner, self._now())

    @staticmethod
    def _history_sync(conn: sqlite3.Connection, response_id: str, owner: str, now: int) -> list[Item] | None:
        params = {"id": response_id, "owner": owner, "now": now, "max_depth": MAX_CHAIN_DEPTH}
        rows = conn.execute(_HISTORY_SQL, params).fetchall()
        if not rows:
            return None
        if rows[-1][2]:
            raise ResponseInProgress(response_id)
        items = [item for inputs, output, *_ in rows for item in decode_items(inputs, output)]
        conversation_id, position = rows[0][3:]
        if conversation_id is None:
            return items
        before = conn.execute(_CONVERSATION_BEFORE_SQL, (conversation_id, owner, position)).fetchall()
        return [orjson.loads(body) for (body,) in before] + items

    async def get_items(self, item_ids: list[str], owner: str) -> dict[str, Item]:
        """One query over response and conversation items; an id stored in several places
        (a conversation keeps copies of its responses' items) yields one of its copies.
        A row found by an id's shape may not hold it: only an item with that id counts."""
        if not item_ids:
            return {}
        made = [(iid, lo, lo + "g") for iid in item_ids if (lo := response_prefix(iid)) is not None]
        params = {"ids": orjson.dumps(list(item_ids)).decode(), "made": orjson.dumps(made).decode(), "owner": owner,
                  "now": self._now()}
        rows = await self._run(lambda conn: conn.execute(_GET_ITEMS_SQL, params).fetchall())
        found: dict[str, Item] = {}
        for iid, inputs, output in rows:
            if inputs is None:  # a conversation's item
                found[iid] = orjson.loads(output)
                continue
            for item in decode_items(inputs, output):
                if item_id(item) == iid:
                    found[iid] = item
                    break
        return found

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Item ids go with it, events by ON DELETE CASCADE; children keep their own rows."""
        return await self._run(self._delete_sync, response_id, owner, self._now())

    @staticmethod
    def _delete_sync(conn: sqlite3.Connection, response_id: str, owner: str, now: int) -> bool:
        # An expired response is deleted too, but it was not there as far as the caller knows.
        sql = f"DELETE FROM responses WHERE id = :id AND owner = :owner RETURNING id, input, output, {_LIVE}"
        params = {"id": response_id, "owner": owner, "now": now}
        rows = SQLiteStore._write(conn, lambda: SQLiteStore._delete_rows(conn, sql, params))
        return bool(rows and rows[0][3])

    @staticmethod
    def _delete_rows(conn: sqlite3.Connection, sql: str, params: Any) -> list[Any]:
        """Run a DELETE ... RETURNING id, input, output on responses, and drop their item ids."""
        rows = conn.execute(sql, params).fetchall()
        forget_items(conn, [row[:3] for row in rows])
        return rows

    async def purge_expired(self, now: int) -> int:
        """Delete expired responses (their item ids, events by cascade) in batches of PURGE_BATCH transactions."""
        total = 0
        while True:
            n = await self._run(self._purge_sync, now)
            total += n
            if n < PURGE_BATCH:
                return total

    @staticmethod
    def _purge_sync(conn: sqlite3.Connection, now: int) -> int:
        sql = ("DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE expires_at <= ? LIMIT ?) "
               "RETURNING id, input, output")
        return len(SQLiteStore._write(conn, lambda: SQLiteStore._delete_rows(conn, sql, (now, PURGE_BATCH))))

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
        input items, so the API can answer 400 naming the ``after`` param.
        Raises ValueError for a limit below 1 or an unknown order.
        """
        check_page(limit, order)
        return await self._run(self._list_sync, response_id, owner, after, limit, order, self._now())

    @staticmethod
    def _list_sync(
        conn: sqlite3.Connection, response_id: str, owner: str, after: str | None, limit: int, order: Order, now: int
    ) -> ItemPage | None:
        sql = f"SELECT input FROM responses WHERE id = :id AND owner = :owner AND {_LIVE}"
        row = conn.execute(sql, {"id": response_id, "owner": owner, "now": now}).fetchone()
        if row is None:
            return None
        items = decode_items(row[0], None)
        if order == "desc":
            items.reverse()
        start = 0
        if after is not None:
            start = next((k + 1 for k, item in enumerate(items) if item_id(item) == after), -1)
            if start < 0:
                raise KeyError(after)
        return ItemPage(data=items[start:start + limit], has_more=len(items) > start + limit)

    async def set_routing(self, response_id: str, routing: dict[str, Any]) -> None:
        """Record where a stored response was served (ignored when the response is not stored)."""
        body = orjson.dumps(routing)

        def write(conn: sqlite3.Connection) -> None:
            SQLiteStore._write(conn, lambda: conn.execute(
                "INSERT INTO response_routing (response_id, body) SELECT id, ? FROM responses WHERE id = ? "
                "ON CONFLICT (response_id) DO UPDATE SET body = excluded.body", (body, response_id)))

        if self._may_write_inline() and self._inline_write(write):  # right after its put, as quiet as it was
            return
        await self._run(write)

    async def get_routing(self, response_id: str, owner: str) -> dict[str, Any] | None:
        def read(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT g.body FROM response_routing g JOIN responses r ON r.id = g.response_id "
                "WHERE g.response_id = ? AND r.owner = ?", (response_id, owner)).fetchone()
            return None if row is None else orjson.loads(row[0])

        return await self._run(read)
