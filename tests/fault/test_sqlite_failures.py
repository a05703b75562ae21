"""The SQLite store's file failing under a real router process: another process holds the file's
write lock past the router's busy timeout (5 s).

What a client sees is what any store failure gives (as PostgreSQL's outage past ``retry_s``,
tests/fault/test_store_outage.py): 503 ``store_unavailable`` in OpenAI's error shape for a JSON
request, ``error`` + ``response.failed`` for a stream; the router logs the SQLite error. Reads go on
(WAL: a writer's lock does not block them), nothing acknowledged before is lost, and once the lock
is gone the router serves and stores again.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"


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
