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


def test_threads_and_forked_children_never_share_a_random_part() -> None:
    import os
    import threading

    made: list[str] = []

    def make() -> None:
        made.extend(new_id("x")[16:] for _ in range(3000))

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == len(made) == 12_000
    new_id("x")  # the parent holds a batch now; a child must not reuse it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, new_id("x")[16:].encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    assert len(child) == 34 and child != new_id("x")[16:]
