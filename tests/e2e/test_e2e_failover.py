"""Before the first byte, a failing worker is retried elsewhere; 429/503 is backpressure; circuits open.

A 5xx answer counts against a worker only when another worker serves the same request; more
on whose fault a failure is, and crashes: tests/e2e/test_e2e_breaker.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from aiohttp import web

from harness import ROOT, RouterProcess, free_port, http_status, start_router

pytestmark = pytest.mark.e2e


class BadWorker:
    """A worker that is healthy and lists the model, but answers every generation with ``status``
    (0: closes the connection without answering, as a crashing or overloaded server does) and an
    error body of type ``kind``."""

    def __init__(self, status: int, kind: str = "x") -> None:
        self.status = status
        self.kind = kind
        self.port = free_port()
        self.calls = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim-model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.status == 0:
            assert request.transport is not None
            request.transport.abort()
            raise ConnectionResetError("dropped on purpose")
        return web.json_response({"error": {"message": "simulated", "type": self.kind, "param": None,
                                             "code": self.status}}, status=self.status)

    def __enter__(self) -> BadWorker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture(scope="module")
def good_sim() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "backends.sim", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while http_status(f"http://127.0.0.1:{port}/health") != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    proc.kill()


def router_with(tmp: Path, bad: BadWorker, good: str) -> RouterProcess:
    body = f"""
[[pools]]
name = "p"
engine = "sim"
model = "sim-model"
policy = "round_robin"
urls = ["http://127.0.0.1:{bad.port}", "{good}"]
[[models]]
name = "m"
pool = "p"
"""
    return start_router(tmp, body)


@contextmanager
def pool_of(tmp: Path, status: int, good: str) -> Iterator[tuple[BadWorker, RouterProcess, openai.OpenAI]]:
    """A round-robin pool of a ``BadWorker(status)`` and the good sim, the router in front, an SDK client."""
    with BadWorker(status) as bad:
        router = router_with(tmp, bad, good)
        try:
            yield bad, router, openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        finally:
            assert router.stop() == 0


def worker_state(router: RouterProcess, port: int) -> dict:
    with urllib.request.urlopen(router.base_url + "/health") as resp:
        workers = json.loads(resp.read())["pools"][0]["workers"]
    return next(w for w in workers if w["url"].endswith(f":{port}"))


@pytest.mark.parametrize(("status", "why"), [(500, "500"), (0, "connection closed")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_worker_is_retried_elsewhere_and_its_circuit_opens(tmp_path: Path, good_sim: str, stream: bool,
                                                                     status: int, why: str) -> None:
    with pool_of(tmp_path, status, good_sim) as (bad, router, client):
        for i in range(12):
            if stream:
                with client.responses.stream(model="m", input=f"hi {i}") as s:
                    assert s.get_final_response().status == "completed"
            else:
                assert client.responses.create(model="m", input=f"hi {i}").status == "completed"
        state = worker_state(router, bad.port)
        assert state["circuit"] == "open" and why in state["last_error"]
        with urllib.request.urlopen(router.base_url + "/health") as resp:
            health = json.loads(resp.read())
        pool = health["pools"][0]  # both answer health checks; one takes no requests now
        assert health["status"] == "degraded" and pool["healthy_workers"] == 2 and pool["available_workers"] == 1
        calls = bad.calls
        assert calls >= 5
        for i in range(5):  # while open, nothing is sent to it
            client.responses.create(model="m", input=f"more {i}")
        assert bad.calls == calls


def test_health_says_down_while_every_circuit_is_open(tmp_path: Path) -> None:
    """Health checks pass, calls fail (the connection closes before an answer): once the only
    worker's circuit opens, /health is a 503 (a load balancer in front stops sending), not an "ok"
    over a router that answers every create 503; both say it is the circuit, not the workers' health."""
    with BadWorker(0) as bad:
        router = start_router(tmp_path, f'[[pools]]\nname = "p"\nengine = "sim"\nmodel = "sim-model"\n'
                                        f'urls = ["http://127.0.0.1:{bad.port}"]\n[[models]]\nname = "m"\npool = "p"\n')
        try:
            client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
            for i in range(5):  # one call each (no other worker to retry on): five open the circuit
                with pytest.raises(openai.APIStatusError) as failed:
                    client.responses.create(model="m", input=f"hi {i}")
                assert failed.value.status_code == 502
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(router.base_url + "/health")
            assert err.value.code == 503
            health = json.loads(err.value.read())
            assert health["status"] == "down" and health["pools"][0]["available_workers"] == 0
            assert health["pools"][0]["healthy_workers"] == 1 and health["pools"][0]["workers"][0]["circuit"] == "open"
            assert health["reason"] == health["pools"][0]["reason"] == "circuit open on all workers"
            calls = bad.calls
            for shut in (lambda: client.responses.create(model="m", input="while open"),
                         lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])):
                with pytest.raises(openai.APIStatusError) as refused:
                    shut()
                assert refused.value.status_code == 503 and refused.value.code == "circuit_open"
                assert "circuit open on all workers" in refused.value.message
            assert bad.calls == calls
        finally:
            assert router.stop() == 0


