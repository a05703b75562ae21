"""Ids: OpenAI's shape (prefix, 48 hex digits), unique, and in creation order (the store's indexes rely on it for speed)."""

from __future__ import annotations

import re
import time

from router.protocol.ids import message_id, new_id, response_id


def test_ids_have_openais_shape_and_are_unique() -> None:
    ids = [response_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"resp_[0-9a-f]{48}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"msg_[0-9a-f]{48}", message_id()) and new_id("conv").startswith("conv_")


def test_ids_made_later_sort_later_and_start_with_the_time() -> None:
    before = time.time_ns() // 1000
    first = new_id("resp")
    time.sleep(0.002)
    later = [new_id("resp") for _ in range(100)]
    assert first < min(later)
    stamp = int(first[5:19], 16)
    assert before <= stamp <= time.time_ns() // 1000
