"""Who waits, and who goes next, when a worker pool is saturated: fair between API keys by tokens served.

A plain FIFO in front of a full pool lets one key that floods it (a batch job, a retry loop) push
every other key's requests behind its own. This queue serves keys by the tokens each was recently
given instead: the "virtual token counter" (VTC) of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024), inside priority bands:

- **bands**: band 0 goes before band 1, 1 before 2..., whatever the counters;
- **counters**: ``charge`` adds the tokens a key was served (prompt + output at dispatch, and
  corrections later); a counter decays by half every ``half_life_s``, so "served" means recently
  (the decay is computed lazily from each counter's last update, never by a loop over keys);
- **pick**: inside the first band that has entries, the key with the least service goes first,
  FIFO inside a key; ties between keys to the key with fewer entries waiting (a key sending one
  request at a time before a flood of them), then to the key whose first entry has waited longest;
- **the lift** (VTC's rule against banking credit): a key that has nothing queued in a band and
  pushes there has its counter lifted to at least the smallest among the keys queued in that band,
  so a key back from a long idle spell (or from waiting in a lower band) joins the others level
  instead of being served a whole burst ahead of them. A lifted key shares the counter it was
  lifted to exactly: a tie, which the key with fewer entries waiting wins;
- **bounds**: ``max_per_key`` entries per key (``Refused.KEY_FULL``: the key's fault, a 429) and
  ``max_len`` in all (``Refused.QUEUE_FULL``: the pool's, a 503). A counter is forgotten once its
  key has nothing queued and it has not changed for ``FORGET_AFTER_HALF_LIVES`` half-lives
  (decayed to under 1/1000 of itself), so the counters kept are those of the keys queued and of
  the keys charged (or idle) within that horizon.

Pure: no I/O, no clock of its own (every method that needs the time takes ``now``, monotonic
seconds). Items are matched by identity (``remove``), so they need not be hashable; one item is
queued at most once at a time. ``pop`` and ``push`` cost O(keys queued in the band).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

# A counter unchanged for this many half-lives (decayed to 2**-10 of itself) is forgotten once its key has nothing queued.
FORGET_AFTER_HALF_LIVES = 10.0


class Refused(Enum):
    """Why ``push`` refused an entry."""

    KEY_FULL = "key_full"  # this key already has max_per_key entries waiting (the key's fault: the caller answers 429)
    QUEUE_FULL = "queue_full"  # max_len entries wait in all (the pool's: the caller answers 503)


class _Counter(NamedTuple):
    """A key's tokens served, as of ``at``; it halves every half-life after that."""

    tokens: float
    at: float


@dataclass(eq=False, slots=True)
class _Entry(Generic[T]):
    """One item waiting: for which key, in which band, since when; ``seq`` orders pushes."""

    item: T
    key: str
    band: int
    pushed: float
    seq: int


