"""``BackgroundStore`` for SQLiteStore: a mixin over the store's connection and thread.

The event log is ``response_events`` (response_id, sequence_number, body),
deleted with its response by ON DELETE CASCADE (so ``delete_response`` and
``purge_expired`` take it along). The lease (``lease_holder``,
``lease_until``) and the ``cancel_requested`` flag are columns of
``responses``: ``put_response`` writes the lease and never touches the flag.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from router.state.common import UNFINISHED, decode_bodies, encode_events, failed_body
from router.state.sqlite_puts import forget_items, index_items, item_ids
from router.state.store import Settle

T = TypeVar("T")

# Abandoned responses failed per write transaction (the write lock is let go between batches).
FAIL_BATCH = 500

_LIVE = "(r.expires_at IS NULL OR r.expires_at > :now)"

# No row: the response is unknown; one NULL row: it has no events after :after.
_READ_SQL = f"""
SELECT e.body FROM responses r
LEFT JOIN response_events e ON e.response_id = r.id AND e.sequence_number > :after
WHERE r.id = :id AND r.owner = :owner AND {_LIVE}
ORDER BY e.sequence_number LIMIT :limit
"""

_ABANDONED_SQL = f"""
SELECT id, body, input, output FROM responses
WHERE status IN {UNFINISHED!r} AND (lease_until IS NULL OR lease_until < ?)
LIMIT ?
"""


class SQLiteBackground:
    """Mixin of SQLiteStore (which provides ``_run``, ``_write``, ``_now``)."""

    if TYPE_CHECKING:

        async def _run(self, fn: Callable[..., T], *args: Any) -> T: ...

        @staticmethod
        def _write(conn: sqlite3.Connection, statements: Callable[[], T]) -> T: ...

        def _now(self) -> int: ...

        def _may_write_inline(self) -> bool: ...

        def _inline_write(self, fn: Callable[..., Any], *args: Any) -> bool: ...

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Add events in one transaction. KeyError(response_id) when the response is not
        stored; ValueError when a sequence_number is missing or already logged (nothing written)."""
        rows = [(response_id, seq, body) for seq, body in encode_events(events)]
        if not rows:
            return

        def run(conn: sqlite3.Connection) -> None:
            def statements() -> None:
                if conn.execute("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is None:
                    raise KeyError(response_id)
                try:
                    conn.executemany(
                        "INSERT INTO response_events (response_id, sequence_number, body) VALUES (?, ?, ?)", rows
                    )
                except sqlite3.IntegrityError as exc:
                    raise ValueError(f"response {response_id!r}: sequence_number already logged") from exc

            self._write(conn, statements)

        if self._may_write_inline() and self._inline_write(run):  # a running stream's checkpoint, mostly
            return
        await self._run(run)

    async def read_events(
        self, response_id: str, owner: str, *, after: int = -1, limit: int = 1000
    ) -> list[dict[str, Any]] | None:
        """Events after ``after``, ascending, at most ``limit``, in one query; None when the response
        is unknown (or expired) to this owner. ValueError for a limit below 1."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        params = {"id": response_id, "owner": owner, "now": self._now(), "after": after, "limit": limit}
        rows = await self._run(lambda conn: conn.execute(_READ_SQL, params).fetchall())
        if not rows:
            return None
        return decode_bodies(rows)

    async def renew_leases(self, response_ids: list[str], holder: str, until: float) -> None:
        """Set ``lease_until`` on those of these responses whose lease ``holder`` holds."""
        if not response_ids:
            return
        sql = "UPDATE responses SET lease_until = ? WHERE lease_holder = ? AND id IN (SELECT value FROM json_each(?))"
        params = (until, holder, orjson.dumps(list(response_ids)).decode())
        await self._run(lambda conn: self._write(conn, lambda: conn.execute(sql, params)))

    async def request_cancel(self, response_id: str, owner: str) -> bool:
        sql = f"UPDATE responses AS r SET cancel_requested = 1 WHERE r.id = :id AND r.owner = :owner AND {_LIVE}"
        params = {"id": response_id, "owner": owner, "now": self._now()}
        n = await self._run(lambda conn: self._write(conn, lambda: conn.execute(sql, params).rowcount))
        return n == 1

    async def cancel_requested(self, response_ids: list[str]) -> set[str]:
        if not response_ids:
            return set()
        sql = "SELECT id FROM responses WHERE NOT cancel_requested AND id IN (SELECT value FROM json_each(?))"
        params = (orjson.dumps(list(response_ids)).decode(),)
        rows = await self._run(lambda conn: conn.execute(sql, params).fetchall())
        return set(response_ids) - {rid for (rid,) in rows}  # flagged, or no longer there

    async def fail_abandoned(self, now: float, error: dict[str, Any], settle: Settle | None = None) -> list[str]:
        """Mark failed, FAIL_BATCH per write transaction (read, modify, write the body under the
        write lock), the unfinished responses whose lease ended before ``now`` or that have none.
        Their lease is cleared (nobody runs them any more); with ``settle``, their output is what
        their event log says they had produced."""
        orjson.dumps(error)  # an unserializable error fails here, before any write
        failed: list[str] = []
        while True:
            batch = await self._run(self._fail_sync, now, error, FAIL_BATCH, settle)
            failed += batch
            if len(batch) < FAIL_BATCH:
                return failed

    def _fail_sync(self, conn: sqlite3.Connection, now: float, error: dict[str, Any], batch: int,
                   settle: Settle | None) -> list[str]:
        def statements() -> list[str]:
            rows = conn.execute(_ABANDONED_SQL, (now, batch)).fetchall()
            for rid, body, inputs, output in rows:
                settled = _settled(conn, rid, settle)
                if settled is not None:  # the output column holds it (the body keeps a null)
                    forget_items(conn, [(rid, inputs, output)])
                    output = orjson.dumps(settled)
                    index_items(conn, rid, item_ids(orjson.loads(inputs or b"[]"), settled, rid))
                conn.execute("UPDATE responses SET status = 'failed', body = ?, output = ?, lease_holder = NULL, "
                             "lease_until = NULL WHERE id = ?", (failed_body(body, error), output, rid))
            return [rid for rid, *_ in rows]

        return self._write(conn, statements)


def _settled(conn: sqlite3.Connection, rid: str, settle: Settle | None) -> list[Any] | None:
    """``settle`` of the response's logged events; None without events (or without ``settle``)."""
    if settle is None:
        return None
    events = [orjson.loads(body) for (body,) in conn.execute(
        "SELECT body FROM response_events WHERE response_id = ? ORDER BY sequence_number", (rid,))]
    return settle(events) if events else None
