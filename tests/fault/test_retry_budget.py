"""How many worker calls one request can make, through a real router process: at most
RETRY_ATTEMPTS (3) that reach a worker and fail, as docs/api.md says, whatever the state of the
router's kept-alive connections to the workers.

The workers are tests/fault/hostile_worker.py: ``bad:reset`` reads the request, then resets the
connection with nothing sent, as an engine that crashes on the request does, and each worker
says how many such requests it read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from backends.calls import RETRY_ATTEMPTS
from harness import ROOT, RouterProcess, free_port, http_status, start_router
from harness import die_with_parent as _die_with_pytest

pytestmark = pytest.mark.e2e

MODEL = "hostile"
WORKERS = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProcess, list[str]]]:
    urls, procs = [], []
    try:
        for _ in range(WORKERS):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.fault.hostile_worker", str(port), MODEL],
                                          cwd=ROOT, preexec_fn=_die_with_pytest, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while not all(http_status(url + "/health") == 200 for url in urls):
            assert time.monotonic() < deadline, "hostile workers did not start"
            time.sleep(0.05)
        proc = start_router(tmp_path_factory.mktemp("retry-budget"), f"""
[[pools]]
name = "bad"
engine = "vllm"
model = "{MODEL}"
urls = {urls!r}
health_interval_s = 60

[[models]]
name = "{MODEL}"
pool = "bad"
""".replace("'", '"'))
        yield proc, urls
        proc.stop()
    finally:
        for worker in procs:
            worker.kill()
            worker.wait()


def _resets(urls: list[str]) -> int:
    return sum(httpx.get(url + "/resets", timeout=10).json()["resets"] for url in urls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_crashes_every_engine_makes_at_most_three_calls(
        fleet: tuple[RouterProcess, list[str]], stream: bool) -> None:
    router, urls = fleet
    http = httpx.Client(base_url=router.base_url, timeout=60)
    for _ in range(4 * WORKERS):  # every worker has connections kept alive from the router
        assert http.post("/v1/responses", json={"model": MODEL, "input": "hello"}).status_code == 200
    before = _resets(urls)
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "bad:reset", "stream": stream})
    calls = _resets(urls) - before
    assert 1 <= calls <= RETRY_ATTEMPTS == 3, (calls, resp.text)
    # Before the answer began: the error itself, for a stream too.
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_error", resp.text
    assert http.post("/v1/responses", json={"model": MODEL, "input": "hello"}).status_code == 200
