"""Pools of workers: health, in-flight counts, picking a worker.

A pool owns one WorkerClient (one aiohttp session) and a health loop. The
choice among healthy workers is delegated to a policy from ``policies``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.client import WorkerClient, WorkerUnavailable
from backends.engines import ENGINES, Engine
from policies.balance import Balancer

log = logging.getLogger("router.pools")


@dataclass(eq=False, slots=True)
class Worker:
    url: str
    in_flight: int = 0
    healthy: bool = False
    last_error: str | None = None
    served: int = 0
    process: Any = None  # the launcher's ManagedWorker, for managed pools

    def describe(self) -> dict[str, Any]:
        out = {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "last_error": self.last_error,
        }
        if self.process is not None:
            out["process"] = self.process.describe()
        return out


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
    no_generate: bool = False  # vLLM workers without the token-level generate endpoint (seen answering 404)
    affinity_moves: dict[str, int] = field(default_factory=dict)  # why -> count
    _health_task: asyncio.Task[None] | None = None

    @classmethod
    def create(cls, *, name: str, engine: str, model: str, balancer: Balancer, urls: Sequence[str] = (),
               connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0, health_interval_s: float = 2.0) -> Pool:
        client = WorkerClient(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
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
        candidates = [w for w in self.workers if w.healthy and w not in exclude]
        if not candidates:
            raise NoHealthyWorker(f"pool {self.name!r} has no healthy worker")
        if self.affinity is None:
            return self.balancer.choose(candidates)
        choice = self.affinity.choose(candidates, preferred=preferred, prefix_key=prefix_key)
        if choice.why is not None:
            self.affinity_moves[choice.why] = self.affinity_moves.get(choice.why, 0) + 1
        return choice.candidate

    def mark_down(self, worker: Worker, reason: str) -> None:
        """A passive signal: a call could not reach the worker. The health loop brings it back."""
        if worker.healthy:
            log.warning("pool %s: worker %s marked down: %s", self.name, worker.url, reason)
        worker.healthy = False
        worker.last_error = reason

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))

    async def _check(self, worker: Worker) -> None:
        try:
            status, _ = await self.client.get(worker.url + self.engine.health_path)
        except WorkerUnavailable as exc:
            self.mark_down(worker, f"health check failed: {exc}")
            return
        if status == 200:
            if not worker.healthy:
                log.info("pool %s: worker %s healthy", self.name, worker.url)
            worker.healthy = True
            worker.last_error = None
        else:
            self.mark_down(worker, f"health check answered {status}")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # keep checking whatever one round did
                log.exception("pool %s: health round failed", self.name)

    def describe(self) -> dict[str, Any]:
        healthy = sum(w.healthy for w in self.workers)
        return {
            "name": self.name,
            "engine": self.engine.name,
            "model": self.model,
            "status": "ok" if healthy == len(self.workers) and healthy else ("degraded" if healthy else "down"),
            "healthy_workers": healthy,
            "affinity_moves": dict(self.affinity_moves),
            "workers": [w.describe() for w in self.workers],
        }
