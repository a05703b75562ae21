"""The worker call (backends/calls.py) at its boundaries: which worker it picks, what it counts in
flight and releases on every way out (cancellation included), what it retries (only before the
answer began), and whose fault each failure is.

Most tests drive it with a fake ``send`` over a pool of fake workers (no network); the last ones
with real sim workers (in this process) over the real wire. End to end, through the router:
tests/e2e/test_e2e_failover.py and tests/e2e/test_e2e_breaker.py.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from backends import calls
from backends.breaker import CIRCUIT_FAILURES
from backends.calls import AMBIGUOUS, BUSY, IDLE, REQUESTS, RETRY_ATTEMPTS, UNREACHABLE, WORKERS, classify
from backends.engines import ENGINES
from backends.errors import (
    NoHealthyWorker,
    WorkerAnswerTooLarge,
    WorkerError,
    WorkerHTTPError,
    WorkerIdleClosed,
    WorkerRequestFailed,
    WorkerStreamBroken,
    WorkerStreamError,
    WorkerTimedOut,
    WorkerUnavailable,
)
from backends.pools import Pool
from backends.worker import Worker
from policies.balance import make_balancer
from tests.support.waits import async_wait_until

ROOT = Path(__file__).resolve().parents[2]


def pool_of(n: int, *, policy: str = "round_robin") -> Pool:
    """A pool of ``n`` healthy fake workers (no client: the tests' ``send`` stands for the wire)."""
    pool = Pool(name="p", engine=ENGINES["sim"], model="m", balancer=make_balancer(policy), client=None)  # type: ignore[arg-type]
    pool.workers = [Worker(f"http://w{i}", healthy=True) for i in range(n)]
    return pool


def counted(pool: Pool) -> list[int]:
    return [w.in_flight for w in pool.workers]


class Script:
    """A fake WorkerClient method (``fn(url, body)``, sent with the path ""): what each call does, by
    the worker's url (an exception raises, a value returns), and the in-flight counts it saw."""

    def __init__(self, pool: Pool, outcomes: dict[str, Any], default: Any = "ok") -> None:
        self.pool = pool
        self.outcomes = outcomes
        self.default = default
        self.calls: list[str] = []
        self.seen: list[list[int]] = []

    async def __call__(self, url: str, body: Any) -> Any:
        self.calls.append(url)
        self.seen.append(counted(self.pool))
        outcome = self.outcomes.get(url, self.default)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "PAUSE_S", (0.001, 0.002))


# ------------------------------------------------------------------ the classification


@pytest.mark.parametrize(("exc", "kind"), [
    (WorkerUnavailable("refused"), UNREACHABLE),
    (WorkerHTTPError(429, {}), BUSY),
    (WorkerHTTPError(503, {}), BUSY),
    (WorkerHTTPError(500, {}), AMBIGUOUS),
    (WorkerHTTPError(502, {}), AMBIGUOUS),
    (WorkerAnswerTooLarge("big"), AMBIGUOUS),
    (WorkerStreamBroken("reset"), WORKERS),
    (WorkerIdleClosed("kept-alive, nothing back"), IDLE),
    (WorkerTimedOut("no first byte"), WORKERS),
    (WorkerStreamError("engine said so"), WORKERS),
    (WorkerHTTPError(400, {}), REQUESTS),
    (WorkerHTTPError(404, {}), REQUESTS),
    (WorkerError("anything else"), REQUESTS),
])
def test_whose_fault_each_failure_is(exc: WorkerError, kind: str) -> None:
    assert classify(exc) == kind


# ------------------------------------------------------------------ picking, counting, releasing


def test_a_call_counts_its_worker_while_it_runs_and_releases_it() -> None:
    pool = pool_of(2)
    send = Script(pool, {})
    call = pool.call()
    assert run(call.send(send, "", None)) == "ok"
    assert send.seen == [[1, 0]] and counted(pool) == [0, 0]
    assert pool.workers[0].served == 1 and call.worker is None and call.last is pool.workers[0]


