"""Which worker holds which prompt prefix: an index of the router's own, fed by the engines'
KV-cache events.

The engines (vLLM, SGLang) publish a ``BlockStored`` for each full block of tokens they cache,
a ``BlockRemoved`` for each they evict, ``AllBlocksCleared`` when they drop everything
(backends/kv_events.py decodes them into the plain events below). This index keys a block by
its content, chained from the start of the prompt::

    key(block 0) = hash((root(space), tokens of block 0, extra keys of block 0))
    key(block i) = hash((key(block i - 1), tokens of block i, extra keys of block i))

so a request's prompt, cut into blocks the same way, finds the same keys without knowing the
engine's hash function or its seed (random per process). The engine's own block hashes are kept
only as handles: to find a stored block's parent, and to apply a ``BlockRemoved``.

A ``space`` keeps apart what must never match across: the cache medium, the KV-cache group, the
LoRA adapter. A block's extra keys (a ``cache_salt``, multimodal hashes) are part of its key, so
a salted block never matches an unsalted prompt. The block size is learned per space from the
events (16 on GPU builds of vLLM, 128 on its CPU build).

``overlap`` gives each worker's cached prefix, in tokens: the blocks it holds from the start of
the prompt, contiguously, as the engine's prefix cache matches them. Memory is bounded: at most
``max_blocks`` (worker, block) entries, the oldest stored out first.

Pure data: no I/O, no clock, no locks (one event loop owns it); hashes are Python's ``hash`` of
tuples of ints, which is not randomized, 64 bits, C speed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

# Where a block lives and what it was computed with: (medium, KV-cache group, LoRA adapter name).
# A BlockRemoved names only the medium and the group, so the engine's hashes are handles within those.
Space = tuple[str, int, str | None]
DEFAULT_SPACE: Space = ("GPU", 0, None)
Handle = tuple[str, int, Hashable]  # (medium, group, the engine's block hash)


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks a worker cached, in order: ``hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``."""

    hashes: Sequence[Hashable]
    parent: Hashable | None  # the engine's hash of the block before the first, None at the prompt's start
    token_ids: Sequence[int]
    block_size: int
    space: Space = DEFAULT_SPACE
    extra_keys: Sequence[Hashable] | None = None  # one per block (None: none)


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks a worker evicted, by the engine's hashes."""

    hashes: Sequence[Hashable]
    space: Space = DEFAULT_SPACE  # its LoRA name is not read: a removal names medium and group only


@dataclass(frozen=True, slots=True)
class Cleared:
    """The worker dropped every block."""


Event = Stored | Removed | Cleared


def root(space: Space) -> int:
    """The key a prompt's first block chains from, in ``space``."""
    return hash(("kv-root", space))


def block_keys(token_ids: Sequence[int], block_size: int, space: Space = DEFAULT_SPACE,
               extra_keys: Sequence[Hashable] | None = None, start: int | None = None) -> list[int]:
    """The keys of ``token_ids``' full blocks, chained from ``start`` (the key before the first
    block; ``root(space)`` when None)."""
    key = root(space) if start is None else start
    keys = []
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None else None
        key = hash((key, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra))
        keys.append(key)
    return keys


