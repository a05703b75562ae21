"""Pools of workers: health, circuits, picking a worker.

A pool owns one WorkerClient (its connections, backends/wire.py) and a health loop. The
choice among healthy workers is delegated to a policy from ``policies``; each
worker's circuit breaker (backends/breaker.py) decides whether it takes calls.
A call to a worker goes through ``Pool.call`` (backends/calls.py), which counts
it in flight, retries and releases it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.breaker import CIRCUIT_FAILURES
from backends.calls import WorkerCall
from backends.client import WireLimits, WorkerClient, WorkerUnavailable
from backends.engines import ENGINES, Engine, kv_cache_usage, waiting_requests
from backends.errors import NoHealthyWorker
from backends.gate import Gate
from backends.kv_feed import KVFeed
from backends.worker import Worker
from policies.affinity import Affinity
from policies.balance import Balancer
from policies.kv_aware import KVAware
from policies.kv_index import block_keys
from policies.tenant import Tenant

__all__ = ["NoHealthyWorker", "Pool"]

log = logging.getLogger("router.pools")


# The block size a kv_aware pool keys a prompt with before any event said its engine's (vLLM's GPU default).
KV_BLOCK_GUESS = 16
HEALTH_TIMEOUT_S = 5.0
HEALTH_FAILURES_TO_MARK_DOWN = 3


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
    affinity: Affinity | None = None  # for pools whose policy is affinity
    scrape_metrics: bool = False  # read engines' queue lengths and KV usage into Worker with each health round
    no_generate: bool = False  # vLLM workers without the token-level generate endpoint (seen answering 404)
    kv: KVFeed | None = None  # the prefix index from the workers' KV events, when the pool has them
    kv_policy: KVAware | None = None  # policy kv_aware: picks by the index (``pick``'s prompt_ids)
    kv_decisions: dict[str, int] = field(default_factory=dict)  # reason (cache, load) -> count
    gate: Gate | None = None  # bounds on the workers' calls, and the fair queue in front of them (backends/gate.py)
    gated: bool = False  # gate is set: what a call checks
    kv_expected_tokens: int = 0  # the cached prompt tokens its picks expected, summed (the engines report theirs)
    affinity_moves: dict[str, int] = field(default_factory=dict)  # why -> count
    _health_task: asyncio.Task[None] | None = None
    _status: str | None = None  # as last logged (``_note_status``)

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
        if self.kv is not None:
            await self.kv.stop()
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

    def pick(self, exclude: Sequence[Worker] = (), *, preferred: str | None = None, prefix_key: str | None = None,
             prompt_ids: Sequence[int] | None = None) -> Worker:
        """A healthy worker chosen by the policy; NoHealthyWorker when there is none.

        ``preferred`` (the worker that served the previous turn) and ``prefix_key``
        matter only to an affinity pool, ``prompt_ids`` (the prompt's token ids) to a kv_aware one.
        """
        now = time.monotonic()
        healthy = [w for w in self.workers if w.healthy and w not in exclude]
        candidates = [w for w in healthy if w.breaker.admits(now)]
        if not candidates:
            if healthy:
                wait = min(w.breaker.remaining(now) for w in healthy)
                trial = f"next trial call in {math.ceil(wait)} s" if wait else "a trial call is under way"
                raise NoHealthyWorker(f"circuit open on all workers of pool {self.name!r} (after "
                                      f"{CIRCUIT_FAILURES} failed calls in a row; {trial})", code="circuit_open")
            raise NoHealthyWorker(f"pool {self.name!r} has no healthy worker")
        gate = self.gate
        if gate is not None:  # a worker at its bound takes no more (unless all are: a retry's)
            candidates = [w for w in candidates if not gate.full(w)] or candidates
        if self.kv_policy is not None and prompt_ids:
            return self._kv_pick(candidates, prompt_ids, now)
        if self.affinity is None:
            return self.balancer.choose(candidates)
        choice = self.affinity.choose(candidates, preferred=preferred, prefix_key=prefix_key)
        if choice.why is not None:
            self.affinity_moves[choice.why] = self.affinity_moves.get(choice.why, 0) + 1
        return choice.candidate

    def set_gate(self, gate: Gate | None) -> None:
        self.gate, self.gated = gate, gate is not None

    async def enter(self, tenant: Tenant | None) -> None:
        """Through the gate: at once while a worker has room and no one waits, else in turn."""
        if self.gate is not None:
            await self.gate.enter(tenant, self.workers)

    def freed(self) -> None:
        """A call ended, or a worker may have room: the gate's next waiter gets it."""
        if self.gate is not None:
            self.gate.wake(self.workers)

    def call(self, *, preferred: str | None = None, prefix_key: str | None = None, exclude: Sequence[Worker] = (),
             relayed: bool = False) -> WorkerCall:
        """A worker call: picks, counts in flight, sends, classifies, retries, releases
        (backends/calls.py). Every call made for a client goes through one (health checks and
        scrapes, which take no worker's capacity, do not)."""
        return WorkerCall(self, preferred=preferred, prefix_key=prefix_key, exclude=exclude, relayed=relayed)

    def record_success(self, worker: Worker, ticket: int) -> None:
        if worker.breaker.success(ticket, time.monotonic()):
            log.info("pool %s: worker %s circuit closed", self.name, worker.url)
            self._note_status()

    def record_failure(self, worker: Worker, reason: str, ticket: int) -> None:
        """A call failed through the worker's fault (not the request's): towards opening its circuit.
        Failures of one event (a crash breaking every open stream) count once: backends/breaker.py."""
        worker.last_error = reason
        cooldown = worker.breaker.failure(ticket, time.monotonic())
        if cooldown is not None:
            log.warning("pool %s: worker %s circuit open for %.0f s after %d failures: %s",
                        self.name, worker.url, cooldown, worker.breaker.failures, reason)
            self._note_status()

    def mark_down(self, worker: Worker, reason: str) -> None:
        """A passive signal: a call could not reach the worker (or its process exited). The health
        loop brings it back."""
        was = worker.healthy
        worker.healthy = False
        worker.last_error = reason
        if was:
            log.warning("pool %s: worker %s marked down: %s", self.name, worker.url, reason)
            self._note_status()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))
        self._note_status()  # a circuit's cool-down ends with time, not with an event
        self.freed()  # a worker back, or an engine's queue shorter: room for those waiting

    def _note_status(self) -> None:
        """Log the pool's status when it changes (once per transition, never per probe): down (no
        request can be served, and why), degraded, ok. A pool that starts ok says nothing here."""
        state = self.describe()
        status = state["status"]
        if status == self._status or (self._status is None and status == "ok"):
            self._status = status
            return
        was, self._status = self._status, status
        counts = f"{state['available_workers']} of {len(self.workers)} workers available"
        if status == "down":
            log.warning("pool %s: down: %s (%s); its requests get 503", self.name, state["reason"], counts)
        else:
            log.info("pool %s: %s%s (%s)", self.name, "serving again, " if was == "down" else "", status, counts)

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
            if not worker.healthy or worker.health_failures:
                # Back after being seen down (restarted): an open circuit gets its trial now, not
                # after a cool-down that the failures of its outage may have run up.
                if worker.breaker.recovered(time.monotonic()):
                    log.info("pool %s: worker %s is back: circuit half-open", self.name, worker.url)
            if not worker.healthy:
                log.info("pool %s: worker %s healthy", self.name, worker.url)
                worker.lacks.clear()
                if self.kv is not None:
                    self.kv.restarted(worker.url)
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
        reach now; the status follows it (all of them: ok, some: degraded, none: down). ``reason``
        says why a pool is down: ``no healthy worker`` or ``circuit open on all workers`` (they
        pass their health checks, but their calls failed)."""
        healthy = sum(w.healthy for w in self.workers)
        available = sum(w.healthy and w.circuit != "open" for w in self.workers)
        reason = None
        if not available:
            reason = "circuit open on all workers" if healthy else "no healthy worker"
        return {
            "name": self.name,
            "engine": self.engine.name,
            "model": self.model,
            "status": "ok" if available == len(self.workers) and available else ("degraded" if available else "down"),
            "reason": reason,
            "healthy_workers": healthy,
            "available_workers": available,
            "affinity_moves": dict(self.affinity_moves),
            **({"kv_decisions": dict(self.kv_decisions)} if self.kv_policy is not None else {}),
            "workers": [self._describe(w) for w in self.workers],
        }

    def _kv_pick(self, candidates: list[Worker], prompt_ids: Sequence[int], now: float) -> Worker:
        """The index's cached prefix of each candidate, weighed against its load (policies/kv_aware.py)."""
        assert self.kv is not None and self.kv_policy is not None
        index = self.kv.index
        size = index.block_size() or KV_BLOCK_GUESS
        keys = block_keys(prompt_ids, size)
        chosen, why = self.kv_policy.choose(candidates, len(prompt_ids), index.overlap(prompt_ids, keys=keys),
                                            prefix_keys=keys, now=now)
        self.kv_policy.routed(chosen.url, keys, size, now)
        self.kv_decisions[why.reason] = self.kv_decisions.get(why.reason, 0) + 1
        self.kv_expected_tokens += why.expected_cached
        return chosen

    def _describe(self, worker: Worker) -> dict[str, Any]:
        out = worker.describe()
        if self.kv is not None:
            counts = self.kv.counts(worker.url)
            out["kv_events"] = {"blocks": self.kv.held(worker.url), "messages": counts.messages if counts else 0,
                                "gaps": counts.gaps if counts else 0, "bad": counts.bad if counts else 0}
        return out