def test_a_held_call_keeps_its_worker_counted_until_release() -> None:
    pool = pool_of(1)
    call = pool.call()
    run(call.send(Script(pool, {}), "", None, hold=True))
    assert counted(pool) == [1] and call.worker is pool.workers[0]
    call.release()
    call.release()  # twice is once
    assert counted(pool) == [0] and pool.workers[0].served == 1


def test_a_new_call_releases_a_worker_still_held() -> None:
    pool = pool_of(2)
    call = pool.call()
    run(call.send(Script(pool, {}), "", None, hold=True))
    run(call.send(Script(pool, {}), "", None))
    assert counted(pool) == [0, 0]


def test_exclude_and_preference_reach_the_pick() -> None:
    pool = pool_of(3)
    send = Script(pool, {})
    for _ in range(4):
        run(pool.call(exclude=[pool.workers[0], pool.workers[2]]).send(send, "", None))
    assert set(send.calls) == {"http://w1"}


def test_no_worker_says_why() -> None:
    pool = pool_of(1)
    pool.workers[0].healthy = False
    with pytest.raises(NoHealthyWorker) as none:
        run(pool.call().send(Script(pool, {}), "", None))
    assert none.value.code == "no_healthy_worker"
    pool.workers[0].healthy = True
    now = time.monotonic()
    for _ in range(CIRCUIT_FAILURES):
        pool.record_failure(pool.workers[0], "x", pool.workers[0].breaker.admit(now))
    with pytest.raises(NoHealthyWorker) as shut:
        run(pool.call().send(Script(pool, {}), "", None))
    assert shut.value.code == "circuit_open"


# ------------------------------------------------------------------ retries and blame


def test_an_unreachable_worker_is_marked_down_and_the_next_one_tried_at_once() -> None:
    pool = pool_of(2)
    send = Script(pool, {"http://w0": WorkerUnavailable("refused")})
    assert run(pool.call().send(send, "", None)) == "ok"
    assert send.calls == ["http://w0", "http://w1"] and send.seen == [[1, 0], [0, 1]]
    assert not pool.workers[0].healthy and pool.workers[0].breaker.failures == 0
    assert counted(pool) == [0, 0] and pool.workers[0].served == 0 and pool.workers[1].served == 1


def test_a_worker_that_breaks_before_its_answer_is_blamed_and_the_next_one_serves() -> None:
    pool = pool_of(2)
    send = Script(pool, {"http://w0": WorkerStreamBroken("connection closed")})
    assert run(pool.call().send(send, "", None)) == "ok"
    assert pool.workers[0].breaker.failures == 1 and "connection closed" in (pool.workers[0].last_error or "")
    assert pool.workers[0].healthy and counted(pool) == [0, 0]


def test_backpressure_goes_elsewhere_without_blame() -> None:
    pool = pool_of(2)
    send = Script(pool, {"http://w0": WorkerHTTPError(429, {"error": {"message": "busy"}})})
    assert run(pool.call().send(send, "", None)) == "ok"
    assert pool.workers[0].breaker.failures == 0 and len(send.calls) == 2


def test_the_requests_fault_is_not_retried_nor_blamed() -> None:
    pool = pool_of(2)
    send = Script(pool, {}, default=WorkerHTTPError(400, {"error": {"message": "bad"}}))
    with pytest.raises(WorkerHTTPError) as bad:
        run(pool.call().send(send, "", None))
    assert bad.value.status == 400 and len(send.calls) == 1
    assert [w.breaker.failures for w in pool.workers] == [0, 0] and counted(pool) == [0, 0]


def test_a_5xx_is_blamed_only_when_another_worker_serves() -> None:
    pool = pool_of(2)
    send = Script(pool, {"http://w0": WorkerHTTPError(500, {"error": {"message": "boom"}})})
    assert run(pool.call().send(send, "", None)) == "ok"
    assert pool.workers[0].breaker.failures == 1
    assert pool.workers[0].last_error == "answered 500: boom (another worker served the request)"


