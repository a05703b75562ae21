"""A pool's prefix index and one KV-event subscription per worker: the data producer a cache-aware
policy reads.

``watch`` starts a worker's subscription (backends/kv_subscriber.py) on its event endpoint: a
managed worker's is the router's own (backends/engines.py ``kv_event_endpoints``), an external
worker's is configured (``[pools.kv_events] endpoints``) or asked of the worker
(``discover``: vLLM's ``GET /kv_event_sources``). ``unwatch`` ends it and drops what the worker
held (it left the pool); ``restarted`` drops it too (an engine back from being down starts with
an empty cache; its sequence restarting says so as well).

A subscription that fails (an endpoint ZMQ cannot use) is logged once and leaves that worker
without entries: routing for it falls back to load alone, no request fails.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import orjson

from backends.client import WorkerClient, WorkerError
from backends.kv_subscriber import Counts, KVSubscriber
from policies.kv_index import KVIndex

log = logging.getLogger("router.kv_events")

SOURCES_PATH = "/kv_event_sources"  # vLLM's: the KV-events config it runs with, by data-parallel rank


class KVFeed:
    """One pool's index and its workers' subscriptions."""

    def __init__(self, pool: str, index: KVIndex, *, topic: str = "kv") -> None:
        self.pool = pool
        self.index = index
        self.topic = topic
        self._subscriptions: dict[str, tuple[KVSubscriber, asyncio.Task[None]]] = {}

    def watch(self, url: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe to ``url``'s events on ``endpoint`` (again, if it was already)."""
        self.unwatch(url)
        subscriber = KVSubscriber(self.index, url, endpoint, replay_endpoint=replay_endpoint, topic=self.topic)
        task = asyncio.get_running_loop().create_task(self._run(subscriber), name=f"kv-events:{url}")
        self._subscriptions[url] = (subscriber, task)
        log.info("pool %s: indexing the KV cache of %s from %s", self.pool, url, endpoint)

    def unwatch(self, url: str) -> None:
        """Stop ``url``'s subscription and drop what it held."""
        found = self._subscriptions.pop(url, None)
        if found is not None:
            found[1].cancel()
        self.index.forget(url)

    def restarted(self, url: str) -> None:
        """``url`` came back after being seen down: its cache is empty."""
        self.index.forget(url)

    def held(self, url: str) -> int:
        """Blocks indexed for ``url``."""
        return self.index.held(url)

    def counts(self, url: str) -> Counts | None:
        found = self._subscriptions.get(url)
        return found[0].counts if found is not None else None

    async def discover(self, client: WorkerClient, url: str) -> tuple[str, str | None] | None:
        """An external worker's event and replay endpoints, as it reports them (None: it does not)."""
        try:
            status, body = await client.get(url + SOURCES_PATH)
            sources = orjson.loads(body) if status == 200 else None
        except (WorkerError, orjson.JSONDecodeError):
            sources = None
        first = next(iter(sources.values()), None) if isinstance(sources, dict) and sources else None
        if not isinstance(first, dict) or not isinstance(first.get("endpoint"), str) or \
                not first.get("enable_kv_cache_events", True):
            log.warning("pool %s: %s reports no KV events (%s); routing for it goes by load alone", self.pool, url, SOURCES_PATH)
            return None
        endpoint, replay = first["endpoint"], first.get("replay_endpoint")
        host = urlsplit(url).hostname or "127.0.0.1"
        return reachable(endpoint, host), reachable(replay, host) if isinstance(replay, str) else None

    async def stop(self) -> None:
        tasks = [task for _, task in self._subscriptions.values()]
        self._subscriptions.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, subscriber: KVSubscriber) -> None:
        try:
            await subscriber.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one worker's events, never the router
            log.warning("pool %s: KV events from %s stopped (%s); routing for it goes by load alone",
                        self.pool, subscriber.worker, exc)
            self.index.forget(subscriber.worker)


def reachable(endpoint: str, host: str) -> str:
    """An endpoint the engine binds (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) as the router reaches it."""
    for wildcard in ("*", "0.0.0.0", "[::]"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:" + endpoint[len(prefix):]
    return endpoint
