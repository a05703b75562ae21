"""Two router replicas sharing one key's budget through Redis ([limits.shared],
router/limits/shared.py), each with a managed sim worker of its own, driven as fast as client
threads can send.

Shared, the replicas together admit the key's requests per minute in a wall-clock window, not
each its own. Redis going away under traffic (a server of the test's own, killed) costs no
request: both replicas go on answering from their own windows, and each says so once in its log.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from harness import RouterProcess, sim_pool_toml, start_router
from tests.unit.test_shared_budgets import RedisServer

pytestmark = pytest.mark.e2e

KEY = "sk-limits-replicas-key-1"
MACHINE_REDIS = "redis://127.0.0.1:6379"
THREADS = 3  # client threads per replica: more only queue on a 2-core machine
UNREACHABLE = "the shared budget service is unreachable"


@contextmanager
def replicas(tmp: Path, redis_url: str, *, rpm: int, lease_fraction: float = 0.05,
             retry_s: float = 5.0) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    """Two routers, each with one sim worker, one key limited to ``rpm`` on a budget they share
    (a key prefix of their own on ``redis_url``, whose keys are deleted after)."""
    prefix = f"rr-fault-{uuid.uuid4().hex[:12]}"
    body = sim_pool_toml(replicas=1) + f"""
[auth]
keys = [{{name = "shared", key = "{KEY}", limits = {{requests_per_minute = {rpm}}}}}]

[limits.shared]
redis_url = "{redis_url}"
key_prefix = "{prefix}"
lease_fraction = {lease_fraction}
retry_s = {retry_s}

[[models]]
name = "m"
pool = "sim"
"""
    a = start_router(tmp / "a", body)
    try:
        b = start_router(tmp / "b", body)
    except BaseException:
        a.stop()
        raise
    try:
        yield a, b
    finally:
        codes = a.stop(), b.stop()
        assert codes == (0, 0), (a.log()[-3000:], b.log()[-3000:])
        if redis_url == MACHINE_REDIS:
            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(match=f"{prefix}:*"):
                client.delete(key)
            client.close()


class Traffic:
    """Client threads sending small creates to each router until ``stop``; every answer's status
    (0: no answer) per router, and when it came (``time.monotonic``)."""

    def __init__(self, routers: Sequence[RouterProcess], threads: int) -> None:
        self.answers: list[list[tuple[float, int]]] = [[] for _ in routers]
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(router, self.answers[i]), daemon=True)
                         for i, router in enumerate(routers) for _ in range(threads)]

    def _send(self, router: RouterProcess, into: list[tuple[float, int]]) -> None:
        body = {"model": "m", "input": "[sim:tokens=1]", "max_output_tokens": 1}
        with httpx.Client(base_url=router.base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as client:
            while not self._stopping.is_set():
                try:
                    status = client.post("/v1/responses", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                into.append((time.monotonic(), status))  # list.append: one at a time under the GIL

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self._threads), "a client thread hung"

    def statuses(self, router: int, since: float = 0.0) -> Counter[int]:
        return Counter(status for at, status in self.answers[router] if at >= since)


def after_a_minute_boundary() -> None:
    """The windows are wall-clock minutes: start the traffic just as one begins, so it all falls
    in one window (whose previous one, on a fresh prefix, holds nothing)."""
    into = time.time() % 60
    if into >= 1:
        time.sleep(60 - into + 0.05)


def test_two_replicas_admit_one_limit_together(tmp_path: Path) -> None:
    """600 requests per minute between two replicas sending as fast as they can for the first
    10 s of a window (the budget is spent in the first few; the rest of the window would only
    see refusals): 600 answered 200 in all, within 10%, some on each, everything else 429."""
    with replicas(tmp_path, MACHINE_REDIS, rpm=600) as (a, b):
        after_a_minute_boundary()
        window = int(time.time() // 60)
        traffic = Traffic([a, b], THREADS)
        traffic.start()
        time.sleep(10)
        traffic.stop()
        assert int(time.time() // 60) == window, "the traffic ran into the next window"
        first, second = traffic.statuses(0), traffic.statuses(1)
        assert set(first) | set(second) <= {200, 429}, (first, second)
        assert first[200] > 0 and second[200] > 0, (first, second)
        assert 540 <= first[200] + second[200] <= 660, (first, second)
        assert first[429] > 0 and second[429] > 0  # both were still sending once it was spent
        assert UNREACHABLE not in a.log() + b.log()


def test_redis_going_away_under_traffic_costs_no_request(tmp_path: Path) -> None:
    """A limit no traffic here reaches, leased 100 at a time so the replicas claim often. The
    server is killed 2 s in; for the 4 s after, both replicas answer every request 200 from their
    own windows, and each logs the outage once (it stays away: tried again every 0.5 s, unsaid)."""
    server = RedisServer()
    server.start()
    try:
        with replicas(tmp_path, server.url, rpm=100_000, lease_fraction=0.001, retry_s=0.5) as (a, b):
            traffic = Traffic([a, b], THREADS)
            traffic.start()
            time.sleep(2)
            server.kill()
            killed = time.monotonic()
            time.sleep(4)
            traffic.stop()
            for i, router in enumerate((a, b)):
                before, after = traffic.statuses(i), traffic.statuses(i, since=killed)
                assert set(before) == {200}, (router.name, before, router.log_tail())
                assert after[200] > 0, (after, router.log_tail())
                assert router.log().count(UNREACHABLE) == 1, router.log_tail()
                assert "budget service is back" not in router.log()
    finally:
        server.kill()