def test_a_5xx_from_two_workers_is_the_requests() -> None:
    pool = pool_of(3)
    send = Script(pool, {}, default=WorkerHTTPError(500, {"error": {"message": "boom"}}))
    with pytest.raises(WorkerRequestFailed) as failed:
        run(pool.call().send(send, "", None))
    assert failed.value.workers == 2 and len(send.calls) == 2
    assert [w.breaker.failures for w in pool.workers] == [0, 0, 0] and counted(pool) == [0, 0, 0]


def test_a_5xx_in_a_pool_of_one_is_never_blamed() -> None:
    pool = pool_of(1)
    send = Script(pool, {}, default=WorkerHTTPError(500, {"error": {"message": "boom"}}))
    with pytest.raises(WorkerHTTPError) as failed:
        run(pool.call().send(send, "", None))
    assert not isinstance(failed.value, WorkerRequestFailed) and len(send.calls) == 1
    assert pool.workers[0].breaker.failures == 0


def test_at_most_three_failed_calls_then_the_last_failure() -> None:
    pool = pool_of(5)
    send = Script(pool, {}, default=WorkerStreamBroken("reset"))
    with pytest.raises(WorkerStreamBroken):
        run(pool.call().send(send, "", None))
    assert len(send.calls) == RETRY_ATTEMPTS == 3 and counted(pool) == [0] * 5


def test_a_kept_alive_connection_closed_with_nothing_back_is_a_failed_call_blaming_no_one() -> None:
    """The worker may have closed it as idle as the request went out: the same worker may serve
    the next attempt (a pool of one serves), but the attempt counts towards the three."""
    pool = pool_of(1)
    outcomes = [WorkerIdleClosed("idle"), "ok"]

    async def send(url: str, body: Any) -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert run(pool.call().send(send, "", None)) == "ok"
    assert pool.workers[0].breaker.failures == 0 and counted(pool) == [0]
    endless = Script(pool_of(5), {}, default=WorkerIdleClosed("idle"))
    with pytest.raises(WorkerIdleClosed):
        run(endless.pool.call().send(endless, "", None))
    assert len(endless.calls) == RETRY_ATTEMPTS and [w.breaker.failures for w in endless.pool.workers] == [0] * 5


def test_unreachable_workers_are_not_failed_calls() -> None:
    pool = pool_of(5)
    sent: list[str] = []

    async def send(url: str, body: Any) -> str:
        sent.append(url)
        if len(sent) < 5:
            raise WorkerUnavailable("refused")
        return "ok"

    assert run(pool.call().send(send, "", None)) == "ok" and len(sent) == 5
    assert sum(w.healthy for w in pool.workers) == 1


def test_when_every_worker_is_unreachable_there_is_no_healthy_worker() -> None:
    pool = pool_of(2)
    with pytest.raises(NoHealthyWorker) as none:
        run(pool.call().send(Script(pool, {}, default=WorkerUnavailable("refused")), "", None))
    assert none.value.code == "no_healthy_worker"


def test_no_new_attempt_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "RETRY_DEADLINE_S", -1.0)
    pool = pool_of(3)
    send = Script(pool, {}, default=WorkerStreamBroken("reset"))
    with pytest.raises(WorkerStreamBroken):
        run(pool.call().send(send, "", None))
    assert len(send.calls) == 1


def test_when_no_worker_is_left_the_last_failure_is_raised() -> None:
    pool = pool_of(2)
    send = Script(pool, {"http://w0": WorkerStreamBroken("reset"), "http://w1": WorkerUnavailable("refused")})
    with pytest.raises(WorkerStreamBroken):
        run(pool.call().send(send, "", None))


def test_retries_only_before_the_answer_began() -> None:
    """Once ``send`` returned (a stream's head), the call is done: a break after it is reported with
    ``broke`` (counted against the worker) and never sent again."""
    pool = pool_of(2)
    send = Script(pool, {})
    call = pool.call()
    run(call.send(send, "", None, hold=True))
    call.broke("stream broke off")
    call.release()
    assert len(send.calls) == 1 and pool.workers[0].breaker.failures == 1
    assert pool.workers[0].last_error == "stream broke off" and counted(pool) == [0, 0]
    call.broke("after the release")  # nothing held: nothing to blame
    assert pool.workers[0].breaker.failures == 1


