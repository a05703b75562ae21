"""Start-up: config -> store, pools, managed workers -> the ASGI app.

Start-up and shut-down run outside the ASGI lifespan so that a failure
(a worker that will not start, an unreadable store) ends the process with
one readable line instead of a server traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

from starlette.applications import Starlette

from backends.client import TLSError, WireLimits, WorkerClient, tls_context
from backends.engines import LaunchOptions, kv_event_endpoints
from backends.gate import Gate
from backends.kv_feed import KVFeed
from backends.launcher import ManagedWorker, WorkerSpec, check_pool, free_ports, start_workers
from backends.pools import Pool
from backends.worker import Worker
from policies.affinity import Affinity
from policies.balance import make_balancer
from policies.kv_aware import KVAware
from policies.kv_index import KVIndex
from router import telemetry
from router.api import access
from router.api.admin import AdminAPI
from router.api.auth import Authenticator
from router.api.compaction import CompactionAPI
from router.api.conversations import ConversationsAPI
from router.api.create import Creator
from router.api.errors import HANDLERS
from router.api.fastpath import FastPath
from router.api.meta import MetaAPI
from router.api.passthrough import PassthroughAPI
from router.api.responses import ResponsesAPI
from router.api.websocket import ResponsesWebSocket
from router.config import STOP_MARGIN_S, Config, ConfigError, PoolConfig
from router.dialects.chat import ChatOptions
from router.limits import Admission, make_admission
from router.metrics import RouterMetrics
from router.protocol.sealing import make_sealer
from router.state import make_store
from router.state.sqlite import SQLiteStore
from router.state.store import Store
from router.state.timed import TimedStore
from router.tools.registry import RouterTools
from router.turns.background import BackgroundRuns
from router.turns.leases import Leases
from router.turns.route import ModelRoute
from router.turns.routing import ModelTarget

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding  # loaded only when a pool speaks harmony

log = logging.getLogger("router")


@dataclass(eq=False)
class RouterApp:
    config: Config
    base_dir: Path
    store: Store
    pools: dict[str, Pool]
    app: FastPath
    background: BackgroundRuns
    metrics: RouterMetrics | None = None
    limits: Admission | None = None
    managed: dict[str, list[ManagedWorker]] = field(default_factory=dict)
    kv_events_dir: str | None = None  # the sockets managed engines publish KV events on
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: asyncio.Future[None] | None = None

    async def startup(self) -> None:
        await self.store.open()
        await self.background.start()
        if self.metrics is not None:
            self._tasks.append(asyncio.create_task(self.metrics.sample_loop_lag(), name="loop-lag"))
        if self.config.store.ttl_s is not None:
            self._tasks.append(asyncio.create_task(self._purge_loop(self.config.store.ttl_s), name="purge"))
        for cfg in self.config.pools:
            pool = self.pools[cfg.name]
            if cfg.managed is not None:
                self.managed[cfg.name] = await self._launch(cfg, pool)
                await pool.client.close()
            await pool.start()
            await self._check_workers(cfg, pool)
            if pool.kv is not None:
                await self._watch_kv_events(cfg, pool)

    async def _watch_kv_events(self, cfg: PoolConfig, pool: Pool) -> None:
        """Each worker's KV events into the pool's index (backends/kv_feed.py): a managed worker's on
        the router's own socket, an external one's as configured or as it reports."""
        feed, events = pool.kv, cfg.kv_events
        assert feed is not None
        for i, worker in enumerate(pool.workers):
            if cfg.managed is not None and self.kv_events_dir is not None:
                feed.watch(worker.url, *kv_event_endpoints(self.kv_events_dir, urlsplit(worker.url).port or 0))
            elif events.endpoints is not None:
                feed.watch(worker.url, events.endpoints[i],
                           events.replay_endpoints[i] if events.replay_endpoints is not None else None)
            else:
                found = await feed.discover(pool.client, worker.url)
                if found is not None:
                    feed.watch(worker.url, *found)

    async def _check_workers(self, cfg: PoolConfig, pool: Pool) -> None:
        """One line per pool: what its workers say they serve, and what will not work (backends/launcher.py
        ``check_pool``). A vLLM harmony pool whose workers lack the generate endpoint calls
        /v1/completions from the first request on."""
        line, ok, found = await check_pool(pool.client, pool.engine, pool.model, [w.url for w in pool.workers],
                                           harmony=cfg.dialect == "harmony", context_length=cfg.context_length)
        if cfg.dialect == "harmony" and pool.engine.name == "vllm" and any(f.generate is False for f in found):
            pool.no_generate = True
        kind = "managed" if cfg.managed is not None else "attached"
        (log.info if ok else log.warning)("pool %s (%s, %s): %s", cfg.name, cfg.engine, kind, line)

    async def _purge_loop(self, ttl_s: int) -> None:
        """Expired responses already read as not found; this frees their space."""
        while True:
            await asyncio.sleep(min(60.0, ttl_s / 4))
            try:
                purged = await self.store.purge_expired(int(time.time()))
                if purged:
                    log.info("store: purged %d expired responses", purged)
            except Exception:  # keep purging whatever one round did
                log.exception("store: purge failed")

    def begin_stop(self) -> None:
        """The stop began (SIGTERM): background responses get the grace along with the requests, not after."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self.background.stop(self.config.server.shutdown_grace_s, STOP_MARGIN_S))

    async def shutdown(self, deadline: float | None = None) -> None:
        """Stop everything; managed workers get what is left until ``deadline`` (loop time) before SIGKILL."""
        for task in self._tasks:
            task.cancel()
        self.begin_stop()
        assert self._stopping is not None
        await self._stopping
        for pool in self.pools.values():
            for worker in pool.workers:
                worker.healthy = False  # stop routing new requests first
        stops = []
        loop = asyncio.get_running_loop()
        for cfg in self.config.pools:
            for managed in self.managed.get(cfg.name, ()):
                assert cfg.managed is not None
                stop_s = cfg.managed.stop_timeout_s
                if deadline is not None:
                    stop_s = max(0.5, min(stop_s, deadline - loop.time()))
                stops.append(managed.stop(stop_s))
        await asyncio.gather(*stops, return_exceptions=True)
        await asyncio.gather(*(pool.stop() for pool in self.pools.values()), return_exceptions=True)
        await self.store.close()
        if self.limits is not None:
            await self.limits.budgets.close()
        if self.kv_events_dir is not None:
            shutil.rmtree(self.kv_events_dir, ignore_errors=True)
        await asyncio.to_thread(telemetry.shutdown)  # the last spans, within telemetry.FLUSH_S

    async def _launch(self, cfg: PoolConfig, pool: Pool) -> list[ManagedWorker]:
        managed = cfg.managed
        assert managed is not None
        host = "127.0.0.1"
        ports = free_ports(*managed.port_range, managed.replicas, host)
        log_dir = self.base_dir / managed.log_dir if managed.log_dir else None
        if cfg.kv_events.enabled and self.kv_events_dir is None:
            self.kv_events_dir = tempfile.mkdtemp(prefix="responses-router-kv-")
        options = launch_options(cfg, self.base_dir, self.kv_events_dir if cfg.kv_events.enabled else None)
        specs = [
            WorkerSpec(
                engine=cfg.engine,
                model=cfg.model,
                command=list(managed.command),
                extra_args=list(managed.extra_args),
                host=host,
                env=managed.replica_env(i),
                log_path=log_dir / f"{cfg.name}-{i}.log" if log_dir else None,
                options=options,
            )
            for i in range(managed.replicas)
        ]
        workers = await start_workers(
            specs, ports, pool.client, label=f"pool {cfg.name}", timeout_s=managed.start_timeout_s,
            on_exit=lambda mw, code: pool.mark_down(_worker_for(pool, mw.url), f"process exited with code {code}"),
        )
        pool.workers = [Worker(w.url, healthy=True, process=w) for w in workers]
        return workers


