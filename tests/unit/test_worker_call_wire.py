"""Worker calls (backends/calls.py) over the real wire to in-process sim workers: every count
returns to zero, retries happen only before the answer began, a lacking endpoint is remembered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from backends.errors import (
    WorkerStreamBroken,
)
from backends.pools import Pool
from backends.sim import build_app, parse_args
from harness import free_port
from policies.balance import make_balancer
from tests.unit.test_worker_call import counted, run, short_pauses  # noqa: F401 - an autouse fixture

# ------------------------------------------------------------------ real sim workers, the real wire


async def _sims(n: int) -> tuple[list[web.AppRunner], list[str]]:
    runners, urls = [], []
    for _ in range(n):
        runner = web.AppRunner(build_app(parse_args(["--port", "0"])), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    return runners, urls


async def _with_pool(urls: list[str], body: Callable[[Pool], Awaitable[Any]]) -> Any:
    pool = Pool.create(name="p", engine="sim", model="sim-model", balancer=make_balancer("round_robin"), urls=urls,
                       read_timeout_s=10.0)
    for w in pool.workers:
        w.healthy = True
    try:
        return await body(pool)
    finally:
        await pool.client.close()


def _chat(text: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], "stream": stream}


def test_real_workers_an_unreachable_one_is_skipped_and_every_count_returns_to_zero() -> None:
    async def main() -> None:
        runners, urls = await _sims(1)
        refused = f"http://127.0.0.1:{free_port()}"

        async def body(pool: Pool) -> None:
            call = pool.call()
            answer = await call.send(pool.client.post_json, "/v1/chat/completions", _chat("hi"))
            assert answer["choices"][0]["message"]["content"]
            assert call.last is pool.workers[1] and not pool.workers[0].healthy
            assert counted(pool) == [0, 0] and pool.workers[1].served == 1

        try:
            await _with_pool([refused, urls[0]], body)
        finally:
            for r in runners:
                await r.cleanup()

    run(main())


def test_real_workers_a_drop_before_the_answer_is_retried_and_after_its_head_is_not() -> None:
    async def main() -> None:
        runners, urls = await _sims(2)

        async def body(pool: Pool) -> None:
            sent: list[str] = []

            def chat(url: str, stream: bool) -> Any:
                sent.append(url.removesuffix("/v1/chat/completions"))
                drop = " [sim:drop_after=2]" if url.startswith(urls[0]) else ""
                request = _chat("[sim:tokens=5]" + drop, stream=stream)
                if stream:
                    return pool.client.open_sse(url, request)
                return pool.client.post_json(url, request)

            # A whole answer that breaks off before its end: nothing reached the caller, the next worker serves.
            call = pool.call()
            await call.send(chat, "/v1/chat/completions", False)
            assert sent == urls and pool.workers[0].breaker.failures == 1 and counted(pool) == [0, 0]
            # A stream that breaks off after its head: the call is done, the caller reads the break.
            sent.clear()
            call = pool.call()
            stream = await call.send(chat, "/v1/chat/completions", True, hold=True)
            assert sent == [urls[0]] and counted(pool) == [1, 0]
            with pytest.raises(WorkerStreamBroken):
                async for _ in stream.batches():
                    pass
            assert counted(pool) == [1, 0]  # the caller's until it releases
            call.broke()
            call.release()
            # Its head was a success (the run of failures starts over), its break a failure.
            assert sent == [urls[0]] and counted(pool) == [0, 0] and pool.workers[0].breaker.failures == 1
            assert pool.workers[0].last_error == "stream broke off"
            # And a whole stream, read to its end.
            call = pool.call(exclude=[pool.workers[0]])
            stream = await call.send(chat, "/v1/chat/completions", True, hold=True)
            assert [b async for b in stream.batches()] and counted(pool) == [0, 1]
            call.release()
            assert counted(pool) == [0, 0]

        try:
            await _with_pool(urls, body)
        finally:
            for r in runners:
                await r.cleanup()

    run(main())


def test_real_workers_the_passthrough_releases_a_stream_it_never_read() -> None:
    """A relayed stream closed before its first chunk (the client left as its head went out)."""
    from router.api.passthrough import _Done, _Relayed
    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    labels = ("m", "sim", "sim", "chat")

    async def main() -> None:
        runners, urls = await _sims(1)

        async def body(pool: Pool) -> None:
            call = pool.call()
            data = b'{"model": "sim-model", "stream": true, "messages": [{"role": "user", "content": "[sim:tokens=50]"}]}'
            answer = await call.send(pool.client.relay, "/v1/chat/completions", data, hold=True)
            relayed = _Relayed(answer.chunks(), call, _Done(metrics, labels), answer.status)
            assert counted(pool) == [1]
            await relayed.aclose()
            assert counted(pool) == [0]
            assert metrics.passthrough_requests.get((*labels, "200")) == 1  # recorded once, closed unread
            call = pool.call()  # and one read to its end
            answer = await call.send(pool.client.relay, "/v1/chat/completions", data, hold=True)
            chunks = [c async for c in _Relayed(answer.chunks(), call, _Done(metrics, labels), answer.status)]
            assert b"[DONE]" in b"".join(chunks) and counted(pool) == [0]
            assert metrics.passthrough_requests.get((*labels, "200")) == 2

        try:
            await _with_pool(urls, body)
        finally:
            for r in runners:
                await r.cleanup()

    run(main())


def test_real_workers_a_worker_without_tokenize_is_remembered_on_the_worker() -> None:
    """The sim has no /tokenize (as SGLang's chat API, or an old vLLM): the worker is marked, asked
    no more, and the count falls back; the mark belongs to the pool's worker, not the process."""
    from router.turns.compaction import _tokenize
    from router.turns.prompt_ids import TOKENIZE_PATH

    class Route:
        def __init__(self, pool: Pool) -> None:
            self.pool = pool

    async def main() -> None:
        runners, urls = await _sims(1)
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}

        async def check(pool: Pool) -> None:
            req: Any = type("Req", (), {"model": "m"})()
            post_json, asked = pool.client.post_json, []

            async def counting(url: str, body: Any) -> Any:
                asked.append(url)
                return await post_json(url, body)

            pool.client.post_json = counting  # type: ignore[method-assign]
            assert await _tokenize(Route(pool), req, body) is None  # type: ignore[arg-type]
            assert pool.workers[0].lacks == {TOKENIZE_PATH} and counted(pool) == [0]
            assert pool.workers[0].breaker.failures == 0
            assert await _tokenize(Route(pool), req, body) is None  # type: ignore[arg-type]
            assert asked == [urls[0] + TOKENIZE_PATH]  # asked once

        try:
            await _with_pool(urls, check)
            await _with_pool(urls, lambda pool: _fresh(pool, TOKENIZE_PATH))
        finally:
            for r in runners:
                await r.cleanup()

    run(main())


async def _fresh(pool: Pool, path: str) -> None:
    assert not pool.workers[0].lacks  # another pool of the same worker has not been told
