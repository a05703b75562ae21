"""The SQLite store's schema, as the migrations that build it (``PRAGMA user_version`` counts them).

Kept apart from the store's code: the file's layout changes only by appending here.
"""

from __future__ import annotations

# MIGRATIONS[n] takes the schema from user_version n to n + 1. Append only.
MIGRATIONS: list[list[str]] = [
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
]