class Relayed:
    def __init__(self, status: int) -> None:
        self.status = status


def test_a_relayed_5xx_counts_neither_for_nor_against_the_worker() -> None:
    pool = pool_of(2)
    worker = pool.workers[0]
    pool.record_failure(worker, "x", worker.breaker.admit(time.monotonic()))
    send = Script(pool, {}, default=Relayed(502))
    assert run(pool.call(relayed=True, exclude=[pool.workers[1]]).send(send, "", None)).status == 502
    assert worker.breaker.failures == 1 and len(send.calls) == 1  # no success, no retry, no blame
    run(pool.call(relayed=True, exclude=[pool.workers[1]]).send(Script(pool, {}, default=Relayed(200)), "", None))
    assert worker.breaker.failures == 0 and counted(pool) == [0, 0]


def test_a_half_open_trial_that_ends_without_a_verdict_frees_its_slot() -> None:
    pool = pool_of(1)
    worker = pool.workers[0]
    now = time.monotonic()
    for _ in range(CIRCUIT_FAILURES):
        pool.record_failure(worker, "x", worker.breaker.admit(now))
    worker.breaker.recovered(now)  # half-open: one trial
    with pytest.raises(WorkerHTTPError):
        run(pool.call().send(Script(pool, {}, default=WorkerHTTPError(400, {})), "", None))
    assert worker.breaker.admits(time.monotonic()) and worker.circuit == "half_open"


# ------------------------------------------------------------------ cancellation and bugs


async def _cancel_while(pool: Pool, send: Callable[[str, Any], Awaitable[Any]], reached: Callable[[], object], *,
                        hold: bool = False) -> None:
    """Cancels the call once ``reached()`` says it is where the test wants it (in the send, in the pause)."""
    task = asyncio.create_task(pool.call().send(send, "", None, hold=hold))
    await async_wait_until(lambda: reached() or task.done(), 5, "the call at the point to cancel it", interval=0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancelled_while_sending_releases_the_worker() -> None:
    pool = pool_of(2)
    started = []

    async def hang(url: str, body: Any) -> None:
        started.append(counted(pool))
        await asyncio.sleep(60)

    run(_cancel_while(pool, hang, lambda: started, hold=True))
    assert started == [[1, 0]] and counted(pool) == [0, 0]
    assert [w.breaker.failures for w in pool.workers] == [0, 0] and pool.workers[0].served == 0


def test_cancelled_in_the_pause_between_attempts_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calls, "PAUSE_S", (30.0, 30.0))
    pool = pool_of(2)
    send = Script(pool, {}, default=WorkerStreamBroken("reset"))
    run(_cancel_while(pool, send, lambda: send.calls))  # the call failed: it waits out the pause
    assert len(send.calls) == 1 and counted(pool) == [0, 0]


def test_a_bug_in_send_releases_and_is_not_retried() -> None:
    pool = pool_of(2)
    send = Script(pool, {}, default=KeyError("oops"))
    with pytest.raises(KeyError):
        run(pool.call().send(send, "", None))
    assert len(send.calls) == 1 and counted(pool) == [0, 0] and pool.workers[0].breaker.failures == 0


# ------------------------------------------------------------------ one place


def test_in_flight_changes_only_in_the_worker_call() -> None:
    """What the pool's balancers read is written in one module (the worker's own), by one caller."""
    def writers(pattern: str) -> list[str]:
        found = re.compile(pattern)
        return sorted(str(p.relative_to(ROOT)) for package in ("router", "backends", "policies")
                      for p in (ROOT / package).rglob("*.py") if found.search(p.read_text()))

    assert writers(r"\bin_flight\s*(\+=|-=|=(?!=))") == ["backends/worker.py"]
    assert writers(r"\.take\(now\)|\.end\((self\.)?ticket, served=") == ["backends/calls.py"]