def launch_options(cfg: PoolConfig, base_dir: Path, kv_events_dir: str | None = None) -> LaunchOptions:
    """What a managed pool's config says its engine must be started with (backends/engines.py
    ``derived_flags``): derived for the engine's own command unless ``derive_flags`` says otherwise."""
    managed = cfg.managed
    assert managed is not None
    python = managed.python
    if not python:
        python = sys.executable
    elif "/" in python:  # a path, relative to the config file; a bare name is looked up on PATH
        python = str(base_dir / python)
    derive = managed.derive_flags if managed.derive_flags is not None else not managed.command
    return LaunchOptions(
        dialect=cfg.dialect, context_length=cfg.context_length,
        tensor_parallel=len(managed.gpus) // managed.replicas if managed.gpus else None,
        tool_call_parser=managed.tool_call_parser, reasoning_parser=managed.reasoning_parser,
        priority=cfg.honor_service_tier, python=python, derive=derive, kv_events_dir=kv_events_dir,
    )


def _tls(cfg: PoolConfig, index: int, base_dir: Path) -> ssl.SSLContext | None:
    """The TLS context of a pool with https workers (config validated that TLS files come only with
    them); a file that cannot be used stops start-up with one line naming its key."""
    if not any(url.startswith("https://") for url in cfg.urls):
        return None

    def path(value: str | None) -> str | None:
        return str(base_dir / value) if value is not None else None

    try:
        return tls_context(path(cfg.tls_ca_file), path(cfg.tls_cert_file), path(cfg.tls_key_file))
    except TLSError as exc:
        raise ConfigError(f"pools[{index}].{exc.key}: {exc}") from None


