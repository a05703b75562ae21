"""Store calls that ride out a database restart or a short outage, for a bounded time.

A call that fails with an error its ``transient`` predicate accepts (the
connection refused, reset or closed by a restarting server) is tried again
with exponential backoff and jitter (tenacity) until ``retry_s`` has passed;
then it raises ``StoreUnavailable``, which clients see as 503
``store_unavailable`` (or a stream's ``error`` + ``response.failed``). Any
other error is raised at once, unchanged.

Only operations that are safe to run again go through ``run``: the caller
makes each one idempotent, including when an attempt's COMMIT was sent but
its answer lost (see router/state/postgres.py). The first attempt runs
outside tenacity: a call that succeeds pays one ``try`` and nothing more.
Measured on the 2-core dev box with a no-op call: ~0.2 us over a plain await
this way, ~28 us inside tenacity's loop (~1.5% of a ~1.9 ms PostgreSQL put,
on every store call of the hot path); the loop is paid only while the
database is failing.

The last failure and the first success after it are kept: for ``/health``,
and for the background sweep, which must not fail leases that could not be
renewed while the database was unreachable (router/turns/background.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_before_delay, wait_exponential_jitter

from router.state.store import StoreUnavailable

log = logging.getLogger("router.store")

T = TypeVar("T")

# Backoff between attempts: 50 ms doubling, at most MAX_WAIT_S, plus up to JITTER_S of jitter so the
# replicas' many waiting calls do not reconnect in step. The cap keeps a call from sleeping long past
# the database's return (a replica renews its leases within about this after it; background.py).
FIRST_WAIT_S = 0.05
MAX_WAIT_S = 1.0
JITTER_S = 0.1


class Retrier:
    """Runs store operations, retrying transient failures for up to ``retry_s`` seconds."""

    def __init__(self, retry_s: float, transient: Callable[[BaseException], bool], what: str,
                 on_transient: Callable[[], Awaitable[None]] | None = None) -> None:
        self.retry_s = retry_s
        self.transient = transient
        self.what = what  # the database, in log lines
        self.on_transient = on_transient  # after each transient failure (drop the connections it may have broken)
        # Wall-clock times (unix seconds) of the last failed attempt, and of the first success after it.
        self.unreachable_at = 0.0
        self.back_at = 0.0
        self.error: str | None = None  # the last failure, while no call has succeeded since
        self._down_since: float | None = None  # monotonic, for the "reachable again" line
        self._gave_up = False  # a call gave up in this outage (said once per outage)

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)``, tried again on transient errors until ``retry_s`` has passed."""
        try:
            result = await fn(*args)
        except Exception as exc:
            if not self.transient(exc):
                raise
            await self._failed(exc)
            if self.retry_s <= 0:
                raise self._unavailable(exc) from exc
        else:
            if self.error is not None:
                self._recovered()
            return result

        async def attempt() -> T:
            try:
                return await fn(*args)
            except Exception as exc:
                if self.transient(exc):
                    await self._failed(exc)
                raise

        retrying = AsyncRetrying(
            stop=stop_before_delay(self.retry_s),
            wait=wait_exponential_jitter(multiplier=FIRST_WAIT_S, max=MAX_WAIT_S, jitter=JITTER_S),
            retry=retry_if_exception(self.transient),
            reraise=True,
        )
        try:
            result = await retrying(attempt)  # the last attempt's result, or its error raised
        except Exception as exc:
            if not self.transient(exc):
                raise
            raise self._unavailable(exc) from exc
        if self.error is not None:
            self._recovered()
        return result

    async def once(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` without retrying: a transient error is StoreUnavailable at once."""
        try:
            result = await fn(*args)
        except Exception as exc:
            if not self.transient(exc):
                raise
            await self._failed(exc)
            raise StoreUnavailable() from exc  # a probe's answer: nothing gave up, no line of its own
        if self.error is not None:
            self._recovered()
        return result

    def reachable_s(self) -> float:
        """Seconds the database has answered since it last failed to (inf: never failed; 0.0: failing)."""
        if self.unreachable_at == 0.0:
            return math.inf
        if self.error is not None:
            return 0.0
        return max(0.0, time.time() - self.back_at)

    async def _failed(self, exc: BaseException) -> None:
        self.unreachable_at = time.time()
        self.error = f"{type(exc).__name__}: {exc}"
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("%s unreachable (%s): store calls retry for up to %g s", self.what, self.error, self.retry_s)
        if self.on_transient is not None:
            await self.on_transient()

    def _recovered(self) -> None:
        self.error = None
        self.back_at = time.time()
        self._gave_up = False
        if self._down_since is not None:
            log.warning("%s reachable again after %.1f s", self.what, time.monotonic() - self._down_since)
            self._down_since = None

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        if not self._gave_up:
            self._gave_up = True
            log.warning("%s still unreachable (%s: %s): store calls fail with store_unavailable", self.what,
                        type(exc).__name__, exc)
        return StoreUnavailable()
