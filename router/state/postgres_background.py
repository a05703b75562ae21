"""``BackgroundStore`` for PostgresStore: a mixin over the store's pool.

The event log is ``response_events`` (response_id, sequence_number, body),
deleted with its response by ON DELETE CASCADE (so ``delete_response`` and
``purge_expired`` take it along). The lease (``lease_holder``,
``lease_until``) and the ``cancel_requested`` flag are columns of
``responses``: ``put_response`` writes the lease and never touches the flag.

``fail_abandoned`` may run on every replica at once: each batch locks the
rows it fails with ``FOR UPDATE SKIP LOCKED``, so a row is failed by one
replica only (another replica skips it while it is locked, and no longer
matches it once that replica commits), and a response its holder is writing
at that moment is left for the next sweep. It is never retried (``Retrier.once``):
the sweep runs again soon, and after an outage it must first give the holders
time to renew the leases they could not renew meanwhile.

An append is retried like every call (router/state/postgres.py), and made
idempotent: after an attempt that may have committed (its statement was sent),
the next one first checks whether those events are logged, bodies and all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import asyncpg
import orjson
from asyncpg.pool import PoolConnectionProxy

from router.state.common import UNFINISHED, decode_bodies, encode_events, failed_body, item_id
from router.state.retry import Retrier
from router.state.store import Settle

# Abandoned responses failed per transaction.
FAIL_BATCH = 500

_LIVE = "(r.expires_at IS NULL OR r.expires_at > $3)"

_APPEND_SQL = """
INSERT INTO response_events (response_id, sequence_number, body)
SELECT $1, t.seq, t.body FROM unnest($2::bigint[], $3::bytea[]) AS t (seq, body)
"""

# Whether these events ($2 sequence numbers, $3 bodies) are all logged, as they are: an append's
# attempt whose answer was lost with its connection may have committed them.
_LOGGED_SQL = """
SELECT count(*) = cardinality($2::bigint[]) FROM response_events e
JOIN unnest($2::bigint[], $3::bytea[]) AS t (seq, body) ON e.sequence_number = t.seq AND e.body = t.body
WHERE e.response_id = $1
"""

# No row: the response is unknown; one NULL row: it has no events after $4.
_READ_SQL = f"""
SELECT e.body FROM responses r
LEFT JOIN response_events e ON e.response_id = r.id AND e.sequence_number > $4
WHERE r.id = $1 AND r.owner = $2 AND {_LIVE}
ORDER BY e.sequence_number LIMIT $5
"""

_RENEW_SQL = "UPDATE responses SET lease_until = $3 WHERE id = ANY ($1::text[]) AND lease_holder = $2"

_CANCEL_SQL = f"UPDATE responses AS r SET cancel_requested = true WHERE r.id = $1 AND r.owner = $2 AND {_LIVE} RETURNING 1"

_GOING_ON_SQL = "SELECT id FROM responses WHERE id = ANY ($1::text[]) AND NOT cancel_requested"

_ABANDONED_SQL = f"""
SELECT id, body FROM responses
WHERE status IN {UNFINISHED!r} AND (lease_until IS NULL OR lease_until < $1)
LIMIT $2
FOR UPDATE SKIP LOCKED
"""

# A response's item rows, from arrays ($1 the response; kinds, positions, ids, bodies). Here, not in
# postgres.py, which imports this module: a put and the sweep write them alike.
INSERT_ITEMS_SQL = """
INSERT INTO items (response_id, kind, position, item_id, body)
SELECT $1, t.kind, t.position, t.item_id, t.body
FROM unnest($2::smallint[], $3::integer[], $4::text[], $5::bytea[]) AS t (kind, position, item_id, body)
"""

_FAIL_SQL = """
UPDATE responses r SET status = 'failed', body = t.body, lease_holder = NULL, lease_until = NULL
FROM unnest($1::text[], $2::bytea[]) AS t (id, body)
WHERE r.id = t.id
"""


class PostgresBackground:
    """Mixin of PostgresStore (which provides ``_pool``, ``_now``, ``_retry``)."""

    if TYPE_CHECKING:
        _retry: Retrier

        @property
        def _pool(self) -> asyncpg.Pool: ...

        def _now(self) -> int: ...

    async def append_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Add events in one statement. KeyError(response_id) when the response is not
        stored; ValueError when a sequence_number is missing or already logged (nothing written)."""
        rows = encode_events(events)
        if not rows:
            return
        seqs, bodies = (list(column) for column in zip(*rows))
        sent = False

        async def attempt() -> None:
            nonlocal sent
            if sent and await self._pool.fetchval(_LOGGED_SQL, response_id, seqs, bodies):
                return  # the attempt that broke had committed them
            sent = True
            await self._pool.execute(_APPEND_SQL, response_id, seqs, bodies)

        try:
            await self._retry.run(attempt)
        except asyncpg.ForeignKeyViolationError:
            raise KeyError(response_id) from None
        except asyncpg.UniqueViolationError as exc:
            raise ValueError(f"response {response_id!r}: sequence_number already logged") from exc

    async def read_events(
        self, response_id: str, owner: str, *, after: int = -1, limit: int = 1000
    ) -> list[dict[str, Any]] | None:
        """Events after ``after``, ascending, at most ``limit``, in one query; None when the response
        is unknown (or expired) to this owner. ValueError for a limit below 1."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        rows = await self._retry.run(self._pool.fetch, _READ_SQL, response_id, owner, self._now(), after, limit)
        if not rows:
            return None
        return decode_bodies(rows)

    async def renew_leases(self, response_ids: list[str], holder: str, until: float) -> None:
        """Set ``lease_until`` on those of these responses whose lease ``holder`` holds."""
        if response_ids:
            await self._retry.run(self._pool.execute, _RENEW_SQL, sorted(response_ids), holder, float(until))

    async def request_cancel(self, response_id: str, owner: str) -> bool:
        return await self._retry.run(self._pool.fetchval, _CANCEL_SQL, response_id, owner, self._now()) is not None

    async def cancel_requested(self, response_ids: list[str]) -> set[str]:
        if not response_ids:
            return set()
        going_on = {rid for (rid,) in await self._retry.run(self._pool.fetch, _GOING_ON_SQL, list(response_ids))}
        return set(response_ids) - going_on  # flagged, or no longer there

    async def fail_abandoned(self, now: float, error: dict[str, Any], settle: Settle | None = None) -> list[str]:
        """Mark failed, FAIL_BATCH per transaction (rows locked FOR UPDATE SKIP LOCKED, body read,
        modified and written back), the unfinished responses whose lease ended before ``now`` or
        that have none. Their lease is cleared (nobody runs them any more); with ``settle``, their
        output (body and item rows) is what their event log says they had produced."""
        orjson.dumps(error)  # an unserializable error fails here, before any write
        failed: list[str] = []
        while True:
            ids = await self._retry.once(self._fail_batch, float(now), error, settle)
            failed += ids
            if len(ids) < FAIL_BATCH:
                return failed

    async def _fail_batch(self, now: float, error: dict[str, Any], settle: Settle | None) -> list[str]:
        """One transaction of ``fail_abandoned``: the ids it failed."""
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(_ABANDONED_SQL, now, FAIL_BATCH)
            if not rows:
                return []
            ids = [row["id"] for row in rows]
            bodies = [failed_body(row["body"], error, await _settled(conn, row["id"], settle)) for row in rows]
            await conn.execute(_FAIL_SQL, ids, bodies)
            return ids


async def _settled(conn: PoolConnectionProxy, rid: str, settle: Settle | None) -> list[Any] | None:
    """``settle`` of the response's logged events, its output item rows replaced to match; None
    without events (or without ``settle``): the output stays as stored."""
    if settle is None:
        return None
    rows = await conn.fetch("SELECT body FROM response_events WHERE response_id = $1 ORDER BY sequence_number", rid)
    if not rows:
        return None
    output = settle(decode_bodies(rows))
    await conn.execute("DELETE FROM items WHERE response_id = $1 AND kind = 1", rid)
    if output:
        await conn.execute(INSERT_ITEMS_SQL, rid, [1] * len(output), list(range(len(output))),
                           [item_id(item) for item in output], [orjson.dumps(item) for item in output])
    return output
