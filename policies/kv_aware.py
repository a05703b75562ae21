"""Send a request where its prompt is already cached, unless that worker is too busy.

Per request, with each healthy worker's cached prefix of the prompt (``cached``, in tokens,
from the KV index: policies/kv_index.py) and its load (policies/balance.py ``load_of``: in
flight, the engine's queue, its KV usage):

1. **filter**: the workers within ``window`` of the least loaded one (``load <= min_load +
   window``), so that a cached prefix never sends a request to a queue far longer than the
   others', and an imbalance never collapses the choice into shortest-queue either: among the
   workers that are not far behind, the cache still decides;
2. **score**: ``cost = (prompt_tokens - cached) / tokens_per_request + load``: the prefill left
   to do, in requests' worth (``tokens_per_request`` prompt tokens cost as much as one request
   already running), plus the load it carries;
3. **pick**: the least cost; ties go to the lower load, then to a stable hash of the prompt's
   first block and the worker (never list order, so equal workers share a pool's traffic).

A request just routed counts as cached on its worker for ``speculative_s`` (``routed``): its
blocks reach the index only when the engine's events arrive, and a burst sharing a new prefix
would otherwise scatter (or, scored on load alone, pile up) before they do.

Pure: the caller gives the clock and the index's answer; ``choose`` returns the worker and why
(``cache``: a cached prefix decided; ``load``: no worker in the window held any of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from policies.affinity import Addressable, rendezvous_weight
from policies.balance import load_of

A = TypeVar("A", bound=Addressable)
Reason = Literal["cache", "load"]


@dataclass(frozen=True, slots=True)
class KVChoice:
    """The worker chosen (its url), why, and the cached tokens the router expects there."""

    url: str
    reason: Reason
    expected_cached: int


class KVAware:
    """The policy's settings and its speculative entries (what it routed, not yet in the index)."""

    def __init__(self, *, tokens_per_request: float = 1024.0, window: float = 4.0, speculative_s: float = 2.0,
                 max_speculative: int = 65_536) -> None:
        if tokens_per_request <= 0 or window < 0 or speculative_s < 0 or max_speculative < 1:
            raise ValueError("tokens_per_request and max_speculative must be > 0, window and speculative_s >= 0")
        self.tokens_per_request = tokens_per_request
        self.window = window
        self.speculative_s = speculative_s
        self.max_speculative = max_speculative
        # a block key of a prompt just routed -> (the worker it went to, the tokens up to that block, until)
        self._speculative: dict[int, tuple[str, int, float]] = {}

    def choose(self, candidates: Sequence[A], prompt_tokens: int, cached: Mapping[str, int], *,
               prefix_keys: Sequence[int] = (), now: float = 0.0) -> tuple[A, KVChoice]:
        """Pick one of a non-empty list of healthy candidates. ``cached``: each worker's cached
        prefix (the index's ``overlap``); ``prefix_keys``: the prompt's block keys, from the first
        (for the speculative entries and the tie-break)."""
        if not candidates:
            raise ValueError("no candidates")
        held = self._with_speculative(cached, prefix_keys, now)
        loads = [load_of(c) for c in candidates]
        floor = min(loads) + self.window
        tie_key = prefix_keys[0] if prefix_keys else prompt_tokens
        best: A | None = None
        best_rank: tuple[float, float, int] | None = None
        best_cached = 0
        for candidate, load in zip(candidates, loads, strict=True):
            if load > floor:
                continue
            have = min(held.get(candidate.url, 0), prompt_tokens)
            rank = ((prompt_tokens - have) / self.tokens_per_request + load, load,
                    -rendezvous_weight(tie_key, candidate.url))
            if best_rank is None or rank < best_rank:
                best, best_rank, best_cached = candidate, rank, have
        assert best is not None  # the least loaded candidate is always within the window
        return best, KVChoice(best.url, "cache" if best_cached > 0 else "load", best_cached)

    def routed(self, url: str, prefix_keys: Sequence[int], block_size: int, now: float) -> None:
        """``url`` took a request with these block keys: for ``speculative_s`` each of its blocks
        counts as cached there, until the engine's own events say so."""
        if not prefix_keys or self.speculative_s == 0:
            return
        if len(self._speculative) + len(prefix_keys) > self.max_speculative:
            self._speculative = {k: v for k, v in self._speculative.items() if v[2] > now}
            if len(self._speculative) + len(prefix_keys) > self.max_speculative:
                self._speculative.clear()
        until = now + self.speculative_s
        for depth, key in enumerate(prefix_keys[:self.max_speculative], 1):
            self._speculative[key] = (url, depth * block_size, until)

    def _with_speculative(self, cached: Mapping[str, int], prefix_keys: Sequence[int], now: float) -> dict[str, int]:
        held = dict(cached)
        if not self._speculative:
            return held
        for key in prefix_keys:
            entry = self._speculative.get(key)
            if entry is None:
                break  # a prompt's blocks chain: past the first miss none can match
            if entry[2] > now and entry[1] > held.get(entry[0], 0):
                held[entry[0]] = entry[1]
        return held
