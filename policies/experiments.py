"""Which arm (pool) of an experiment serves a conversation; shadow sampling.

Assignment is a pure function of (experiment name, key, arms): the key
(the conversation's root id) is hashed with ``blake2b`` to a uniform number
in [0, 1) and looked up in the cumulative weights. The same key gets the
same arm in every process and replica while the arms and weights are
unchanged; no state is kept but counters.

When the assigned arm is down, the key moves to a live arm drawn by weight
among the live ones, with a second, independent hash of the key: the move is
deterministic (every replica sends the key to the same substitute) and the
key returns to its own arm once that arm is back.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import overload

_TWO_53 = float(1 << 53)


def unit_hash(text: str, person: bytes = b"") -> float:
    """A stable uniform number in [0, 1) from ``text``; ``person`` separates uses."""
    digest = blake2b(text.encode(), digest_size=8, person=person).digest()
    return (int.from_bytes(digest, "little") >> 11) / _TWO_53  # 53 bits: exactly < 1.0


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    weight: float


@dataclass(frozen=True, slots=True)
class Assignment:
    arm: str
    failed_over: bool = False


class NoLiveArm(Exception):
    """Every arm of the experiment is down."""


class Experiment:
    """A weighted, sticky split of keys between arms."""

    def __init__(self, name: str, arms: Sequence[Arm]) -> None:
        if not arms:
            raise ValueError(f"experiment {name!r} needs at least one arm")
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment {name!r} has duplicate arm names: {names}")
        cumulative: list[float] = []
        total = 0.0
        for arm in arms:
            weight = arm.weight
            # rejects 0, negatives, NaN and infinities (and bools, which are not weights)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.0 < weight < float("inf"):
                raise ValueError(f"experiment {name!r}: arm {arm.name!r} needs a finite weight > 0, got {weight!r}")
            total += weight
            cumulative.append(total)
        self.name = name
        self.arms: tuple[Arm, ...] = tuple(arms)
        self._names = tuple(names)
        self._cumulative = cumulative
        self._total = total
        self._salt = name + "\x00"
        self.assigned: dict[str, int] = dict.fromkeys(names, 0)  # assignments served, by arm
        self.failovers: dict[str, int] = dict.fromkeys(names, 0)  # moves away from a down arm, by arm

    def _pick(self, key: str) -> str:
        point = unit_hash(self._salt + key) * self._total
        index = bisect_right(self._cumulative, point)
        return self._names[min(index, len(self._names) - 1)]

    @overload
    def assign(self, key: str) -> str: ...

    @overload
    def assign(self, key: str, down: Collection[str]) -> Assignment: ...

    def assign(self, key: str, down: Collection[str] | None = None) -> str | Assignment:
        """The arm for ``key``; with ``down`` (arm names), an ``Assignment`` that avoids them.

        Raises ``NoLiveArm`` when every arm is in ``down``.
        """
        arm = self._pick(key)
        if down is None:
            self.assigned[arm] += 1
            return arm
        if arm not in down:
            self.assigned[arm] += 1
            return Assignment(arm)
        live_total = 0.0
        for candidate in self.arms:
            if candidate.name not in down:
                live_total += candidate.weight
        if live_total == 0.0:
            raise NoLiveArm(f"experiment {self.name!r}: every arm is down")
        point = unit_hash(self._salt + key, person=b"failover") * live_total
        substitute = ""
        for candidate in self.arms:
            if candidate.name in down:
                continue
            substitute = candidate.name  # the last live arm takes float round-off at the top
            point -= candidate.weight
            if point < 0.0:
                break
        self.failovers[arm] += 1
        self.assigned[substitute] += 1
        return Assignment(substitute, failed_over=True)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "arms": [{"name": a.name, "weight": a.weight, "assigned": self.assigned[a.name],
                      "failovers": self.failovers[a.name]} for a in self.arms],
        }


class ShadowSampler:
    """Mirror a fraction ``rate`` of requests, chosen by a hash of their key.

    ``sample(key)`` is deterministic: the same key (and seed) always gets the
    same answer, in every process. ``rate`` 0 mirrors nothing, 1 everything.
    """

    def __init__(self, rate: float, seed: int | str = 0) -> None:
        if isinstance(rate, bool) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow rate must be within [0, 1], got {rate!r}")
        self.rate = float(rate)
        self._salt = f"shadow\x00{seed}\x00"

    def sample(self, key: str) -> bool:
        return unit_hash(self._salt + key) < self.rate
