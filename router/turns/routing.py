"""A public model name -> the arm (pool) and worker preference for one request.

Arms are sticky per conversation: a conversation's key (its id, the key its
chain started with, or the client's ``prompt_cache_key`` / ``safety_identifier``
/ ``user``) always lands on the same arm while the arm is up; a down arm
fails over to another and the move is counted. Where each stored response
was served is recorded, so a continuation finds its arm and its worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

from policies.experiments import Arm as ExperimentArm
from policies.experiments import Experiment, NoLiveArm, ShadowSampler
from router.config import ModelConfig
from router.protocol.errors import NoCapacity
from router.turns.route import ModelRoute


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    route: ModelRoute


@dataclass(slots=True)
class Routing:
    """Where one request goes, and what is recorded about it."""

    key: str
    arm: str
    route: ModelRoute
    preferred_worker: str | None = None  # the worker that served the previous turn
    prefix_key: str | None = None  # for a new conversation on an affinity pool
    failed_over: bool = False
    home: str | None = None  # the arm it would have had, when it failed over

    def record(self, worker: str | None) -> dict[str, Any]:
        return {"key": self.key, "arm": self.arm, "pool": self.route.pool.name, "worker": worker}


@dataclass(eq=False)
class Shadow:
    """A model's shadow pool: the sample mirrored to it, and the mirrors running now
    (router/turns/shadow.py). Per model: nothing of it is shared between models or routers."""

    route: ModelRoute
    sampler: ShadowSampler
    limit: int = 4
    running: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"mirrored": 0, "skipped": 0, "failed": 0})
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # referenced until done


@dataclass(eq=False)
class ModelTarget:
    name: str
    arms: dict[str, Arm]
    experiment: Experiment | None = None
    shadow: Shadow | None = None
    affinity: bool = False  # some arm's pool keeps conversations on their worker
    failovers: dict[tuple[str, str], int] = field(default_factory=dict)
    # The names of streamed reasoning events: the model's setting, and the API keys' (by owner name) that differ.
    reasoning_events: str = "openai"
    key_events: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: ModelConfig, routes: dict[str, ModelRoute], *, affinity: set[str],
                    key_events: Mapping[str, str] | None = None) -> ModelTarget:
        arms = {(a.name or a.pool): Arm(a.name or a.pool, routes[a.pool]) for a in cfg.arm_list}
        experiment = Experiment(cfg.name, [ExperimentArm(a.name or a.pool, a.weight) for a in cfg.arm_list]) if len(arms) > 1 else None
        target = cls(cfg.name, arms, experiment, affinity=any(a.pool in affinity for a in cfg.arm_list),
                     reasoning_events=cfg.reasoning_events, key_events=dict(key_events or {}))
        if cfg.shadow is not None:
            target.shadow = Shadow(routes[cfg.shadow.pool], ShadowSampler(cfg.shadow.rate), cfg.shadow.max_concurrency)
        return target

    @property
    def records(self) -> bool:
        """Whether routing is worth a store write: arms to stick to, or workers to come back to."""
        return self.experiment is not None or self.affinity

    def route(self, key: str, previous: dict[str, Any] | None, *, prefix_key: str | None) -> Routing:
        """The arm for ``key``: the previous turn's arm while it is up, else the experiment's choice."""
        if previous is not None and previous.get("arm") in self.arms:
            arm = self.arms[previous["arm"]]
            if _up(arm):
                worker = previous.get("worker") if previous.get("pool") == arm.route.pool.name else None
                return Routing(key, arm.name, arm.route, preferred_worker=worker)
        if self.experiment is None:
            arm = next(iter(self.arms.values()))
            return Routing(key, arm.name, arm.route, prefix_key=prefix_key)
        down = {name for name, arm in self.arms.items() if not _up(arm)}
        try:
            assignment = self.experiment.assign(key, down=down)
        except NoLiveArm:
            raise NoCapacity(f"no arm of model '{self.name}' has a healthy worker", code="no_healthy_worker") from None
        home = None
        if assignment.failed_over:
            home = self.experiment.assign(key)
            self.failovers[(home, assignment.arm)] = self.failovers.get((home, assignment.arm), 0) + 1
        arm = self.arms[assignment.arm]
        return Routing(key, arm.name, arm.route, prefix_key=prefix_key, failed_over=assignment.failed_over, home=home)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "arms": list(self.arms),
            "failovers": [{"from": a, "to": b, "count": n} for (a, b), n in self.failovers.items()],
            "shadow": dict(self.shadow.counts) if self.shadow is not None else None,
        }


def prefix_hash(*parts: str | None) -> str:
    """A short stable key for a prompt prefix (rendezvous hashing input)."""
    digest = blake2b(digest_size=8)
    for part in parts:
        digest.update((part or "").encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _up(arm: Arm) -> bool:
    """Whether any worker of the arm's pool is healthy."""
    return any(w.healthy for w in arm.route.pool.workers)
