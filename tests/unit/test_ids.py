"""Ids: OpenAI's shape (prefix, 48 hex digits), unique, and in creation order (the store's indexes rely on it for speed)."""

from __future__ import annotations

import re
import time

from hypothesis import given
from hypothesis import strategies as st

from router.protocol.ids import ItemIds, made_for, message_id, new_id, response_id, response_prefix


def test_ids_have_openais_shape_and_are_unique() -> None:
    ids = [response_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"resp_[0-9a-f]{48}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"msg_[0-9a-f]{48}", message_id()) and new_id("conv").startswith("conv_")


def test_ids_made_later_sort_later_and_start_with_the_time() -> None:
    before = time.time_ns() // 1000
    first = new_id("resp")
    time.sleep(0.002)  # the time passing is what is tested: the later ids' clock reads later
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


def test_a_responses_item_ids_name_it_and_no_other() -> None:
    """``ItemIds``: OpenAI's shape, unique, in order, and ``made_for`` / ``response_prefix``
    point back at the response (what lets the SQLite store skip their index rows)."""
    responses = [response_id() for _ in range(200)]
    made = {rid: [ids(prefix) for ids in (ItemIds(rid),) for prefix in ("msg", "fc", "rs", "mcp") * 3] for rid in responses}
    every = [iid for items in made.values() for iid in items]
    assert len(set(every)) == len(every)
    for rid, items in made.items():
        assert items == sorted(items, key=lambda i: i.partition("_")[2])  # made later, sorts later
        for iid in items:
            assert re.fullmatch(r"[a-z]+_[0-9a-f]{48}", iid)
            assert made_for(iid, rid) and rid.startswith(response_prefix(iid) or "-")
            assert response_prefix(iid) + "g" > rid  # the store's range [prefix, prefix + "g") holds it
    other = responses[0]
    assert not any(made_for(iid, other) for rid, items in made.items() if rid != other for iid in items)


@given(st.text(max_size=60), st.text(max_size=60))
def test_made_for_only_ids_of_the_shape(item_id: str, rid: str) -> None:
    if made_for(item_id, rid):
        assert re.fullmatch(r"resp_.{48}", rid, re.S) and len(item_id.partition("_")[2]) == 48
        assert item_id.partition("_")[2][:40] == rid[5:45]


def test_item_ids_of_an_id_not_of_the_shape_are_random() -> None:
    ids = ItemIds("resp_test")
    first, second = ids("msg"), ids("msg")
    assert first != second and not made_for(first, "resp_test")
    assert re.fullmatch(r"msg_[0-9a-f]{48}", first)