def _pool(cfg: PoolConfig, index: int, base_dir: Path) -> Pool:
    affinity = cfg.policy == "affinity"
    by_load = affinity or cfg.policy == "kv_aware"  # what they fall back to, and pick by when they have nothing else
    limits = WireLimits(max_answer_bytes=cfg.max_answer_bytes, max_frame_bytes=cfg.max_frame_bytes,
                        first_byte_timeout_s=cfg.first_byte_timeout_s)
    pool = Pool.create(
        name=cfg.name, engine=cfg.engine, model=cfg.model,
        balancer=make_balancer("least_load" if by_load else cfg.policy), urls=cfg.urls,
        connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s, health_interval_s=cfg.health_interval_s,
        limits=limits,
    )
    tls = _tls(cfg, index, base_dir)
    if tls is not None:  # one client, one context: model calls, health checks and scrapes trust alike
        pool.client = WorkerClient(connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                                   limits=limits, tls=tls)
    if affinity:
        pool.affinity = Affinity(pool.balancer, overload_factor=cfg.overload_factor)
    pool.scrape_metrics = cfg.scrape_metrics
    events = cfg.kv_events
    if events.enabled:
        pool.kv = KVFeed(cfg.name, KVIndex(events.max_blocks), topic=events.topic)
    if cfg.policy == "kv_aware":
        pool.kv_policy = KVAware(tokens_per_request=events.tokens_per_request, window=events.window,
                                 speculative_s=events.speculative_s)
    return pool


def _harmony_encoding(config: Config, base_dir: Path) -> HarmonyEncoding:
    """Load the harmony encoding at start-up, so a missing vocabulary fails now, not at the first request."""
    import os

    from router.dialects.harmony_vocab import ENV_VAR, FILE_NAME

    if config.harmony.vocab_dir:
        os.environ[ENV_VAR] = str((base_dir / config.harmony.vocab_dir).resolve())
    folder = os.environ.get(ENV_VAR)
    if not folder or not (Path(folder) / FILE_NAME).is_file():
        raise ConfigError(
            f"harmony pools need {FILE_NAME}: run `responses-router harmony-vocab DIR` and set [harmony] vocab_dir = \"DIR\""
            f" (or {ENV_VAR})" + (f"; not found in {folder}" if folder else "")
        )
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # noqa: BLE001 - openai-harmony raises its own error types
        raise ConfigError(f"harmony vocabulary in {folder} could not be loaded: {exc}") from None


def _worker_for(pool: Pool, url: str) -> Worker:
    return next(w for w in pool.workers if w.url == url)


def _key_owners(config: Config) -> dict[str, str]:
    """Key digest -> owner name. Two names on one key would hand one owner's stored responses to the
    other (the later name won), and the admin key must not be a client's key: both stop start-up."""
    owners: dict[str, str] = {}
    for key in config.auth.keys:
        digest = key.digest()
        if digest in owners:
            raise ConfigError(f"auth.keys: {owners[digest]!r} and {key.name!r} have the same key")
        owners[digest] = key.name
    admin = config.auth.admin_key
    if admin and hashlib.sha256(admin.encode()).hexdigest() in owners:
        raise ConfigError("auth.admin_key: it is also a client key")
    return owners


