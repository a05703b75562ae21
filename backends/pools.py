"""Pools of workers: health, in-flight counts, picking a worker.

A pool owns one WorkerClient (one aiohttp session) and a health loop. The
choice among healthy workers is delegated to a policy from ``policies``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.client import WireLimits, WorkerClient, WorkerUnavailable
from backends.engines import ENGINES, Engine, kv_cache_usage, waiting_requests
from policies.balance import Balancer

log = logging.getLogger("router.pools")


@dataclass(eq=False, slots=True)
class Worker:
    url: str
    in_flight: int = 0
    healthy: bool = False
    last_error: str | None = None
    served: int = 0
    health_failures: int = 0  # consecutive failed health checks
    waiting: float = 0.0  # requests queued inside the engine, when its metrics are scraped
    kv_usage: float = 0.0  # the engine's KV cache usage, 0..1, when its metrics are scraped
    process: Any = None  # the launcher's ManagedWorker, for managed pools
    # Circuit breaker: consecutive failed calls (5xx, lost connections); open = not routed to until open_until.
    failures: int = 0
    open_until: float = 0.0
    opened: int = 0  # how often it opened in a row (the cool-down doubles each time)

    @property
    def circuit(self) -> str:
        if self.failures < CIRCUIT_FAILURES:
            return "closed"
        return "open" if time.monotonic() < self.open_until else "half_open"

    @property
    def load(self) -> float:
        """What balancing compares: our in-flight requests plus the engine's own queue, plus
        less than one request's worth for a full KV cache, so between equally busy workers
        the one with room wins (a full cache evicts prefixes and may preempt)."""
        return self.in_flight + self.waiting + KV_LOAD_WEIGHT * self.kv_usage

    def describe(self) -> dict[str, Any]:
        out = {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "last_error": self.last_error,
            "circuit": self.circuit,
            "waiting": self.waiting,
            "kv_usage": round(self.kv_usage, 4),
        }
        if self.process is not None:
            out["process"] = self.process.describe()
        return out


# What a completely full KV cache adds to a worker's load, in requests: under 1, a tie-breaker.
KV_LOAD_WEIGHT = 0.5
HEALTH_TIMEOUT_S = 5.0
HEALTH_FAILURES_TO_MARK_DOWN = 3
# A worker whose calls failed this many times in a row is not routed to for a cool-down
# (5 s, doubling up to 60 s while it keeps failing); then one request tries it again.
CIRCUIT_FAILURES = 5
CIRCUIT_COOLDOWN_S = 5.0
CIRCUIT_COOLDOWN_MAX_S = 60.0


class NoHealthyWorker(Exception):
    pass


@dataclass(eq=False)
class Pool:
    name: str
    engine: Engine
    model: str
    balancer: Balancer
    client: WorkerClient
    health_interval_s: float = 2.0
    workers: list[Worker] = field(default_factory=list)
    max_model_len: int | None = None  # from config, else from the workers' /v1/models
    affinity: Any = None  # a policies.affinity.Affinity, for pools whose policy is affinity
    scrape_metrics: bool = False  # read engines' queue lengths and KV usage into Worker with each health round
    no_generate: bool = False  # vLLM workers without the token-level generate endpoint (seen answering 404)
    affinity_moves: dict[str, int] = field(default_factory=dict)  # why -> count
    _health_task: asyncio.Task[None] | None = None

    @classmethod
    def create(cls, *, name: str, engine: str, model: str, balancer: Balancer, urls: Sequence[str] = (),
               connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0, health_interval_s: float = 2.0,
               limits: WireLimits | None = None) -> Pool:
        client = WorkerClient(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, limits=limits)
        pool = cls(name=name, engine=ENGINES[engine], model=model, balancer=balancer, client=client,
                   health_interval_s=health_interval_s)
        pool.workers = [Worker(url.rstrip("/")) for url in urls]
        return pool

    async def start(self) -> None:
        await self.client.start()
        await self.check_health()
        if self.max_model_len is None:
            self.max_model_len = await self._discover_context()
        self._health_task = asyncio.create_task(self._health_loop(), name=f"health:{self.name}")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        await self.client.close()

    async def _discover_context(self) -> int | None:
        """The served model's context length, as the first healthy worker reports it."""
        for worker in self.workers:
            if not worker.healthy:
                continue
            try:
                status, body = await self.client.get(worker.url + self.engine.models_path)
                models = orjson.loads(body).get("data") or [] if status == 200 else []
            except (WorkerUnavailable, orjson.JSONDecodeError, AttributeError):
                continue
            for model in models:
                if isinstance(model, dict) and model.get("id") == self.model and isinstance(model.get("max_model_len"), int):
                    return model["max_model_len"]
        return None

    def pick(self, exclude: Sequence[Worker] = (), *, preferred: str | None = None, prefix_key: str | None = None) -> Worker:
        """A healthy worker chosen by the policy; NoHealthyWorker when there is none.

        ``preferred`` (the worker that served the previous turn) and ``prefix_key``
        matter only to an affinity pool.
        """
        now = time.monotonic()
        candidates = [w for w in self.workers if w.healthy and w not in exclude and w.open_until <= now]
        if not candidates:
            raise NoHealthyWorker(f"pool {self.name!r} has no healthy worker")
        if self.affinity is None:
            return self.balancer.choose(candidates)
        choice = self.affinity.choose(candidates, preferred=preferred, prefix_key=prefix_key)
        if choice.why is not None:
            self.affinity_moves[choice.why] = self.affinity_moves.get(choice.why, 0) + 1
        return choice.candidate

    def record_success(self, worker: Worker) -> None:
        if worker.failures:
            if worker.failures >= CIRCUIT_FAILURES:
                log.info("pool %s: worker %s circuit closed", self.name, worker.url)
            worker.failures = worker.opened = 0
            worker.open_until = 0.0

    def record_failure(self, worker: Worker, reason: str) -> None:
        """A call failed on the worker's side (not the client's): count it towards opening the circuit."""
        worker.failures += 1
        worker.last_error = reason
        if worker.failures >= CIRCUIT_FAILURES:
            cooldown = min(CIRCUIT_COOLDOWN_MAX_S, CIRCUIT_COOLDOWN_S * 2**worker.opened)
            worker.opened += 1
            worker.open_until = time.monotonic() + cooldown
            log.warning("pool %s: worker %s circuit open for %.0f s after %d failures: %s",
                        self.name, worker.url, cooldown, worker.failures, reason)

    def mark_down(self, worker: Worker, reason: str) -> None:
        """A passive signal: a call could not reach the worker. The health loop brings it back."""
        if worker.healthy:
            log.warning("pool %s: worker %s marked down: %s", self.name, worker.url, reason)
        worker.healthy = False
        worker.last_error = reason

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))

    async def _check(self, worker: Worker) -> None:
        """One failed check is not enough to stop routing (a busy worker can answer late); three in a row are.

        A refused connection is different: passive signals from real calls mark a worker down at once.
        """
        try:
            status, _ = await self.client.get(worker.url + self.engine.health_path, timeout_s=HEALTH_TIMEOUT_S)
            reason = None if status == 200 else f"health check answered {status}"
        except WorkerUnavailable as exc:
            reason = f"health check failed: {exc}"
        if reason is None:
            if not worker.healthy:
                log.info("pool %s: worker %s healthy", self.name, worker.url)
            worker.healthy = True
            worker.last_error = None
            worker.health_failures = 0
            if self.scrape_metrics:
                await self._scrape(worker)
            return
        worker.health_failures += 1
        worker.last_error = reason
        if worker.health_failures >= HEALTH_FAILURES_TO_MARK_DOWN or not worker.healthy:
            self.mark_down(worker, reason)

    async def _scrape(self, worker: Worker) -> None:
        """The engine's queue length and KV cache usage, as load signals; a failed scrape leaves the last values."""
        try:
            status, body = await self.client.get(worker.url + "/metrics", timeout_s=HEALTH_TIMEOUT_S)
        except WorkerUnavailable:
            return
        if status == 200:
            text = body.decode("utf-8", "replace")
            waiting = waiting_requests(self.engine.name, text)
            if waiting is not None:
                worker.waiting = waiting
            kv = kv_cache_usage(self.engine.name, text)
            if kv is not None:
                worker.kv_usage = kv

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # keep checking whatever one round did
                log.exception("pool %s: health round failed", self.name)

    def describe(self) -> dict[str, Any]:
        """``available_workers``: healthy and not shut off by an open circuit, i.e. what requests can
        reach now; the status follows it (all of them: ok, some: degraded, none: down)."""
        healthy = sum(w.healthy for w in self.workers)
        available = sum(w.healthy and w.circuit != "open" for w in self.workers)
        return {
            "name": self.name,
            "engine": self.engine.name,
            "model": self.model,
            "status": "ok" if available == len(self.workers) and available else ("degraded" if available else "down"),
            "healthy_workers": healthy,
            "available_workers": available,
            "affinity_moves": dict(self.affinity_moves),
            "workers": [w.describe() for w in self.workers],
        }
