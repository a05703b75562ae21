"""The simulated worker's prefix cache: an LRU of fixed-size token blocks.

It exists so that routing policies can be measured on the sim: a request
whose prompt starts with blocks the worker already holds reports them as
`cached_tokens` and reaches its first token sooner (only uncached tokens pay
the prefill cost), the way vLLM's automatic prefix caching and SGLang's radix
cache behave. Block hashes are chained like vLLM's (each block's hash covers
its parent's hash), so a block matches only at the same position after the
same prefix. Like vLLM, only full blocks are cached and the last prompt
token is always computed (a fully cached prompt still needs its logits).

Chat prompts have no tokenizer here: `chat_token_ids` stands in for one and
yields exactly `count_prompt_tokens(messages)` ids. Harmony prompts use their
real token ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from backends.sim.script import message_text

BLOCK_TOKENS = 16  # vLLM's default block size
_START, _SEP = 1, 2  # a message's header: START, role, SEP (3 tokens, as count_prompt_tokens says)
_WORD_BASE = 1000  # word ids start here, above the role ids


def _word_id(word: str) -> int:
    return _WORD_BASE + zlib.crc32(word.encode()) % 1_000_000_000


def _role_id(role: object) -> int:
    return 10 + zlib.crc32(str(role).encode()) % 900


def message_ids(message: dict) -> list[int]:
    """One message as ids: a 3-token header, its words, its tool calls' words."""
    words = message_text(message).split()
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            words += f"{fn.get('name') or ''} {fn.get('arguments') or ''}".split()
    return [_START, _role_id(message.get("role")), _SEP, *map(_word_id, words)]


def chat_token_ids(messages: list[dict]) -> list[int]:
    """The rendered prompt: every message, then the reply header (an assistant
    message's header, so the next turn's prompt extends this one exactly)."""
    ids: list[int] = []
    for m in messages:
        ids += message_ids(m)
    return ids + [_START, _role_id("assistant"), _SEP]


def reply_ids(content: str | None, tool_calls: list[dict] | None = None) -> list[int]:
    """The ids an answer adds after the prompt: what the next turn replays."""
    return message_ids({"role": "assistant", "content": content, "tool_calls": tool_calls})[3:]


def block_hashes(ids: Sequence[int], block: int, limit: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of ids[:limit]."""
    n = len(ids) if limit is None else min(limit, len(ids))
    out: list[bytes] = []
    parent = b""
    for start in range(0, n - n % block, block):
        parent = hashlib.blake2b(parent + array("q", ids[start:start + block]).tobytes(),
                                 digest_size=16).digest()
        out.append(parent)
    return out


# What the cache tells a listener (backends/sim/kv_events.py) as it changes: the blocks it stored,
# each (hash, parent's hash or None, its tokens), in prompt order, and the hashes it evicted.
Listener = Callable[[list[tuple[bytes, bytes | None, list[int]]], list[bytes]], None]


class PrefixCache:
    """Resident blocks in LRU order; capacity 0 turns caching off.

    Counters are in tokens like vLLM's prefix_cache_queries/hits. ``listener``, when set, hears
    of every block stored and evicted, as an engine publishes KV-cache events."""

    def __init__(self, capacity_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.capacity = max(0, capacity_blocks)
        self.block = block_tokens
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0
        self.hits = 0
        self.listener: Listener | None = None

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def used(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """Resident blocks / capacity, 0..1."""
        return len(self._blocks) / self.capacity if self.capacity else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def lookup(self, ids: Sequence[int]) -> int:
        """Cached leading tokens of a prompt (at most len - 1); then the prompt's
        blocks are inserted, so the next request with this prefix hits."""
        if not self.enabled:
            return 0
        hashes = block_hashes(ids, self.block, len(ids) - 1)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self._blocks:
            hit += 1
        self.queries += len(ids)
        self.hits += hit * self.block
        self._insert(ids, hashes)
        return hit * self.block

    def insert(self, ids: Sequence[int]) -> None:
        """Cache the full blocks of ids (a prompt and its answer, after generation)."""
        if self.enabled:
            self._insert(ids, block_hashes(ids, self.block))

    def _insert(self, ids: Sequence[int], hashes: list[bytes]) -> None:
        listener = self.listener
        new = [i for i, h in enumerate(hashes) if h not in self._blocks] if listener is not None else []
        # Touched tail first, so a chain's head is the most recent and goes last:
        # vLLM frees a request's blocks in reverse order for the same reason.
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if listener is not None and (new or evicted):
            block = self.block
            stored = [(hashes[i], hashes[i - 1] if i else None, list(ids[i * block:(i + 1) * block])) for i in new]
            listener(stored, evicted)


class Prefill:
    """A worker's prompt phase: the prefix cache's lookup, then the uncached
    tokens' compute. Prefill is compute-bound, so a worker prefills one prompt
    at a time (a GPU is not faster for more prompts): a cache miss also delays
    the prompts queued behind it, as on a real engine under load."""

    def __init__(self, cache: PrefixCache, us_per_token: float) -> None:
        self.cache = cache
        self.us_per_token = us_per_token
        self.gpu = asyncio.Lock()

    def lookup(self, ids: Sequence[int] | None, n: int, forced: int | None) -> tuple[int | None, float]:
        """(cached tokens, compute seconds) for a prompt of n tokens: the cache's
        hit unless a [sim:cached=N] marker says (None: neither)."""
        hit = self.cache.lookup(ids) if ids is not None else None
        cached = min(forced, n) if forced is not None else hit
        return cached, (n - (cached or 0)) * self.us_per_token / 1e6

    async def run(self, ids: Sequence[int] | None, n: int, forced: int | None) -> int | None:
        """Look up, then compute the uncached tokens; the cached token count."""
        cached, seconds = self.lookup(ids, n, forced)
        if seconds > 0:
            async with self.gpu:
                await asyncio.sleep(seconds)
        return cached


def cache_metric_lines(engine: str, labels: str, cache: PrefixCache) -> list[str]:
    """The engines' cache gauges and counters in Prometheus text.

    vLLM: kv_cache_usage_perc (0..1), prefix_cache_queries/hits_total (tokens).
    SGLang: token_usage (0..1) and cache_hit_rate. A real engine counts cached
    blocks no running request holds as free; the sim reports resident blocks,
    so the signal is visible between requests."""
    metrics: tuple[tuple[str, str, str, float], ...]  # name, type, help, value
    if engine == "sglang":
        metrics = (("sglang:token_usage", "gauge", "The token usage", cache.usage),
                   ("sglang:cache_hit_rate", "gauge", "The cache hit rate", cache.hit_rate))
    else:
        metrics = (("vllm:kv_cache_usage_perc", "gauge",
                    "KV-cache usage. 1 means 100 percent usage.", cache.usage),
                   ("vllm:prefix_cache_queries_total", "counter",
                    "Prefix cache queries, in terms of number of queried tokens.", cache.queries),
                   ("vllm:prefix_cache_hits_total", "counter",
                    "Prefix cache hits, in terms of number of cached tokens.", cache.hits))
    lines: list[str] = []
    for name, kind, help_, value in metrics:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                  f"{name}{{{labels}}} {float(value)}"]
    return lines
