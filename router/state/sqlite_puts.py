"""How the SQLite store writes responses: one write transaction, one put, a group of puts.

Kept apart from the store's connections and threads (router/state/sqlite.py):
these are plain functions of a connection, run on whichever thread owns it.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from router.state.common import item_id
from router.state.store import ResponseDeleted, StoredResponse

T = TypeVar("T")

INPUT, OUTPUT = 0, 1


def transaction(conn: sqlite3.Connection, statements: Callable[[], T]) -> T:
    """One write transaction. IMMEDIATE takes the write lock up front, so another
    process's writer waits out the busy timeout instead of deadlocking on upgrade."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = statements()
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


# Most puts write a response this router just created: a plain insert, nothing to replace.
_INSERT_NEW_SQL = """
INSERT INTO responses (id, owner, previous_response_id, created_at, status, body, expires_at, lease_holder, lease_until)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(id) DO NOTHING
"""

# The same holder re-putting its response never shortens its lease: a renewal
# may have extended it since the StoredResponse was built.
_UPSERT_SQL = """
INSERT INTO responses (id, owner, previous_response_id, created_at, status, body, expires_at, lease_holder, lease_until)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(id) DO UPDATE SET
    previous_response_id = excluded.previous_response_id,
    created_at = excluded.created_at,
    status = excluded.status,
    body = excluded.body,
    expires_at = excluded.expires_at,
    lease_holder = excluded.lease_holder,
    lease_until = CASE WHEN excluded.lease_holder = responses.lease_holder
        THEN max(coalesce(responses.lease_until, excluded.lease_until), coalesce(excluded.lease_until, responses.lease_until))
        ELSE excluded.lease_until END
WHERE responses.owner = excluded.owner
"""


# Rows per multi-row INSERT: powers of two up to this, so a connection's statement cache (128)
# holds every one of them; SQLite's parameter limit (999 before 3.32) caps it too.
_MAX_GROUP_ROWS = 256
_PARAMS = sqlite3.connect(":memory:").getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)


class _NotAllNew(Exception):
    """A group put found a response that is not new: the group goes put by put."""


def _row_chunks(rows: list[Any], width: int) -> list[list[Any]]:
    """``rows`` (flat, ``width`` values each) cut into chunks of power-of-two row counts, largest first."""
    most = min(_MAX_GROUP_ROWS, _PARAMS // width)
    chunks, start, total = [], 0, len(rows) // width
    while start < total:
        size = most
        while size > total - start:
            size //= 2
        chunks.append(rows[start * width:(start + size) * width])
        start += size
    return chunks


@functools.lru_cache(maxsize=None)
def _insert_responses(n: int) -> str:
    values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * n)
    return (f"INSERT INTO responses (id, owner, previous_response_id, created_at, status, body, expires_at, "
            f"lease_holder, lease_until) VALUES {values} ON CONFLICT(id) DO NOTHING")


@functools.lru_cache(maxsize=None)
def _insert_items(n: int) -> str:
    return "INSERT INTO items (response_id, kind, position, item_id, body) VALUES " + ", ".join(["(?, ?, ?, ?, ?)"] * n)


def put_many(conn: sqlite3.Connection, batch: list[StoredResponse]) -> list[BaseException | None]:
    """All puts in one transaction; if any fails, the group is undone and each put goes
    again in its own, so a failing put fails alone (no savepoint per put: two statements
    saved on every put of the common, all-good group). A group of new responses, the
    common one, is written by ``_put_group``; one with an update among them put by put."""
    if len(batch) > 1:
        try:
            transaction(conn, lambda: _put_group(conn, batch))
            return [None] * len(batch)
        except _NotAllNew:
            try:
                transaction(conn, lambda: [_put_statements(conn, r) for r in batch])
                return [None] * len(batch)
            except Exception:  # noqa: BLE001 - redone one by one below, where the error is kept
                pass
        except Exception:  # noqa: BLE001 - redone one by one below, where the error is kept
            pass
    errors: list[BaseException | None] = []
    for response in batch:
        try:
            put_one(conn, response)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
    return errors


def _put_group(conn: sqlite3.Connection, batch: list[StoredResponse]) -> None:
    """New responses and their items in a few multi-row INSERTs per table (``_row_chunks``).
    Each statement lets the GIL go and takes it back once, where put by put did it for
    every statement and every item row, each a hand-off with the loop's thread. Raises
    _NotAllNew (and the transaction is undone) when one of them is not new."""
    if any(r.existing for r in batch):
        raise _NotAllNew
    rows: list[Any] = []
    items: list[Any] = []
    for r in batch:  # everything serialized before anything is written: a bad item fails here
        rows += (r.id, r.owner, r.previous_response_id, r.created_at, r.status, orjson.dumps(r.body), r.expires_at,
                 r.lease_holder, r.lease_until)
        for kind, its in ((INPUT, r.input_items), (OUTPUT, r.body.get("output") or [])):
            for position, item in enumerate(its):
                items += (r.id, kind, position, item_id(item), orjson.dumps(item))
    for chunk in _row_chunks(rows, 9):
        if conn.execute(_insert_responses(len(chunk) // 9), chunk).rowcount != len(chunk) // 9:
            raise _NotAllNew  # an id that is there already: each put its own way
    for chunk in _row_chunks(items, 5):
        conn.execute(_insert_items(len(chunk) // 5), chunk)


def put_one(conn: sqlite3.Connection, r: StoredResponse) -> None:
    transaction(conn, lambda: _put_statements(conn, r))


def _put_statements(conn: sqlite3.Connection, r: StoredResponse) -> None:
    # Serialize everything before writing: a bad item fails here with nothing written.
    body = orjson.dumps(r.body)
    rows: list[tuple[str, int, int, str | None, bytes]] = []
    for kind, items in ((INPUT, r.input_items), (OUTPUT, r.body.get("output") or [])):
        for position, item in enumerate(items):
            rows.append((r.id, kind, position, item_id(item), orjson.dumps(item)))
    row = (r.id, r.owner, r.previous_response_id, r.created_at, r.status, body, r.expires_at,
           r.lease_holder, r.lease_until)
    if r.existing and conn.execute("SELECT 1 FROM responses WHERE id = ?", (r.id,)).fetchone() is None:
        raise ResponseDeleted(r.id)
    if conn.execute(_INSERT_NEW_SQL, row).rowcount != 1:  # not new: replace it, and all its items
        if conn.execute(_UPSERT_SQL, row).rowcount != 1:
            # The id exists under another owner: never let one key overwrite another's.
            raise PermissionError(f"response {r.id!r} belongs to another owner")
        conn.execute("DELETE FROM items WHERE response_id = ?", (r.id,))
    conn.executemany("INSERT INTO items (response_id, kind, position, item_id, body) VALUES (?, ?, ?, ?, ?)", rows)