def test_an_error_every_worker_calls_a_bad_request_is_a_400_against_no_worker(tmp_path: Path) -> None:
    """Both workers answer 500 with an error the engine types as a bad request: the client gets a
    400 that names it, after two calls, and neither worker's circuit moves."""
    with BadWorker(500, "BadRequestError") as one, BadWorker(500, "BadRequestError") as two:
        router = start_router(tmp_path, f'[[pools]]\nname = "p"\nengine = "sim"\nmodel = "sim-model"\n'
                                        f'urls = ["http://127.0.0.1:{one.port}", "http://127.0.0.1:{two.port}"]\n'
                                        '[[models]]\nname = "m"\npool = "p"\n')
        try:
            client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
            for i in range(8):
                with pytest.raises(openai.BadRequestError) as rejected:
                    client.responses.create(model="m", input=f"poison {i}")
                assert rejected.value.code == "upstream_rejected" and "simulated" in rejected.value.message
            assert one.calls + two.calls == 16
            assert worker_state(router, one.port)["circuit"] == worker_state(router, two.port)["circuit"] == "closed"
        finally:
            assert router.stop() == 0


def test_the_passthrough_skips_a_worker_that_drops_the_connection(tmp_path: Path, good_sim: str) -> None:
    with pool_of(tmp_path, 0, good_sim) as (bad, router, client):
        for i in range(8):
            for stream in (False, True):
                answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"hi {i}"}],
                                                        stream=stream)
                text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream \
                    else answer.choices[0].message.content
                assert text
        assert bad.calls >= 3
        assert "connection closed" in worker_state(router, bad.port)["last_error"]


def test_backpressure_goes_elsewhere_without_blame(tmp_path: Path, good_sim: str) -> None:
    with pool_of(tmp_path, 429, good_sim) as (busy, router, client):
        for i in range(10):
            assert client.responses.create(model="m", input=f"hi {i}").status == "completed"
        assert busy.calls >= 3
        assert worker_state(router, busy.port)["circuit"] == "closed"  # 429 is not the worker's fault


def test_the_passthrough_relays_a_5xx_as_it_came_and_counts_it_neither_way(tmp_path: Path, good_sim: str) -> None:
    """The passthrough cannot read its body's meaning: a 5xx goes back as the worker sent it, after
    one call, and moves no circuit (the Responses turn would retry it and blame by the next outcome)."""
    with pool_of(tmp_path, 500, good_sim) as (bad, router, _):
        statuses = []
        for i in range(6):
            request = urllib.request.Request(router.base_url + "/v1/chat/completions", method="POST",
                                             data=json.dumps({"model": "m", "messages": [
                                                 {"role": "user", "content": f"hi {i}"}]}).encode(),
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request) as resp:
                    statuses.append(resp.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
                assert json.loads(exc.read())["error"]["message"] == "simulated"  # the worker's own body
        assert sorted(set(statuses)) == [200, 500] and bad.calls == statuses.count(500)
        state = worker_state(router, bad.port)
        assert state["circuit"] == "closed" and state["in_flight"] == 0
