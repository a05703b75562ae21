"""Keep a conversation on the worker that holds its KV prefix.

``Affinity.choose`` decides, per request, between three targets:

1. ``preferred``: the id (url) of the worker that served the previous turn
   of this chain/conversation. It is kept while it is among the candidates
   (the pool passes only healthy workers) and not overloaded.
2. ``prefix_key``: for a NEW conversation (no preferred), a stable hash of
   its prompt prefix, mapped to a worker by rendezvous (highest random
   weight) hashing: adding or removing one of n workers moves only ~1/n of
   the keys, so conversations sharing a system prompt keep meeting the
   worker that has it cached.
3. The fallback balancer, when there is no target (reason ``"balance"``) or
   the target was rejected (reason ``"fallback"``; ``moved_from`` and
   ``why`` say which and why, so the caller can record the move).

Overloaded means: ``load(target) > overload_factor * mean_load + slack``
over the candidates. The absolute ``slack`` (in requests) keeps a nearly
idle pool from counting as overloaded (mean 0.2, target 1 is fine).

Pure and per request: no locks, O(n) in the candidates, hashes are
``blake2b`` (stable across processes and replicas), never ``hash()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Generic, Literal, Protocol, TypeVar

from policies.balance import Balancer, Candidate, load_of

Reason = Literal["affinity", "prefix", "fallback", "balance"]
Why = Literal["unhealthy", "overloaded"]

_MASK = (1 << 64) - 1


class Addressable(Candidate, Protocol):
    """A candidate with a stable id: the worker's url."""

    @property
    def url(self) -> str: ...


A = TypeVar("A", bound=Addressable)


@dataclass(frozen=True, slots=True)
class Choice(Generic[A]):
    candidate: A
    reason: Reason
    moved_from: str | None = None  # the rejected target's id, with reason "fallback"
    why: Why | None = None  # why it was rejected, with reason "fallback"


def hash64(text: str) -> int:
    """A stable 64-bit hash of ``text`` (same in every process and replica)."""
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer: a bijection with full avalanche."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    x ^= x >> 33
    return x


_id_hashes: dict[str, int] = {}  # worker ids are few and long-lived; a cache, bounded below


def _id_hash(worker_id: str) -> int:
    h = _id_hashes.get(worker_id)
    if h is None:
        if len(_id_hashes) >= 4096:
            _id_hashes.clear()
        h = _id_hashes[worker_id] = hash64(worker_id)
    return h


def rendezvous_weight(key_hash: int, worker_id: str) -> int:
    """The weight of one worker for one key; the key goes to the heaviest worker."""
    return _mix64(key_hash ^ _id_hash(worker_id))


def rendezvous(key: str, candidates: Sequence[A]) -> A:
    """The candidate with the highest random weight for ``key`` (ties: the larger id)."""
    key_hash = hash64(key)
    best = candidates[0]
    best_weight = rendezvous_weight(key_hash, best.url)
    for candidate in candidates[1:]:
        weight = rendezvous_weight(key_hash, candidate.url)
        if weight > best_weight or (weight == best_weight and candidate.url > best.url):
            best, best_weight = candidate, weight
    return best


class Affinity:
    """Preferred worker, else prefix rendezvous, else the fallback balancer."""

    def __init__(self, fallback: Balancer, *, overload_factor: float = 1.5, slack: float = 2.0) -> None:
        if not overload_factor >= 1.0:
            raise ValueError(f"overload_factor must be >= 1, got {overload_factor!r}")
        if not slack >= 0.0:
            raise ValueError(f"slack must be >= 0, got {slack!r}")
        self.fallback = fallback
        self.overload_factor = overload_factor
        self.slack = slack

    def overloaded(self, target: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Whether ``target`` is busier than ``overload_factor`` x the mean load plus ``slack``."""
        total = 0.0
        for candidate in candidates:
            total += load_of(candidate)
        return load_of(target) > self.overload_factor * total / len(candidates) + self.slack

    def choose(self, candidates: Sequence[A], *, preferred: str | None = None,
               prefix_key: str | None = None) -> Choice[A]:
        """Pick one of a non-empty list of healthy candidates; see the module docstring."""
        if preferred is not None:
            target: A | None = None
            for candidate in candidates:
                if candidate.url == preferred:
                    target = candidate
                    break
            if target is None:
                return Choice(self.fallback.choose(candidates), "fallback", preferred, "unhealthy")
            if not self.overloaded(target, candidates):
                return Choice(target, "affinity")
            return Choice(self._others(target, candidates), "fallback", preferred, "overloaded")
        if prefix_key is not None:
            target = rendezvous(prefix_key, candidates)
            if not self.overloaded(target, candidates):
                return Choice(target, "prefix")
            return Choice(self._others(target, candidates), "fallback", target.url, "overloaded")
        return Choice(self.fallback.choose(candidates), "balance")

    def _others(self, rejected: A, candidates: Sequence[A]) -> A:
        # An overloaded target implies another candidate (factor >= 1, slack >= 0):
        # the fallback chooses among the rest, so the move is a real move.
        return self.fallback.choose([c for c in candidates if c is not rejected])