def build(config: Config, base_dir: Path) -> RouterApp:
    telemetry.setup(config.telemetry)
    store = make_store(config.store, base_dir)
    pools = {cfg.name: _pool(cfg, i, base_dir) for i, cfg in enumerate(config.pools)}
    metrics = RouterMetrics()
    queue = config.limits.queue
    for cfg in config.pools:
        pools[cfg.name].max_model_len = cfg.context_length
        if cfg.max_in_flight_per_worker is not None or cfg.max_engine_waiting is not None:
            pools[cfg.name].set_gate(Gate(max_in_flight=cfg.max_in_flight_per_worker, max_waiting=cfg.max_engine_waiting,
                                          max_queued=queue.max_queued, max_per_key=queue.max_queued_per_key,
                                          max_wait_s=queue.max_wait_s, half_life_s=queue.half_life_s,
                                          on_wait=metrics.limits.queued, on_refused=metrics.limits.rejected))
    if isinstance(store, SQLiteStore):  # commit on the loop only while at most one worker call is out
        # (a stream's own: its first put and its checkpoints are made while its call runs)
        store.quiet = lambda: sum(w.in_flight for p in pools.values() for w in p.workers) <= 1
    encoding = _harmony_encoding(config, base_dir) if any(p.dialect == "harmony" for p in config.pools) else None
    model_routes = {
        cfg.name: ModelRoute(cfg.name, pools[cfg.name], cfg.dialect,
                             ChatOptions(**cfg.chat.model_dump(), engine=cfg.engine, honor_service_tier=cfg.honor_service_tier),
                             encoding if cfg.dialect == "harmony" else None)
        for cfg in config.pools
    }
    key_events = {k.name: k.reasoning_events for k in config.auth.keys if k.reasoning_events is not None}
    targets = {m.name: ModelTarget.from_config(m, model_routes, affinity={c.name for c in config.pools if c.policy == "affinity"},
                                               key_events=key_events)
               for m in config.models}
    metrics.watch_pools(lambda: pools.values())
    metrics.watch_requests(access.active)
    store = cast(Store, TimedStore(store, metrics.store_call))  # every store call timed (router/state/timed.py)
    leases = Leases(store, lease_s=config.background.lease_s, sweep_all_at_start=config.store.kind == "sqlite")
    background = BackgroundRuns(store, leases, max_events=config.background.max_events)
    auth = Authenticator(_key_owners(config))
    if not config.auth.keys:
        log.warning("no [auth] keys configured: the router is OPEN, every caller shares one owner's stored state")
    router_tools = RouterTools.from_config(config.tools, base_dir)
    sealer = make_sealer(config.sealing.resolved_keys())
    creator = Creator(store=store, models=targets, ttl_s=config.store.ttl_s, router_tools=router_tools, metrics=metrics,
                      sealer=sealer)
    limits = make_admission(config, metrics.limits, queued=any(p.gated for p in pools.values()))
    responses = ResponsesAPI(creator=creator, auth=auth, max_body_bytes=config.server.max_body_bytes,
                             background=background, leases=leases, limits=limits)
    passthrough = PassthroughAPI(models=targets, auth=auth, max_body_bytes=config.server.max_body_bytes, metrics=metrics,
                                 limits=limits)
    routes = [
        *CompactionAPI(store=store, models=targets, auth=auth, max_body_bytes=config.server.max_body_bytes, sealer=sealer,
                       ttl_s=config.store.ttl_s, router_tools=router_tools).routes(),
        *responses.routes(),
        *ResponsesWebSocket(creator=creator, auth=auth, max_body_bytes=config.server.max_body_bytes,
                            max_age_s=config.server.websocket_max_age_s, leases=leases).routes(),
        *ConversationsAPI(store=store, auth=auth, max_body_bytes=config.server.max_body_bytes, sealer=sealer).routes(),
        *passthrough.routes(),
        *MetaAPI(models=list(targets), pools=list(pools.values()), auth=auth, metrics=metrics,
                 admin_key=config.auth.admin_key, store=store).routes(),
        *AdminAPI(pools=pools, models=targets, admin_key=config.auth.admin_key).routes(),
    ]
    starlette = Starlette(routes=routes, exception_handlers=HANDLERS)
    # No 307 to the path without its trailing slash: it came before any key check, empty, with a
    # Location made from the client's Host header. Such a path is a 404 like any unknown one.
    starlette.router.redirect_slashes = False
    app = FastPath(starlette, {**responses.hot_routes(), **passthrough.hot_routes()})
    return RouterApp(config=config, base_dir=base_dir, store=store, pools=pools, app=app, background=background,
                     metrics=metrics, limits=limits)
