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


def encode_events(events: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """(sequence_number, orjson bytes) per event; ValueError for an event without an integer one."""
    rows: list[tuple[int, bytes]] = []
    for event in events:
        seq = event.get("sequence_number")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError(f"event without an integer sequence_number: {event.get('type')!r}")  # noqa: TRY004
        rows.append((seq, orjson.dumps(event)))
    return rows


def failed_body(body: bytes, error: dict[str, Any]) -> bytes:
    """A stored Response body, marked failed with ``error``."""
    response = orjson.loads(body)
    response["status"] = "failed"
    response["error"] = error
    return orjson.dumps(response)