class KVIndex:
    """Per pool: which of its workers holds each block."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        # block key -> the workers holding it, each with how many of its handles name that key
        # (one, unless an engine stored the same content under two hashes)
        self._holders: dict[int, dict[str, int]] = {}
        # worker -> its handles -> (block key, when stored), each in the order stored
        self._handles: dict[str, OrderedDict[Handle, tuple[int, int]]] = {}
        self._entries = 0
        self._stamp = 0  # counts puts: what "oldest" compares
        self._block_size: dict[Space, int] = {}
        self.orphans = 0  # stored blocks whose parent the index did not hold (not indexed)
        self.malformed = 0  # stored events whose tokens did not fill their blocks (not indexed)
        self.evicted = 0  # entries dropped to stay within max_blocks

    def __len__(self) -> int:
        """(worker, block) entries held."""
        return self._entries

    def held(self, worker: str) -> int:
        """Entries held for ``worker``."""
        handles = self._handles.get(worker)
        return len(handles) if handles is not None else 0

    def block_size(self, space: Space = DEFAULT_SPACE) -> int | None:
        return self._block_size.get(space)

    def apply(self, worker: str, event: Event) -> None:
        """One of ``worker``'s events."""
        if isinstance(event, Stored):
            self._stored(worker, event)
        elif isinstance(event, Removed):
            medium, group = event.space[0], event.space[1]
            for handle in event.hashes:
                self._drop(worker, (medium, group, handle))
        elif isinstance(event, Cleared):
            self.forget(worker)
        else:
            raise TypeError(f"not a KV event: {type(event).__name__}")

    def apply_all(self, worker: str, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(worker, event)

    def forget(self, worker: str) -> None:
        """Everything ``worker`` held (it cleared its cache, restarted, or left the pool)."""
        handles = self._handles.pop(worker, None)
        if handles:
            self._entries -= len(handles)
            for key, _ in handles.values():
                self._release(worker, key)

    def overlap(self, token_ids: Sequence[int], space: Space = DEFAULT_SPACE,
                keys: Sequence[int] | None = None) -> dict[str, int]:
        """Each worker's cached prefix of ``token_ids``, in tokens (workers with none are absent).
        ``keys``: the prompt's block keys, when the caller has them already."""
        size = self._block_size.get(space)
        if size is None:
            return {}
        cached: dict[str, int] = {}
        alive: set[str] | None = None
        key = root(space)
        for depth in range(1, (len(token_ids) if keys is None else len(keys) * size) // size + 1):
            if keys is None:  # made as far as they match: a miss costs one hash
                key = hash((key, tuple(token_ids[(depth - 1) * size:depth * size]), None))
            else:
                key = keys[depth - 1]
            holders = self._holders.get(key)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            for worker in alive:
                cached[worker] = depth * size
        return cached

    # -- the entries

    def _stored(self, worker: str, event: Stored) -> None:
        size, hashes = event.block_size, event.hashes
        if size < 1 or len(event.token_ids) != len(hashes) * size or (
                event.extra_keys is not None and len(event.extra_keys) != len(hashes)):
            self.malformed += 1
            return
        if event.parent is None:
            start = root(event.space)
        else:
            handles = self._handles.get(worker)
            parent = handles.get((event.space[0], event.space[1], event.parent)) if handles is not None else None
            if parent is None:  # its parent was evicted here, or stored before we listened
                self.orphans += len(hashes)
                return
            start = parent[0]
        self._block_size[event.space] = size
        keys = block_keys(event.token_ids, size, event.space, event.extra_keys, start=start)
        handles = self._handles.setdefault(worker, OrderedDict())
        medium, group = event.space[0], event.space[1]
        for engine_hash, key in zip(hashes, keys, strict=True):
            handle = (medium, group, engine_hash)
            old = handles.pop(handle, None)
            if old is not None:  # stored again: it moves to the newest end
                self._release(worker, old[0])
                self._entries -= 1
            self._stamp += 1
            handles[handle] = (key, self._stamp)
            holders = self._holders.setdefault(key, {})
            holders[worker] = holders.get(worker, 0) + 1
            self._entries += 1
        while self._entries > self.max_blocks:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        """The oldest entry of all: the oldest of the worker whose oldest is oldest (few workers)."""
        worker = min((w for w, h in self._handles.items() if h), key=lambda w: next(iter(self._handles[w].values()))[1])
        handle = next(iter(self._handles[worker]))
        self._drop(worker, handle)
        self.evicted += 1

    def _drop(self, worker: str, handle: Handle) -> None:
        handles = self._handles.get(worker)
        entry = handles.pop(handle, None) if handles is not None else None
        if entry is not None:
            self._entries -= 1
            self._release(worker, entry[0])

    def _release(self, worker: str, key: int) -> None:
        holders = self._holders[key]
        left = holders[worker] - 1
        if left:
            holders[worker] = left
            return
        del holders[worker]
        if not holders:
            del self._holders[key]
