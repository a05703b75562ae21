"""Server-sent events framing: each frame whole, its ``event:`` line equal to ``type``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def encode_events(events: list[dict[str, Any]]) -> bytes:
    """All events of one batch as ONE write."""
    return b"".join(b"event: " + ev["type"].encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n" for ev in events)


async def sse_body(batches: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[bytes]:
    async for events in batches:
        yield encode_events(events)
    yield DONE


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
