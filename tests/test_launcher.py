"""Managed workers: started by the router, reported in /health, never orphaned."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.procs import http_status, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

MODELS = '\n[[models]]\nname = "chat"\npool = "sim"\n'


def worker_urls(base_url: str) -> list[str]:
    with urllib.request.urlopen(base_url + "/health") as resp:
        return [w["url"] for w in json.loads(resp.read())["pools"][0]["workers"]]


def pid_on(url: str) -> int:
    """The sim worker process serving ``url``, found through /proc (no pgrep needed)."""
    port = url.rsplit(":", 1)[1]
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"backends.sim" in argv and argv[argv.index(b"--port") + 1 : argv.index(b"--port") + 2] == [port.encode()]:
            pids.append(int(entry.name))
    assert len(pids) == 1, f"expected one worker on port {port}, found {pids}"
    return pids[0]


def wait_until(predicate, timeout: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_sigterm_stops_the_workers(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml() + MODELS)
    urls = worker_urls(router.base_url)
    assert len(urls) == 2 and all(http_status(u + "/health") == 200 for u in urls)
    assert (tmp_path / "logs" / "sim-0.log").exists()
    assert router.stop() == 0
    assert all(http_status(u + "/health") is None for u in urls), "workers still answer after the router stopped"


def test_sigkill_of_the_router_leaves_no_orphans(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml() + MODELS)
    urls = worker_urls(router.base_url)
    pids = [pid_on(u) for u in urls]
    os.kill(router.proc.pid, signal.SIGKILL)
    router.proc.wait()
    assert wait_until(lambda: all(not _alive(p) for p in pids)), "worker processes outlived a SIGKILLed router"


def test_a_dead_worker_is_reported_avoided_and_restarted(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml() + MODELS)
    try:
        urls = worker_urls(router.base_url)
        os.kill(pid_on(urls[0]), signal.SIGKILL)

        def reported() -> bool:
            with urllib.request.urlopen(router.base_url + "/health") as resp:
                pool = json.loads(resp.read())["pools"][0]
            return pool["healthy_workers"] == 1 and pool["status"] == "degraded"

        assert wait_until(reported)
        import openai

        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        for i in range(4):
            assert client.responses.create(model="chat", input=f"still served {i}").status == "completed"
        assert "exited with code" in router.log()

        def restarted() -> bool:  # the supervisor brings it back after a backoff
            with urllib.request.urlopen(router.base_url + "/health") as resp:
                pool = json.loads(resp.read())["pools"][0]
            dead = next(w for w in pool["workers"] if w["url"] == urls[0])
            return pool["healthy_workers"] == 2 and dead["process"]["restarts"] == 1 and dead["process"]["state"] == "ready"

        assert wait_until(restarted), router.log()
        assert pid_on(urls[0]) > 0
    finally:
        assert router.stop() == 0


def test_a_worker_that_cannot_start_stops_start_up(tmp_path: Path) -> None:
    body = sim_pool_toml(replicas=1, extra_args='["--no-such-flag"]') + MODELS
    router = start_router(tmp_path, body, wait=False)
    code = router.proc.wait(timeout=60)
    assert code == 1
    lines = [line for line in router.log().splitlines() if line.startswith("responses-router:")]
    assert len(lines) == 1 and "exited with code 2 while starting" in lines[0] and "sim-0.log" in lines[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose: it holds no port and runs no code.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_gpus_are_split_between_replicas(tmp_path: Path) -> None:
    body = sim_pool_toml().replace("replicas = 2", "replicas = 2\ngpus = [0, 1, 2, 3]") + MODELS
    router = start_router(tmp_path, body)
    try:
        seen = []
        for url in worker_urls(router.base_url):
            environ = Path(f"/proc/{pid_on(url)}/environ").read_bytes().split(b"\0")
            seen.append(next(v for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES=")).split(b"=", 1)[1].decode())
        assert sorted(seen) == ["0,1", "2,3"]
    finally:
        assert router.stop() == 0


def test_engine_queue_length_is_scraped_into_the_load(tmp_path: Path) -> None:
    import threading

    import openai

    body = (sim_pool_toml(replicas=1, extra_args='["--max-concurrency", "1"]')
            .replace("health_interval_s = 0.5", "health_interval_s = 0.2\nscrape_metrics = true") + MODELS)
    router = start_router(tmp_path, body)
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    threads = [threading.Thread(target=lambda: client.responses.create(model="chat", input="[sim:tokens=40] [sim:itl_ms=50]"))
               for _ in range(3)]
    try:
        for t in threads:
            t.start()

        def queued() -> bool:  # one generates, the others wait inside the engine
            with urllib.request.urlopen(router.base_url + "/health") as resp:
                return json.loads(resp.read())["pools"][0]["workers"][0]["waiting"] >= 1

        assert wait_until(queued, 15)
    finally:
        for t in threads:
            t.join()
        assert router.stop() == 0


def test_a_crash_loop_ends_once_the_worker_stays_up() -> None:
    """/health's crash_loop: three crashes in a row, until the worker has been up STABLE_S (it
    stayed true for ever before, the count starting over only at a next crash)."""
    from backends.launcher import STABLE_S, ManagedWorker, WorkerSpec

    worker = ManagedWorker(spec=WorkerSpec(engine="sim", model="m", command=[]), port=1, label="w")
    assert not worker.crash_looping
    worker.crashes_in_a_row, worker.state = 3, "backoff"
    assert worker.crash_looping and worker.describe()["crash_loop"] is True
    worker.state, worker._started_at = "ready", time.monotonic()  # just back up: not yet out of it
    assert worker.crash_looping
    worker._started_at = time.monotonic() - STABLE_S - 1
    assert not worker.crash_looping and worker.describe()["crash_loop"] is False
