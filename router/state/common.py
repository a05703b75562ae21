"""Small helpers both stores share: argument checks and (de)serialization done off the database."""

from __future__ import annotations

from typing import Any

import orjson

from router.state.store import Item

# The statuses of a response that is still running (or waiting to run).
UNFINISHED = ("queued", "in_progress")


def check_page(limit: int, order: str) -> None:
    """The ValueError every paged listing raises for a bad ``limit`` or ``order``."""
    if limit < 1:
        raise ValueError("limit must be >= 1")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', not {order!r}")


def item_id(item: Item) -> str | None:
    value = item.get("id")
    return value if isinstance(value, str) else None


def encode_items(items: list[Item]) -> list[tuple[str | None, bytes]]:
    """(id, orjson bytes) per item, in order. Raises TypeError (orjson's) before anything is written."""
    return [(item_id(item), orjson.dumps(item)) for item in items]


def decode_bodies(rows: Any) -> list[Any]:
    """The JSON body in the first column of each row, in order; rows with a NULL body (a LEFT JOIN
    that found nothing: a response or conversation without items) are skipped."""
    return [orjson.loads(row[0]) for row in rows if row[0] is not None]


def encode_events(events: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """(sequence_number, orjson bytes) per event; ValueError for an event without an integer one."""
    rows: list[tuple[int, bytes]] = []
    for event in events:
        seq = event.get("sequence_number")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError(f"event without an integer sequence_number: {event.get('type')!r}")  # noqa: TRY004
        rows.append((seq, orjson.dumps(event)))
    return rows


def failed_body(body: bytes, error: dict[str, Any], output: list[Any] | None = None) -> bytes:
    """A stored Response body, marked failed with ``error`` (and given ``output``, when not None)."""
    response = orjson.loads(body)
    response["status"] = "failed"
    response["error"] = error
    if output is not None:
        response["output"] = output
    return orjson.dumps(response)


def sqlite_page(conn: Any, table: str, where: str, params: tuple[Any, ...], *, after: str | None, limit: int,
                order: str) -> Any:
    """A page of position-ordered items of one owner object (SQLite), strictly after item ``after``.

    ``where`` selects the object's rows in ``table`` (with ``params``). Raises
    KeyError(after) for an id that is not among them.
    """
    from router.state.store import ItemPage

    cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
    if after is None:
        bound = -1 if order == "asc" else 2**62
    else:
        row = conn.execute(
            f"SELECT position FROM {table} WHERE {where} AND item_id = ? ORDER BY position {direction} LIMIT 1",
            (*params, after),
        ).fetchone()
        if row is None:
            raise KeyError(after)
        bound = row[0]
    rows = conn.execute(
        f"SELECT body FROM {table} WHERE {where} AND position {cmp} ? ORDER BY position {direction} LIMIT ?",
        (*params, bound, limit + 1),
    ).fetchall()
    return ItemPage(data=[orjson.loads(body) for (body,) in rows[:limit]], has_more=len(rows) > limit)
