"""The SQLite store's schema, as the migrations that build it (``PRAGMA user_version`` counts them).

Kept apart from the store's code: the file's layout changes only by appending here.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import orjson

# A step of a migration: a statement, or a function for what SQL alone does not do well.
Step = str | Callable[[sqlite3.Connection], None]


def _items_into_responses(conn: sqlite3.Connection) -> None:
    """Migration 6's data: each response's item rows become its ``input`` and ``output``
    arrays, its body keeps a null ``output`` (the column holds it), and every item id
    gets its ``item_ids`` row. One response at a time (the items in their key's order), so
    a big file is converted in little memory."""
    rows = conn.execute("SELECT response_id, kind, item_id, body FROM items ORDER BY response_id, kind, position")
    current: str | None = None
    kinds: tuple[list[bytes], list[bytes]] = ([], [])
    ids: list[str] = []
    for rid, kind, iid, body in rows:
        if rid != current:
            if current is not None:
                _move_items(conn, current, kinds, ids)
            current, kinds, ids = rid, ([], []), []
        kinds[1 if kind else 0].append(body.encode() if isinstance(body, str) else body)
        if iid is not None:
            ids.append(iid)
    if current is not None:
        _move_items(conn, current, kinds, ids)
    for (rid,) in conn.execute("SELECT id FROM responses WHERE input IS NULL").fetchall():  # those without items
        _move_items(conn, rid, ([], []), [])


def _move_items(conn: sqlite3.Connection, rid: str, kinds: tuple[list[bytes], list[bytes]], ids: list[str]) -> None:
    row = conn.execute("SELECT body FROM responses WHERE id = ?", (rid,)).fetchone()
    if row is None:
        return  # items of a response that is gone: they go with the table
    inputs, outputs = kinds
    body = row[0]
    try:
        response = orjson.loads(body) if body is not None else None
    except orjson.JSONDecodeError:
        response = None  # kept as it is: its reads fail as they did, the migration does not
    output: bytes | None = b"[" + b",".join(outputs) + b"]" if outputs else None
    if isinstance(response, dict) and "output" in response:
        output = orjson.dumps(response["output"])
        body = orjson.dumps({**response, "output": None})
    conn.execute("UPDATE responses SET input = ?, output = ?, body = ? WHERE id = ?",
                 (b"[" + b",".join(inputs) + b"]", output, body, rid))
    conn.executemany("INSERT OR IGNORE INTO item_ids (item_id, response_id) VALUES (?, ?)", [(i, rid) for i in ids])


def _conversation_positions(conn: sqlite3.Connection) -> None:
    """Migration 7's data: a response made in a conversation before the columns existed gets the
    position its own input took there (what it saw, but for items added while it ran). One that
    never reached its conversation (failed, cancelled) has none to find, and keeps none."""
    marker = b'"conversation":{"id":'
    rows = conn.execute("SELECT id, body, input FROM responses WHERE instr(body, ?) > 0", (marker,))
    found = []
    for rid, body, inputs in rows:
        try:
            conversation = orjson.loads(body).get("conversation") or {}
            ids = [item["id"] for item in orjson.loads(inputs or b"[]") if isinstance(item.get("id"), str)]
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            continue  # a body it cannot read: left as it was
        cid = conversation.get("id") if isinstance(conversation, dict) else None
        if not isinstance(cid, str) or not ids:
            continue
        (position,) = conn.execute(
            "SELECT min(position) FROM conversation_items WHERE conversation_id = ? "
            "AND item_id IN (SELECT value FROM json_each(?))", (cid, orjson.dumps(ids).decode())).fetchone()
        if position is not None:
            found.append((cid, position, rid))
    conn.executemany("UPDATE responses SET conversation_id = ?, conversation_position = ? WHERE id = ?", found)


# MIGRATIONS[n] takes the schema from user_version n to n + 1. Append only.
MIGRATIONS: list[list[Step]] = [
    [
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            previous_response_id TEXT,
            created_at INTEGER,
            status TEXT,
            body BLOB
        )""",
        """CREATE TABLE items (
            response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
            kind INTEGER NOT NULL,
            position INTEGER NOT NULL,
            item_id TEXT,
            body BLOB,
            PRIMARY KEY (response_id, kind, position)
        )""",
        "CREATE INDEX items_by_item_id ON items(response_id, kind, item_id)",
    ],
    [
        "ALTER TABLE responses ADD COLUMN expires_at INTEGER",
        "CREATE INDEX responses_by_expiry ON responses(expires_at) WHERE expires_at IS NOT NULL",
    ],
    [
        # Background responses: who runs it until when, and whether someone asked it to stop.
        "ALTER TABLE responses ADD COLUMN lease_holder TEXT",
        "ALTER TABLE responses ADD COLUMN lease_until REAL",
        "ALTER TABLE responses ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX responses_unfinished ON responses(lease_until) WHERE status IN ('queued', 'in_progress')",
        """CREATE TABLE response_events (
            response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
            sequence_number INTEGER NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (response_id, sequence_number)
        )""",
        # Conversations; next_position hands out the positions of appended items.
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            metadata BLOB NOT NULL,
            next_position INTEGER NOT NULL DEFAULT 0
        )""",
        """CREATE TABLE conversation_items (
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            item_id TEXT,
            body BLOB NOT NULL,
            PRIMARY KEY (conversation_id, position)
        )""",
        # get_items looks items up by id alone.
        "CREATE INDEX items_by_id ON items(item_id)",
        "CREATE INDEX conversation_items_by_id ON conversation_items(item_id)",
    ],
    [
        # Which pool, arm and worker served a response: continuations stick to them.
        """CREATE TABLE response_routing (
            response_id TEXT PRIMARY KEY REFERENCES responses (id) ON DELETE CASCADE,
            body BLOB NOT NULL
        )""",
    ],
    [
        # The primary key (response_id, kind, position) finds a response's items already; this
        # index only made every put write one more page (measured: ~10% of a put's CPU).
        "DROP INDEX IF EXISTS items_by_item_id",
    ],
    [
        # A response's items live in its own row (``input``, ``output``: JSON arrays), and only
        # their ids in a table of their own, for item references. An item row per item took
        # three b-trees (the rows, their key, the id index) and repeated the output the body
        # held; measured, a put wrote 7.5 WAL pages instead of 4.8 and cost ~30% more CPU.
        # No foreign key: the store deletes a response's ids with it (their rows' key starts
        # with the item id, so a key on response_id would be one more b-tree per put).
        "ALTER TABLE responses ADD COLUMN input BLOB",
        "ALTER TABLE responses ADD COLUMN output BLOB",
        """CREATE TABLE item_ids (
            item_id TEXT NOT NULL,
            response_id TEXT NOT NULL,
            PRIMARY KEY (item_id, response_id)
        ) WITHOUT ROWID""",
        _items_into_responses,
        "DROP TABLE items",
    ],
    [
        # A response created in a conversation: where its own items went there. A chain from it
        # continues the conversation's items before that position, then its own.
        "ALTER TABLE responses ADD COLUMN conversation_id TEXT",
        "ALTER TABLE responses ADD COLUMN conversation_position INTEGER",
        _conversation_positions,
    ],
]
