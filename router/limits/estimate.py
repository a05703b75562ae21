"""A prompt's tokens, estimated before any worker sees it: what a tokens-per-minute limit reserves.

Four bytes of JSON a token over the prompt's items (the history included) overestimates a little,
which a reservation should: what the request really used settles at its end. Tokenizing here
would cost a worker call (a chat pool) or a render (harmony) for every limited request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

BYTES_PER_TOKEN = 4


def prompt_estimate(items: Sequence[Any]) -> int:
    try:
        return len(orjson.dumps(items)) // BYTES_PER_TOKEN
    except TypeError:  # not plain JSON (it never is not, but a reservation must not fail a request)
        return sum(len(repr(item)) for item in items) // BYTES_PER_TOKEN
