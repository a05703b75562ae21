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

from router.protocol.ids import made_for
from router.state.common import item_id
from router.state.store import ResponseDeleted, StoredResponse

T = TypeVar("T")

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


_COLUMNS = ("id, owner, previous_response_id, created_at, status, body, expires_at, lease_holder, lease_until, "
            "input, output, conversation_id, conversation_position")
_WIDTH = 13
_VALUES = "(" + ", ".join(["?"] * _WIDTH) + ")"

# Most puts write a response this router just created: a plain insert, nothing to replace.
_INSERT_NEW_SQL = f"INSERT INTO responses ({_COLUMNS}) VALUES {_VALUES} ON CONFLICT(id) DO NOTHING"

# The same holder re-putting its response never shortens its lease: a renewal
# may have extended it since the StoredResponse was built.
_UPSERT_SQL = f"""
INSERT INTO responses ({_COLUMNS})
VALUES {_VALUES}
ON CONFLICT(id) DO UPDATE SET
    previous_response_id = excluded.previous_response_id,
    created_at = excluded.created_at,
    status = excluded.status,
    body = excluded.body,
    expires_at = excluded.expires_at,
    lease_holder = excluded.lease_holder,
    lease_until = CASE WHEN excluded.lease_holder = responses.lease_holder
        THEN max(coalesce(responses.lease_until, excluded.lease_until), coalesce(excluded.lease_until, responses.lease_until))
        ELSE excluded.lease_until END,
    input = excluded.input,
    output = excluded.output,
    conversation_id = excluded.conversation_id,
    conversation_position = excluded.conversation_position
WHERE responses.owner = excluded.owner
"""


def encode(r: StoredResponse) -> tuple[tuple[Any, ...], list[str]]:
    """The response's row and its item ids (each once), serialized before anything is written:
    a bad item fails here. The body's ``output`` is kept in its own column and left null in
    the body (``decode_body`` puts it back), so it is stored once."""
    body, output = r.body, None
    if "output" in body:
        output = orjson.dumps(body["output"])
        body = {**body, "output": None}
    row = (r.id, r.owner, r.previous_response_id, r.created_at, r.status, orjson.dumps(body), r.expires_at,
           r.lease_holder, r.lease_until, orjson.dumps(r.input_items), output, r.conversation_id,
           r.conversation_position)
    return row, item_ids(r.input_items, r.body.get("output"), r.id)


def item_ids(inputs: Any, outputs: Any, response_id: str) -> list[str]:
    """The string ids of these items that ``item_ids`` rows are kept for, each once, in order:
    all but those the response's own ``ItemIds`` made, which its row finds (``get_items``).
    Most responses have no other: a put writes one b-tree fewer (bench/RESULTS.md)."""
    ids = [iid for items in (inputs, outputs) if isinstance(items, list) for item in items
           if isinstance(item, dict) and (iid := item_id(item)) is not None and not made_for(iid, response_id)]
    return ids if len(set(ids)) == len(ids) else list(dict.fromkeys(ids))


def decode_body(body: bytes, output: bytes | None) -> Any:
    """The Response object as it was put: ``encode``'s inverse."""
    response = orjson.loads(body)
    if output is not None and type(response) is dict and "output" in response:
        response["output"] = orjson.loads(output)
    return response


def decode_items(inputs: bytes | None, output: bytes | None) -> list[Any]:
    """A response's input items, then its output items."""
    items = orjson.loads(inputs) if inputs is not None else []
    outputs = orjson.loads(output) if output is not None else None
    return items + outputs if outputs else items


def forget_items(conn: sqlite3.Connection, rows: list[tuple[str, bytes | None, bytes | None]]) -> None:
    """Drop the ``item_ids`` rows of responses gone or rewritten: (id, input, output) each."""
    keys = [(iid, rid) for rid, inputs, output in rows
            for iid in item_ids(orjson.loads(inputs) if inputs else [], orjson.loads(output) if output else [], rid)]
    if keys:
        conn.executemany("DELETE FROM item_ids WHERE item_id = ? AND response_id = ?", keys)


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


@functools.cache
def _insert_responses(n: int) -> str:
    return f"INSERT INTO responses ({_COLUMNS}) VALUES {', '.join([_VALUES] * n)} ON CONFLICT(id) DO NOTHING"


@functools.cache
def _insert_ids(n: int) -> str:
    return "INSERT OR IGNORE INTO item_ids (item_id, response_id) VALUES " + ", ".join(["(?, ?)"] * n)


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
                transaction(conn, lambda: _put_each(conn, batch))
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
    """New responses and their item ids in a few multi-row INSERTs per table (``_row_chunks``).
    Each statement lets the GIL go and takes it back once, where put by put did it for
    every statement, each a hand-off with the loop's thread. Raises _NotAllNew (and the
    transaction is undone) when one of them is not new."""
    if any(r.existing for r in batch):
        raise _NotAllNew
    rows: list[Any] = []
    ids: list[Any] = []
    for r in batch:  # everything serialized before anything is written: a bad item fails here
        row, iids = encode(r)
        rows += row
        for iid in iids:
            ids += (iid, r.id)
    for chunk in _row_chunks(rows, _WIDTH):
        if conn.execute(_insert_responses(len(chunk) // _WIDTH), chunk).rowcount != len(chunk) // _WIDTH:
            raise _NotAllNew  # an id that is there already: each put its own way
    for chunk in _row_chunks(ids, 2):
        conn.execute(_insert_ids(len(chunk) // 2), chunk)


def put_one(conn: sqlite3.Connection, r: StoredResponse) -> None:
    transaction(conn, lambda: _put_statements(conn, r))


def _put_each(conn: sqlite3.Connection, batch: list[StoredResponse]) -> None:
    for r in batch:
        _put_statements(conn, r)


def _put_statements(conn: sqlite3.Connection, r: StoredResponse) -> None:
    row, iids = encode(r)  # before writing: a bad item fails here with nothing written
    if r.existing:  # a later put of a response this router stored: read what it replaces, then replace it
        old = conn.execute("SELECT owner, input, output FROM responses WHERE id = ?", (r.id,)).fetchone()
        if old is None:
            raise ResponseDeleted(r.id)
        _replace(conn, r, row, old)
    elif conn.execute(_INSERT_NEW_SQL, row).rowcount != 1:  # not new: replace it, and its item ids
        _replace(conn, r, row, conn.execute("SELECT owner, input, output FROM responses WHERE id = ?", (r.id,)).fetchone())
    index_items(conn, r.id, iids)


def _replace(conn: sqlite3.Connection, r: StoredResponse, row: tuple[Any, ...], old: tuple[Any, ...] | None) -> None:
    """``r`` over the row it replaces, whose (owner, input, output) are ``old``; its item ids go (the caller adds the new)."""
    if old is None or old[0] != r.owner or conn.execute(_UPSERT_SQL, row).rowcount != 1:
        # The id exists under another owner: never let one key overwrite another's.
        raise PermissionError(f"response {r.id!r} belongs to another owner")
    forget_items(conn, [(r.id, old[1], old[2])])


def index_items(conn: sqlite3.Connection, rid: str, ids: list[str]) -> None:
    """Record these item ids as the response's (``item_ids``), in a few multi-row INSERTs."""
    if not ids:
        return
    for chunk in _row_chunks([v for iid in ids for v in (iid, rid)], 2):
        conn.execute(_insert_ids(len(chunk) // 2), chunk)
