"""The SQLite store's file failing under a real router process: another process holds the file's
write lock past the router's busy timeout (5 s), or the disk the file is on fills up (a small tmpfs
of the test's own, filled to its last page; mounting one needs root, as in CI: skipped without).

What a client sees is what any store failure gives (as PostgreSQL's outage past ``retry_s``,
tests/fault/test_store_outage.py): 503 ``store_unavailable`` in OpenAI's error shape for a JSON
request, ``error`` + ``response.failed`` for a stream; the router logs the SQLite error. Reads go on
(WAL: a writer's lock does not block them), nothing acknowledged before is lost, and once the lock
is gone or the disk has room again the router serves and stores again, the streams whose ids their
clients saw included: stored failed, for the store, as PostgreSQL stores them once it is back.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"
WAIT_S = 60.0  # anything here happens well before this; a hung wait fails the test instead of hanging it
MNT_DETACH = 2


@pytest.fixture
def router(tmp_path: Path) -> Iterator[RouterProcess]:
    proc = start_router(tmp_path, sim_pool_toml(model=MODEL, replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n')
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def test_a_locked_file_is_store_unavailable_and_loses_nothing(router: RouterProcess, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = client.responses.create(model=MODEL, input="before [sim:tokens=3]")
    assert before.status == "completed"
    lock = sqlite3.connect(tmp_path / "responses.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another process's write lock, held past the router's busy timeout
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            client.responses.create(model=MODEL, input="while locked [sim:tokens=3]")
        assert caught.value.status_code == 503
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "store_unavailable" and error["type"] == "server_error", error
        assert set(error) >= {"message", "type", "param", "code"}

        with httpx.stream("POST", router.base_url + "/v1/responses", timeout=60,
                          json={"model": MODEL, "input": "streamed while locked [sim:tokens=3]", "stream": True}) as resp:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert events[-1]["response"]["error"]["code"] == "server_error"  # the Response's closed set
        assert events[-2]["code"] == "store_unavailable"  # the error event's own code is the precise one

        assert client.responses.retrieve(before.id).status == "completed"  # reads go on
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    after = client.responses.create(model=MODEL, input="after [sim:tokens=3]")
    assert after.status == "completed" and client.responses.retrieve(after.id).status == "completed"
    assert client.responses.retrieve(before.id).output_text == before.output_text
    assert "the SQLite store failed: database is locked" in router.log()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of the test's own, unmounted after it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", str(disk).encode(), b"tmpfs", 0, b"size=8m,mode=0700") != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {os.strerror(ctypes.get_errno())}")
    try:
        yield disk
    finally:
        libc.umount2(str(disk).encode(), MNT_DETACH)


@pytest.fixture
def router_on_small_disk(tmp_path: Path, small_disk: Path) -> Iterator[RouterProcess]:
    """The store's file on ``small_disk``; leases of 2 s, so what waits for the store tries again often."""
    store = f'[store]\npath = "{small_disk / "responses.db"}"\n[background]\nlease_s = 2.0\n'
    proc = start_router(tmp_path / "router", sim_pool_toml(model=MODEL, replicas=1)
                        + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n', store=store)
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def fill(disk: Path) -> Path:
    """Write a file on ``disk`` until it has no page left (the WAL's next frame needs one: a write fails)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        page = bytes(4096)
        try:
            while True:
                f.write(page)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    assert os.statvfs(disk).f_bavail == 0
    return filler


def streamed(router: RouterProcess, text: str) -> list[dict[str, Any]]:
    with httpx.stream("POST", router.base_url + "/v1/responses", timeout=WAIT_S,
                      json={"model": MODEL, "input": text, "stream": True}) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def stored(router: RouterProcess, rid: str) -> dict[str, Any] | None:
    """The stored response; None for a 404."""
    resp = httpx.get(f"{router.base_url}/v1/responses/{rid}", timeout=WAIT_S)
    if resp.status_code == 404:
        return None
    assert resp.status_code == 200, (resp.status_code, resp.text)
    return resp.json()


def test_a_full_disk_keeps_the_ends_of_streams_and_stores_them_once_it_has_room(
        router_on_small_disk: RouterProcess, small_disk: Path) -> None:
    router = router_on_small_disk
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    before = client.responses.create(model=MODEL, input="before [sim:tokens=3]")
    assert before.status == "completed"
    filler = fill(small_disk)

    with ThreadPoolExecutor(4) as pool:  # four streams at once: their puts go in one group, and fail
        streams = list(pool.map(lambda n: streamed(router, f"stream {n} [sim:tokens=5]"), range(4)))
    ids = []
    for events in streams:
        assert events[0]["type"] == "response.created"  # its id reached the client
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert events[-2]["code"] == "store_unavailable"
        ids.append(events[0]["response"]["id"])
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model=MODEL, input="while full [sim:tokens=3]")
    assert caught.value.status_code == 503
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "store_unavailable"
    assert client.responses.retrieve(before.id).status == "completed"  # reads go on
    assert [stored(router, rid) for rid in ids] == [None] * 4  # nothing could be written meanwhile

    filler.unlink()  # room again: each stream's end is stored, failed for the store
    deadline = time.monotonic() + WAIT_S
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        for rid in sorted(pending):
            body = stored(router, rid)
            if body is not None and body["status"] != "in_progress":
                assert body["status"] == "failed" and "store" in body["error"]["message"], body
                pending.discard(rid)
        time.sleep(0.1)
    assert not pending, f"never stored once the disk had room: {sorted(pending)}\n{router.log()[-3000:]}"
    after = client.responses.create(model=MODEL, input="after [sim:tokens=3]")
    assert after.status == "completed" and client.responses.retrieve(after.id).status == "completed"
    assert "the SQLite store failed: database or disk is full" in router.log()
