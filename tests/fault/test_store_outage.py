"""PostgreSQL going away under two router replicas, with requests in flight on both.

The server is the test's own (tests/support/pg.py ``PgServer``: initdb, its own port), restarted and
stopped with pg_ctl. A restart (``-m fast``: every session ended, well under a second down) is
invisible: streams, JSON requests and background responses running on both replicas, and requests
sent as it goes down, all finish normally and are stored completed, retrievable from the other
replica. An outage longer than ``[store] retry_s`` is said, never cut: a stream ends with
``error`` + ``response.failed``, a JSON request gets 503 ``store_unavailable``, ``/health`` says
the store is down; once the server is back the router serves again, and what could not be stored
is stored failed for that reason (not as abandoned by a router that stopped).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import RouterProcess, sim_pool_toml, start_router
from tests.support.pg import PgServer, pg_server  # noqa: F401 - the fixture
from tests.support.streamrules import check_stream, text_of

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"
SLOW = "[sim:tokens=200] [sim:itl_ms=20]"  # ~4 s of tokens: running across the restart or the outage
QUICK = "[sim:tokens=5]"
WAIT_S = 60.0  # any request here ends well before this; a hung one fails the test instead of hanging it


def replica(tmp: Path, dsn: str, *, retry_s: float | None = None) -> RouterProcess:
    """A router on ``dsn`` with one sim worker; leases of 2 s, so a sweep after the outage would
    catch a lease the outage kept from being renewed."""
    retry = f"retry_s = {retry_s}\n" if retry_s is not None else ""
    store = f'[store]\nkind = "postgres"\ndsn = "{dsn}"\n{retry}[background]\nlease_s = 2.0\n'
    body = sim_pool_toml(model=MODEL, replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    return start_router(tmp, body, store=store)


@pytest.fixture
def pair(tmp_path: Path, pg_server: PgServer, request: pytest.FixtureRequest) -> Iterator[tuple[RouterProcess, RouterProcess]]:  # noqa: F811
    retry_s = getattr(request, "param", None)
    a = replica(tmp_path / "a", pg_server.dsn, retry_s=retry_s)
    b = replica(tmp_path / "b", pg_server.dsn, retry_s=retry_s)
    yield a, b
    assert a.stop() == 0, a.log()[-3000:]
    assert b.stop() == 0, b.log()[-3000:]


class Stream(threading.Thread):
    """A streamed ``store: true`` create: its status, every event, and whether [DONE] ended it."""

    def __init__(self, router: RouterProcess, text: str) -> None:
        super().__init__(daemon=True)
        self.url = router.base_url + "/v1/responses"
        self.text = text
        self.status: int | None = None
        self.events: list[dict[str, Any]] = []
        self.done = False
        self.error: BaseException | None = None
        self.deltas = threading.Event()  # set once tokens flow

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json={"model": MODEL, "input": self.text, "stream": True},
                              timeout=WAIT_S) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        if self.events[-1]["type"] == "response.output_text.delta":
                            self.deltas.set()
                    elif line == "data: [DONE]":
                        self.done = True
        except httpx.HTTPError as exc:  # a cut connection: what the test must never see
            self.error = exc

    def ended(self) -> dict[str, Any]:
        """The terminal event's response, after checking the stream whole and ended properly."""
        self.join(WAIT_S)
        assert self.error is None, f"the stream was cut: {self.error!r}"
        assert self.status == 200 and self.done, (self.status, self.events[-3:])
        return check_stream(self.events)