class FairQueue(Generic[T]):
    """The entries waiting for a pool, by band, then by key's service, then FIFO (see the module docstring)."""

    def __init__(self, *, max_len: int, max_per_key: int, half_life_s: float = 60.0) -> None:
        if max_len < 1 or max_per_key < 1 or not half_life_s > 0:
            raise ValueError("max_len and max_per_key must be >= 1, half_life_s > 0")
        self.max_len = max_len
        self.max_per_key = max_per_key
        self.half_life_s = half_life_s
        # band -> key -> that key's entries in the band, oldest first (no empty band, no empty line)
        self._bands: dict[int, dict[str, deque[_Entry[T]]]] = {}
        # id(item) -> its entry, in push order (the first is the oldest)
        self._entries: OrderedDict[int, _Entry[T]] = OrderedDict()
        self._per_key: dict[str, int] = {}  # key -> entries queued, all bands (no zeros)
        self._counters: dict[str, _Counter] = {}
        # the keys with a counter and nothing queued, in the order they went idle or were last charged: forgotten from the front
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._seq = 0

    def push(self, item: T, *, key: str, band: int, now: float) -> Refused | None:
        """Queue item for key in band (0 first, then 1, 2...); None when queued."""
        if band < 0:
            raise ValueError(f"band must be >= 0, not {band}")
        if id(item) in self._entries:
            raise ValueError("item is already queued")
        waiting = self._per_key.get(key, 0)
        if waiting >= self.max_per_key:
            return Refused.KEY_FULL
        if len(self._entries) >= self.max_len:
            return Refused.QUEUE_FULL
        self._forget(now)
        keys = self._bands.setdefault(band, {})
        line = keys.get(key)
        if line is None:
            self._lift(key, keys, now)
            line = keys[key] = deque()
        entry = _Entry(item, key, band, now, self._seq)
        self._seq += 1
        line.append(entry)
        self._entries[id(item)] = entry
        self._per_key[key] = waiting + 1
        if waiting == 0:
            self._idle.pop(key, None)
        return None

    def pop(self, now: float) -> T | None:
        """The next item to admit, removed; None when empty.
        Lowest band first; inside a band, the key with the least service counted (``charge``, decayed); FIFO inside a key; ties
        between keys to the key with fewer entries waiting, then by the earliest waiting entry."""
        if not self._entries:
            return None
        keys = self._bands[min(self._bands)]
        key = min(keys, key=lambda k: (self.service(k, now), len(keys[k]), keys[k][0].seq))
        entry = keys[key][0]
        self._drop(entry)
        return entry.item

    def remove(self, item: T) -> bool:
        """Take item out (its client left, or it waited too long); False when it is not queued. O(1) or O(entries of its key)."""
        entry = self._entries.get(id(item))
        if entry is None:
            return False
        self._drop(entry)
        return True

    def charge(self, key: str, tokens: float, now: float) -> None:
        """Service given to key: tokens (prompt + output) at dispatch, and corrections later (may be negative; the counter never goes
        below 0)."""
        self._counters[key] = _Counter(max(0.0, self.service(key, now) + tokens), now)
        if key not in self._per_key:
            self._idle[key] = None
            self._idle.move_to_end(key)
        self._forget(now)

    def oldest(self) -> tuple[T, float] | None:
        """The entry that has waited longest, and when it was pushed (for expiring waits)."""
        if not self._entries:
            return None
        entry = next(iter(self._entries.values()))
        return entry.item, entry.pushed

    def queued(self, key: str) -> int:
        """The entries key has waiting, all bands."""
        return self._per_key.get(key, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def service(self, key: str, now: float) -> float:
        """The key's counter now, decayed (for tests and metrics): 0 for a key never charged (or forgotten)."""
        counter = self._counters.get(key)
        return 0.0 if counter is None else self._decayed(counter, now)

    def _decayed(self, counter: _Counter, now: float) -> float:
        return counter.tokens * math.pow(0.5, max(0.0, now - counter.at) / self.half_life_s)

    def _lift(self, key: str, keys: dict[str, deque[_Entry[T]]], now: float) -> None:
        """key joins a band where ``keys`` wait: lift its counter to at least the smallest of theirs."""
        lowest: _Counter | None = None
        lowest_tokens = 0.0
        for other in keys:
            counter = self._counters.get(other)
            if counter is None:
                return  # a key queued there at 0: nothing to lift to
            tokens = self._decayed(counter, now)
            if lowest is None or tokens < lowest_tokens:
                lowest, lowest_tokens = counter, tokens
        if lowest is not None and self.service(key, now) < lowest_tokens:
            self._counters[key] = lowest  # the very counter: equal to it until either is charged

    def _drop(self, entry: _Entry[T]) -> None:
        """Take a queued entry out of every index."""
        del self._entries[id(entry.item)]
        keys = self._bands[entry.band]
        line = keys[entry.key]
        if line[0] is entry:
            line.popleft()
        else:
            line.remove(entry)  # by identity (_Entry has eq=False)
        if not line:
            del keys[entry.key]
            if not keys:
                del self._bands[entry.band]
        left = self._per_key[entry.key] - 1
        if left:
            self._per_key[entry.key] = left
            return
        del self._per_key[entry.key]
        if entry.key in self._counters:
            self._idle[entry.key] = None

    def _forget(self, now: float) -> None:
        """Forget the counters of idle keys unchanged for FORGET_AFTER_HALF_LIVES half-lives, from the front of ``_idle``.

        A counter was last set no later than its key joined ``_idle`` (the keys ahead of it joined earlier still), so an idle key's
        counter goes at the first push or charge that comes that many half-lives after the key joined."""
        horizon = now - FORGET_AFTER_HALF_LIVES * self.half_life_s
        while self._idle:
            key = next(iter(self._idle))
            if self._counters[key].at > horizon:
                return
            del self._idle[key]
            del self._counters[key]
