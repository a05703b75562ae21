"""Circuit breakers against what clients can do and what crashes do, through real processes.

A request whose body makes every engine fail is the request's fault: answered with the engine's
error, it shuts no worker out. One crash breaking twenty streams is one failure: once the
restarted worker passes its health check, it serves. The breaker's state machine alone:
tests/unit/test_breaker.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

MODELS = '\n[[models]]\nname = "m"\npool = "sim"\n'


def health(router: RouterProcess) -> dict:
    try:
        with urllib.request.urlopen(router.base_url + "/health") as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 while down: the same body
        return json.loads(exc.read())


def wait_for(router: RouterProcess, what: str, predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}\n{health(router)}\n{router.log()[-4000:]}"
        time.sleep(0.1)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RouterProcess, httpx.Client]]:
    """A router in front of a managed pool of two sim workers."""
    router = start_router(tmp_path, sim_pool_toml(replicas=2) + MODELS)
    try:
        with httpx.Client(base_url=router.base_url, timeout=30) as http:
            yield router, http
    finally:
        assert router.stop() == 0


def assert_pool_open_to_all(router: RouterProcess, http: httpx.Client) -> None:
    pool = health(router)["pools"][0]
    assert pool["status"] == "ok" and [w["circuit"] for w in pool["workers"]] == ["closed", "closed"], pool
    assert http.post("/v1/responses", json={"model": "m", "input": "an ordinary request"}).status_code == 200


def test_a_request_that_fails_on_every_worker_is_answered_and_shuts_no_worker_out(pair) -> None:  # type: ignore[no-untyped-def]
    router, http = pair
    for i in range(8):  # more than enough, at five counted failures each, to open both circuits
        resp = http.post("/v1/responses", json={"model": "m", "input": f"poison {i} [sim:status=500]",
                                                "stream": bool(i % 2)})
        assert resp.status_code == 502, resp.text
        error = resp.json()["error"]
        assert error["code"] == "upstream_error"
        assert "2 workers" in error["message"] and "500" in error["message"]
        assert "simulated failure" in error["message"]  # the engine's own error, named
    assert_pool_open_to_all(router, http)


def test_a_schema_the_engine_cannot_compile_is_a_400_and_shuts_no_worker_out(pair) -> None:  # type: ignore[no-untyped-def]
    router, http = pair
    fmt = {"type": "json_schema", "name": "loop", "schema": {"$ref": "#"}}
    for i in range(8):
        resp = http.post("/v1/responses", json={"model": "m", "input": f"loop {i}", "text": {"format": fmt},
                                                "stream": bool(i % 2)})
        assert resp.status_code == 400, resp.text
        assert "Failed to transform json schema into a grammar" in resp.json()["error"]["message"]
    assert_pool_open_to_all(router, http)


def test_a_crash_under_twenty_streams_does_not_shut_the_restarted_worker_out(tmp_path: Path) -> None:
    """SIGKILL under 20 streams: every stream ends failed, the launcher restarts the worker, and the
    first request after its health check passes is served (it was shut out for 60 s: twenty
    failures, the cool-down doubled on each)."""
    router = start_router(tmp_path, sim_pool_toml(replicas=1) + MODELS)
    try:
        worker = health(router)["pools"][0]["workers"][0]
        pid = worker["process"]["pid"]
        assert b"backends.sim" in Path(f"/proc/{pid}/cmdline").read_bytes()
        started = threading.Semaphore(0)
        endings: list[list[str]] = []
        errors: list[BaseException] = []

        def stream(i: int) -> None:
            body = {"model": "m", "input": f"story {i} [sim:tokens=5000] [sim:itl_ms=50]", "stream": True}
            types: list[str] = []
            try:
                with httpx.stream("POST", router.base_url + "/v1/responses", json=body, timeout=60) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("event: "):
                            types.append(line.removeprefix("event: "))
                            if types[-1] == "response.output_text.delta" and "started" not in types:
                                types.append("started")
                                started.release()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
                started.release()
            endings.append([t for t in types if t != "started"][-2:])

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(20)]
        for thread in threads:
            thread.start()
        for _ in threads:
            assert started.acquire(timeout=60), f"a stream did not start\n{health(router)}\n{router.log()[-4000:]}"
        assert not errors, errors
        os.kill(pid, signal.SIGKILL)
        for thread in threads:
            thread.join(60)
        assert endings == [["error", "response.failed"]] * 20

        def back() -> bool:
            w = health(router)["pools"][0]["workers"][0]
            return w["healthy"] and w["process"]["restarts"] == 1 and w["process"]["pid"] != pid

        wait_for(router, "the worker restarted and passed its health check", back, 30)
        resp = httpx.post(router.base_url + "/v1/responses", json={"model": "m", "input": "after the crash"}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert health(router)["pools"][0]["workers"][0]["circuit"] == "closed"
        # The operator's log tells the story once, however many probes and calls saw the pool down.
        wait_for(router, "the pool's recovery logged", lambda: "pool sim: serving again" in router.log(), 10)
        log = router.log()
        assert log.count("pool sim: down: ") == 1 and log.count("pool sim: serving again, ok (1 of 1 workers available)") == 1, log
        assert log.index("pool sim: down: ") < log.index("pool sim: serving again")
        assert log.count("marked down") >= 1 and "exited with code -9" in log, log
        assert log.rindex("starting on") > log.index("exited with code -9"), log  # the restart
        assert f"worker {worker['url']} healthy" in log[log.index("exited with code -9"):], log
    finally:
        assert router.stop() == 0


def test_a_worker_back_from_a_restart_gets_its_trial_without_waiting_out_the_cooldown(tmp_path: Path) -> None:
    """Its circuit open for 10 s (opened, then a failed trial), the worker is killed and restarted:
    its first passing health check half-opens the circuit, and the next request is the trial."""
    router = start_router(tmp_path, sim_pool_toml(replicas=1) + MODELS)
    try:
        with httpx.Client(base_url=router.base_url, timeout=30) as http:
            def drop() -> None:  # the worker closes the connection before answering: its fault
                assert http.post("/v1/responses", json={"model": "m", "input": "[sim:drop_after=0]"}).status_code == 502

            def circuit() -> str:
                return health(router)["pools"][0]["workers"][0]["circuit"]

            for _ in range(5):
                drop()
            assert circuit() == "open"
            wait_for(router, "the circuit half-opened after its cool-down", lambda: circuit() == "half_open", 15)
            drop()  # the trial fails: open again, for twice as long
            assert circuit() == "open"
            pid = health(router)["pools"][0]["workers"][0]["process"]["pid"]
            os.kill(pid, signal.SIGKILL)

            def back() -> bool:
                w = health(router)["pools"][0]["workers"][0]
                return w["healthy"] and w["process"]["restarts"] == 1

            wait_for(router, "the worker restarted and passed its health check", back, 30)
            assert circuit() == "half_open", router.log()[-4000:]
            assert http.post("/v1/responses", json={"model": "m", "input": "the trial"}).status_code == 200
            assert circuit() == "closed"
    finally:
        assert router.stop() == 0