class Call(threading.Thread):
    """A JSON create: its status and body."""

    def __init__(self, router: RouterProcess, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url = router.base_url + "/v1/responses"
        self.body = {"model": MODEL, **body}
        self.status: int | None = None
        self.answer: dict[str, Any] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            resp = httpx.post(self.url, json=self.body, timeout=WAIT_S)
            self.status, self.answer = resp.status_code, resp.json()
        except httpx.HTTPError as exc:
            self.error = exc

    def result(self) -> tuple[int | None, dict[str, Any]]:
        self.join(WAIT_S)
        assert self.error is None, f"the request failed: {self.error!r}"
        return self.status, self.answer


def started(threads: list[Any]) -> list[Any]:
    for thread in threads:
        thread.start()
    return threads


def get(router: RouterProcess, rid: str, *, missing: bool = False) -> dict[str, Any]:
    """The stored response; ``missing``: a 404 is ``{"status": None}`` (not stored yet)."""
    resp = httpx.get(f"{router.base_url}/v1/responses/{rid}", timeout=WAIT_S)
    if missing and resp.status_code == 404:
        return {"status": None}
    assert resp.status_code == 200, (resp.status_code, resp.text)
    return resp.json()


def until_status(router: RouterProcess, rid: str, statuses: set[str], *, missing: bool = False) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        body = get(router, rid, missing=missing)
        if body["status"] in statuses:
            return body
        time.sleep(0.1)
    raise AssertionError(f"{rid} is still {body['status']}, not {statuses}")


def health(router: RouterProcess) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(router.base_url + "/health", timeout=WAIT_S)
    return resp.status_code, resp.json()


def test_a_restart_is_invisible_to_streams_json_and_background_responses(pair, pg_server: PgServer) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    a, b = pair
    other = {a.port: b, b.port: a}
    background = [(router, create(router, {"input": SLOW, "background": True})[1]["id"]) for router in pair for _ in range(2)]
    streams = [(router, Stream(router, SLOW)) for router in pair for _ in range(2)]
    calls = [(router, Call(router, {"input": "[sim:tokens=100] [sim:itl_ms=20]"})) for router in pair for _ in range(2)]
    started([s for _, s in streams] + [c for _, c in calls])
    for _, stream in streams:
        assert stream.deltas.wait(WAIT_S), stream.events
    for router, rid in background:
        until_status(other[router.port], rid, {"in_progress"})
    # Sent as the server goes down: their store calls meet it down, or just back.
    during = started([(Call(router, {"input": QUICK})) for router in pair for _ in range(3)])
    pg_server.restart()
    during += started([(Call(router, {"input": QUICK})) for router in pair for _ in range(3)])

    for router, stream in streams:
        final = stream.ended()
        assert final["status"] == "completed" and len(text_of(final).split()) == 200
        stored = get(other[router.port], final["id"])
        assert stored["status"] == "completed" and text_of(stored) == text_of(final)
    for router, call in calls:
        status, body = call.result()
        assert status == 200 and body["status"] == "completed", body
        assert get(other[router.port], body["id"])["output"] == body["output"]
    for call in during:
        status, body = call.result()
        assert status == 200 and body["status"] == "completed", body
        assert get(a, body["id"])["status"] == get(b, body["id"])["status"] == "completed"
    for router, rid in background:
        done = until_status(other[router.port], rid, {"completed", "failed", "incomplete", "cancelled"})
        assert done["status"] == "completed", done.get("error")
        assert len(text_of(done).split()) == 200
        check_stream(replayed(other[router.port], rid))  # its log is whole: nothing lost to the restart
    for router in pair:
        status, body = health(router)
        assert status == 200 and body["status"] == "ok" and body["store"] == {"ok": True}, body


def test_an_outage_longer_than_a_lease_fails_nothing_that_runs(pair, pg_server: PgServer) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Down for two leases (2 s each), well within the retry budget: no lease is renewed meanwhile,
    yet the other replica's sweep fails none of them once the server is back: it waits until the
    server has answered for a lease, and the replica running them renews them first."""
    a, b = pair
    background = create(a, {"input": "[sim:tokens=300] [sim:itl_ms=20]", "background": True})[1]["id"]
    stream = Stream(a, SLOW)
    stream.start()
    assert stream.deltas.wait(WAIT_S), stream.events
    until_status(b, background, {"in_progress"})
    pg_server.stop()
    time.sleep(4.0)  # down for two leases: the outage's length is what is tested
    pg_server.start()
    done = until_status(b, background, {"completed", "failed", "incomplete", "cancelled"})  # the first end seen
    assert done["status"] == "completed", done.get("error")
    final = stream.ended()
    assert final["status"] == "completed" and get(b, final["id"])["status"] == "completed"
    check_stream(replayed(b, background))
    log = a.log()  # the operator reads the outage in the log: once as it starts, once as it ends
    assert log.count(" unreachable (") == 1 and log.count(" reachable again after ") == 1, log[-4000:]
    assert log.index(" unreachable (") < log.index(" reachable again after ")


@pytest.mark.parametrize("pair", [2], indirect=True)  # [store] retry_s = 2
def test_an_outage_past_the_retry_budget_is_said_and_the_router_serves_again(pair, pg_server: PgServer) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    a, b = pair
    background = create(a, {"input": SLOW, "background": True})[1]["id"]
    stream = Stream(a, SLOW)
    stream.start()
    call = Call(a, {"input": "[sim:tokens=100] [sim:itl_ms=20]"})  # answered during the outage
    call.start()
    assert stream.deltas.wait(WAIT_S), stream.events
    until_status(b, background, {"in_progress"})
    pg_server.stop()

    final = stream.ended()  # its tokens keep coming; its end cannot be stored
    assert [e["type"] for e in stream.events[-2:]] == ["error", "response.failed"]
    assert stream.events[-2]["code"] == "store_unavailable"
    assert final["status"] == "failed" and len(text_of(final).split()) == 200
    status, body = call.result()
    assert status == 503 and body["error"]["code"] == "store_unavailable", body
    late = Stream(b, QUICK)  # a new stream: it cannot even be stored as it starts
    late.start()
    assert late.ended()["status"] == "failed" and late.events[-2]["code"] == "store_unavailable"
    for router in pair:
        status, body = create(router, {"input": QUICK})
        assert status == 503 and body["error"]["code"] == "store_unavailable", body
        status, body = create(router, {"input": QUICK, "store": False})  # needs no store: served
        assert status == 200 and body["status"] == "completed", body
        status, body = health(router)
        assert status == 200 and body["status"] == "degraded" and body["store"]["ok"] is False, body
    # What the store could not keep is counted failed, never completed: on router a, only the
    # store: false answer completed (the 503s and the failed stream are store_unavailable errors).
    metrics = httpx.get(a.base_url + "/metrics", timeout=WAIT_S).text.splitlines()
    counted = {status: sum(float(line.rsplit(" ", 1)[1]) for line in metrics
                           if line.startswith("responses_router_requests_total{") and f'status="{status}"' in line)
               for status in ("completed", "failed")}
    assert counted["completed"] == 1 and counted["failed"] >= 3, counted
    assert any(line.startswith("responses_router_errors_total{") and 'kind="store_unavailable"' in line for line in metrics)

    pg_server.start()
    for router in pair:  # serves again as soon as the server answers (a new connection per call)
        status, body = create(router, {"input": QUICK})
        assert status == 200 and body["status"] == "completed", body
        assert health(router)[1]["store"] == {"ok": True}
    # What could not be stored is, now: failed, for the store, on either replica (the late stream,
    # never stored as it started, only once its replica stores its end: a 404 until then).
    for rid in (final["id"], late.events[0]["response"]["id"], background):
        for router in pair:
            stored = until_status(router, rid, {"failed", "completed"}, missing=True)
            assert stored["status"] == "failed" and "store" in stored["error"]["message"], stored["error"]
    events = replayed(b, background)  # its log is whole, and says why it ended
    assert check_stream(events)["status"] == "failed"
    assert events[-2]["type"] == "error" and events[-2]["code"] == "store_unavailable"


def replayed(router: RouterProcess, rid: str) -> list[dict[str, Any]]:
    """A background response's events, replayed from its log."""
    resp = httpx.get(f"{router.base_url}/v1/responses/{rid}", params={"stream": "true"}, timeout=WAIT_S)
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]


def create(router: RouterProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = httpx.post(router.base_url + "/v1/responses", json={"model": MODEL, **body}, timeout=WAIT_S)
    return resp.status_code, resp.json()
