"""The simulated worker's HTTP server: its routes, generation slots and pacing.

``build_app`` gives the aiohttp application (``/health``, ``/v1/models``, ``/metrics``,
``/v1/chat/completions``, and with ``--dialect harmony`` backends/sim/harmony.py's routes);
``serve`` runs it until SIGTERM. Each request is planned first (backends/sim/plan.py), then
waits for a slot and is answered in the engine's shapes (backends/sim/bodies.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid

import orjson
from aiohttp import web

from backends.sim.bodies import chunk_body, completion_body, usage
from backends.sim.cache import Prefill, PrefixCache, chat_token_ids, reply_ids
from backends.sim.config import SimConfig
from backends.sim.metrics import Stats, render_metrics
from backends.sim.plan import Plan, plan_request
from backends.sim.script import SimError, Step, cut_steps, error_body, logprobs_body, message_fields, step_delta


class SimWorker:
    """Per-process state: config, counters and the generation slots."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.stats = Stats()
        self.slots = asyncio.Semaphore(cfg.max_concurrency)
        self.cache = PrefixCache(cfg.kv_cache_blocks, cfg.kv_block_size)
        self.prefill = Prefill(self.cache, cfg.prefill_us_per_token)

    def remember(self, plan: Plan) -> None:
        """Cache the prompt and its answer as the next turn replays them."""
        if plan.prompt_ids is not None:
            f = message_fields(plan.steps, plan.calls, plan.forced)
            calls = [{"function": {"name": c.name, "arguments": a}} for _, c, a in f["tool_calls"]]
            self.cache.insert(plan.prompt_ids + reply_ids(f["content"], calls))

    @contextlib.asynccontextmanager
    async def slot(self, plan: Plan):
        """Wait (counted as waiting) for a generation slot, hold it (counted
        as running); the gauges go back down however the request ends."""
        self.stats.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.stats.waiting -= 1
        self.stats.running += 1
        self.stats.prompt_tokens += plan.prompt_tokens
        try:
            yield
        finally:
            self.stats.running -= 1
            self.slots.release()

    async def produce(self, plan: Plan):
        """Yield steps at the simulated inter-token pace (the caller waited
        the time to first token), counting tokens; stop early at drop_after."""
        steps = plan.steps if plan.drop_after is None else cut_steps(plan.steps,
                                                                      plan.drop_after)[0]
        started = False
        for step in steps:
            if step.tokens:
                if started and plan.itl_s:
                    await asyncio.sleep(plan.itl_s)
                started = True
                self.stats.generation_tokens += 1
            yield step

    def _running(self, plan: Plan, sent: list[Step]) -> dict | None:
        """Usage so far, on every chunk with stream_options.continuous_usage_stats."""
        return usage(self.cfg, plan, sent, True) if plan.continuous_usage else None

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return _json(error_body(self.cfg.engine, status, message, param), status)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's chat form of ``POST /tokenize``: the prompt's ids as this sim tokenizes it (what its
        prefix cache keys and its KV events carry), ``count`` and ``max_model_len`` beside them."""
        try:
            body = orjson.loads(await request.read())
            messages = body["messages"]
            if not isinstance(messages, list):
                raise TypeError("messages")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return self.error(400, "tokenize takes a JSON body with messages", "messages")
        ids = chat_token_ids(messages)
        return web.json_response({"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.cfg.model, "object": "model", "created": int(time.time()),
                "owned_by": self.cfg.engine, "root": self.cfg.model, "parent": None,
                "max_model_len": self.cfg.max_model_len}
        return _json({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.cfg.engine, self.cfg.model, self.stats, self.cache)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            plan = plan_request(orjson.loads(await request.read()), self.cfg)
        except orjson.JSONDecodeError as exc:
            return self.error(400, f"Invalid JSON body: {exc}")
        except SimError as exc:
            return self.error(*exc.args)
        if plan.status is not None:
            return self.error(plan.status, "simulated failure")
        if plan.stream:
            return await self._stream(request, plan)
        return await self._complete(request, plan)

    async def _complete(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        async with self.slot(plan):
            if plan.hang:
                await asyncio.Event().wait()  # cancelled when the client leaves
            await asyncio.sleep(plan.ttft_s)
            plan.cached = await self.prefill.run(plan.prompt_ids, plan.prompt_tokens, plan.cached)
            async for _ in self.produce(plan):
                pass
            if plan.drop_after is not None:
                return _drop(request)
            self.remember(plan)
            self.stats.success["length" if plan.finish_reason == "length" else "stop"] += 1
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        return _json(completion_body(self.cfg, cid, int(time.time()), plan))

    async def _stream(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        cfg, cid, created = self.cfg, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        try:
            if not plan.hang:  # like the engines: headers go out before the queue
                await resp.prepare(request)
            async with self.slot(plan):
                if plan.hang:
                    await asyncio.Event().wait()  # cancelled when the client leaves
                await asyncio.sleep(plan.ttft_s)
                plan.cached = await self.prefill.run(plan.prompt_ids, plan.prompt_tokens, plan.cached)
                sent: list[Step] = []
                first = {"role": "assistant", "content": ""}
                await _send(resp, chunk_body(cfg, cid, created, first, usage=self._running(
                    plan, sent)))
                async for step in self.produce(plan):
                    logprobs = logprobs_body([step], sum(s.tokens for s in sent),
                                             plan.top_logprobs) if plan.logprobs else None
                    sent.append(step)
                    delta = step_delta(cfg.engine, cfg.reasoning_key, step, plan.calls)
                    await _send(resp, chunk_body(cfg, cid, created, delta, logprobs=logprobs,
                                                 usage=self._running(plan, sent)))
                if plan.drop_after is not None:
                    return _drop(request)
                self.remember(plan)
                await _send(resp, chunk_body(cfg, cid, created, {}, plan.finish_reason,
                                             usage=self._running(plan, sent)))
                if plan.include_usage:
                    await _send(resp, {"id": cid, "object": "chat.completion.chunk",
                                       "created": created, "model": cfg.model, "choices": [],
                                       "usage": usage(cfg, plan, plan.steps, True)})
                await resp.write(b"data: [DONE]\n\n")
                self.stats.success["length" if plan.finish_reason == "length" else "stop"] += 1
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left (a write failed); a disconnect while we sleep
            # cancels the handler instead (handler_cancellation); slot() cleans up
        return resp


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


def _drop(request: web.Request) -> web.StreamResponse:
    """Close the TCP connection mid-answer: what a crashed worker looks like.
    close() (not abort()) so chunks already written still reach the client."""
    if request.transport is not None:
        request.transport.close()
    return web.StreamResponse()


def build_app(cfg: SimConfig) -> web.Application:
    worker = SimWorker(cfg)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    if cfg.kv_events_config is not None:
        _publish_kv_events(app, worker, cfg)
    app.router.add_get("/health", worker.health)
    app.router.add_get("/v1/models", worker.models)
    app.router.add_get("/metrics", worker.metrics)
    app.router.add_post("/v1/chat/completions", worker.chat_completions)
    if cfg.tokenize:
        app.router.add_post("/tokenize", worker.tokenize)
    if cfg.dialect == "harmony":
        from backends.sim.harmony import add_harmony_routes
        add_harmony_routes(app, worker)
    return app


def _publish_kv_events(app: web.Application, worker: SimWorker, cfg: SimConfig) -> None:
    """``--kv-events-config``, as vLLM reads it: the cache's changes published over ZMQ, and
    ``GET /kv_event_sources`` saying where (keyed by data-parallel rank, as vLLM answers)."""
    from backends.sim.kv_events import KVEventPublisher

    config = orjson.loads(cfg.kv_events_config or "{}")
    if not config.get("enable_kv_cache_events"):
        return
    publisher = KVEventPublisher(config.get("endpoint") or "tcp://*:5557", replay_endpoint=config.get("replay_endpoint"),
                                 topic=config.get("topic") or "", encoding=cfg.kv_events_encoding,
                                 block_size=cfg.kv_block_size)
    worker.cache.listener = publisher.changed

    async def started(_: web.Application) -> None:
        publisher.start()

    async def closed(_: web.Application) -> None:
        publisher.close()

    async def sources(_: web.Request) -> web.Response:
        return web.json_response({"0": {"publisher": "zmq", **config}})

    app.on_startup.append(started)
    app.on_cleanup.append(closed)
    app.router.add_get("/kv_event_sources", sources)


async def serve(cfg: SimConfig) -> None:
    """Listen, print the ready line, run until SIGTERM/SIGINT."""
    runner = web.AppRunner(build_app(cfg), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    # The listen backlog vLLM's and SGLang's servers (uvicorn) use; aiohttp's own is 128, which a burst
    # of new connections overflows while the loop is busy (the kernel then drops or resets them).
    await web.TCPSite(runner, cfg.host, cfg.port, backlog=2048).start()
    print(f"sim worker ready on http://{cfg.host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
