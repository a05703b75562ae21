"""A pool's KV-event index through a real router process: managed sim workers started publishing
(the router's own sockets), an external one found through its /kv_event_sources, and one that
publishes nothing (its requests still served; routing for it by load alone)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness import RouterProcess, free_port, sim_pool_toml, start_router
from tests.support.sim_proc import Sim
from tests.support.waits import wait_until

pytestmark = pytest.mark.e2e

LONG = " ".join(f"word{i}" for i in range(80))  # several 16-token blocks


def _workers(router: RouterProcess) -> dict[str, dict]:
    health = httpx.get(router.base_url + "/health", timeout=10).json()
    return {w["url"]: w for p in health["pools"] for w in p["workers"]}


def _create(router: RouterProcess, model: str, text: str) -> httpx.Response:
    resp = httpx.post(router.base_url + "/v1/responses", json={"model": model, "input": text}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


@pytest.fixture(scope="module")
def external() -> Iterator[Sim]:
    port, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    worker = Sim("--kv-cache-blocks", "256", "--kv-events-config", json.dumps(config))
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def silent() -> Iterator[Sim]:
    worker = Sim("--kv-cache-blocks", "256")  # caches, publishes nothing, has no /kv_event_sources
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, external: Sim, silent: Sim) -> Iterator[RouterProcess]:
    body = (sim_pool_toml(name="managed", replicas=2) + "[pools.kv_events]\nenabled = true\n"
            + f'''
[[pools]]
name = "attached"
engine = "sim"
model = "sim-model"
urls = ["http://127.0.0.1:{external.port}", "http://127.0.0.1:{silent.port}"]
health_interval_s = 0.5
[pools.kv_events]
enabled = true

[[models]]
name = "m"
pool = "managed"
[[models]]
name = "a"
pool = "attached"
''')
    proc = start_router(tmp_path_factory.mktemp("kv-events"), body)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def test_a_managed_worker_publishes_and_the_router_indexes_what_it_cached(router: RouterProcess) -> None:
    served = _create(router, "m", LONG).headers["x-router-worker"]
    held = wait_until(lambda: _workers(router)[served]["kv_events"]["blocks"], 15, "the served worker's blocks indexed")
    assert held >= 4
    worker = _workers(router)[served]["kv_events"]
    assert worker["messages"] >= 1 and worker["gaps"] == 0 and worker["bad"] == 0
    assert f"indexing the KV cache of {served} from ipc://" in router.log()


def test_external_workers_are_found_through_kv_event_sources_or_go_without(router: RouterProcess, external: Sim,
                                                                           silent: Sim) -> None:
    ext, quiet = f"http://127.0.0.1:{external.port}", f"http://127.0.0.1:{silent.port}"
    seen = set()
    deadline = time.monotonic() + 30
    while seen != {ext, quiet} and time.monotonic() < deadline:  # both workers serve, events or not
        seen.add(_create(router, "a", f"{LONG} {len(seen)}").headers["x-router-worker"])
    assert seen == {ext, quiet}
    wait_until(lambda: _workers(router)[ext]["kv_events"]["blocks"], 15, "the external worker's blocks indexed")
    assert _workers(router)[quiet]["kv_events"] == {"blocks": 0, "messages": 0, "gaps": 0, "bad": 0}
    assert f"{quiet} reports no KV events" in router.log()


def test_the_sockets_go_with_the_router(tmp_path: Path) -> None:
    proc = start_router(tmp_path, sim_pool_toml(replicas=1) + "[pools.kv_events]\nenabled = true\n"
                        + '\n[[models]]\nname = "m"\npool = "sim"\n')
    try:
        served = _create(proc, "m", LONG).headers["x-router-worker"]
        wait_until(lambda: _workers(proc)[served]["kv_events"]["blocks"], 15, "blocks indexed")
        folders = list(Path("/tmp").glob("responses-router-kv-*"))
        assert any((folder / f"kv-{served.rsplit(':', 1)[1]}").exists() for folder in folders)
    finally:
        assert proc.stop() == 0
    assert not any((folder / f"kv-{served.rsplit(':', 1)[1]}").exists() for folder in folders)


def test_a_restarted_worker_starts_empty_and_is_indexed_again(router: RouterProcess) -> None:
    served = _create(router, "m", LONG + " before").headers["x-router-worker"]
    wait_until(lambda: _workers(router)[served]["kv_events"]["blocks"], 15, "its blocks indexed")
    pid = _workers(router)[served]["process"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: (w := _workers(router)[served])["healthy"] and w["process"]["pid"] != pid, 60, "the worker restarted")
    wait_until(lambda: _workers(router)[served]["kv_events"]["blocks"] == 0, 15, "its old entries dropped")
    for i in range(20):  # the restarted engine's new events reach the index over the same socket
        if _create(router, "m", f"{LONG} after {i}").headers["x-router-worker"] == served:
            break
    wait_until(lambda: _workers(router)[served]["kv_events"]["blocks"], 15, "its new blocks indexed")
