"""The sim's prefix cache (backends/sim/cache.py), the engines' cache metrics
and their scraping into the pool's load (backends/engines.py, backends/pools.py),
and a conversation that hits the cache through a real router with affinity."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from backends.engines import kv_cache_usage, waiting_requests
from backends.sim import SimConfig, SimWorker, Stats, render_metrics
from backends.sim.cache import (
    Prefill,
    PrefixCache,
    block_hashes,
    cache_metric_lines,
    chat_token_ids,
    reply_ids,
)
from backends.sim.script import count_prompt_tokens
from backends.worker import KV_LOAD_WEIGHT, Worker
from harness import RouterProcess, sim_pool_toml, start_router
from policies.balance import LeastLoad
from tests.e2e.test_sim_harmony import _sim, enc, vocab_dir  # noqa: F401  (fixtures)
from tests.e2e.test_sim_harmony import generate as harmony_generate
from tests.e2e.test_sim_harmony import prompt as harmony_prompt
from tests.support.sim_proc import Sim
from tests.support.waits import async_wait_until

SYSTEM = "You answer questions about the router, its pools, its workers and their caches. " * 3
ADMIN = "admin-key-prefix-cache"

# ---------------------------------------------------------------- the block cache


def test_an_extended_prefix_hits_its_cached_blocks() -> None:
    cache = PrefixCache(100, block_tokens=4)
    prompt = list(range(100, 120))  # 20 tokens: 4 blocks within the first 19
    assert cache.lookup(prompt) == 0
    assert cache.used == 4
    longer = prompt + list(range(500, 508))
    assert cache.lookup(longer) == 16  # blocks 0-3; block 4 (tokens 16-19) was never full before 19
    cache.insert(prompt + [7, 7, 7, 7])  # after generation: the prompt and the answer
    assert cache.lookup(prompt + [7, 7, 7, 7, 9]) == 24
    assert (cache.queries, cache.hits) == (20 + 28 + 25, 16 + 24)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    cache = PrefixCache(100, block_tokens=4)
    prompt = list(range(32))
    cache.insert(prompt)
    assert cache.lookup(prompt) == 28  # the last block holds the last token: recomputed


def test_least_recently_used_blocks_are_evicted_first() -> None:
    cache = PrefixCache(4, block_tokens=4)
    a, b, c = ([base + i for i in range(9)] for base in (0, 100, 200))  # 2 blocks each
    cache.lookup(a)
    cache.lookup(b)
    assert cache.used == 4 and cache.usage == 1.0
    assert cache.lookup(a) == 8  # a is now the most recent
    cache.lookup(c)  # evicts b, the least recently used
    assert cache.used == 4
    assert cache.lookup(a) == 8
    assert cache.lookup(b) == 0


def test_a_chain_loses_its_tail_before_its_head() -> None:
    cache = PrefixCache(3, block_tokens=4)
    cache.lookup(list(range(13)))  # 3 blocks
    cache.lookup([900 + i for i in range(5)])  # 1 new block: one of the chain's must go
    assert cache.lookup(list(range(13))) == 8  # the head two survive


def test_hashes_are_chained_so_a_block_hits_only_after_the_same_prefix() -> None:
    block = [1, 2, 3, 4]
    assert len(set(block_hashes(block + block, 4))) == 2
    cache = PrefixCache(100, block_tokens=4)
    cache.lookup([7, 7, 7, 7] + block + [9])
    assert cache.lookup(block + [9]) == 0  # same tokens, other position
    assert cache.lookup([7, 7, 7, 7] + block + [5]) == 8


def test_capacity_zero_is_no_cache() -> None:
    cache = PrefixCache(0)
    assert not cache.enabled
    assert cache.lookup(list(range(64))) == 0 and cache.lookup(list(range(64))) == 0
    assert cache.usage == 0.0 and cache.queries == 0


def test_chat_ids_match_the_token_count_and_the_next_turn_extends_them() -> None:
    tools = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is a pool"}]
    second = first + [{"role": "assistant", "content": "a set of workers"},
                      {"role": "user", "content": [{"type": "text", "text": "and a worker"}]},
                      {"role": "assistant", "content": None, "tool_calls": tools},
                      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    for messages in (first, second):
        assert len(chat_token_ids(messages)) == count_prompt_tokens(messages)
    answered = chat_token_ids(first) + reply_ids("a set of workers")
    assert chat_token_ids(second)[:len(answered)] == answered


def test_prefill_charges_only_uncached_tokens_and_a_marker_wins() -> None:
    worker = SimWorker(SimConfig(kv_cache_blocks=64, kv_block_size=16, prefill_us_per_token=1000))
    ids = chat_token_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    n = len(ids)
    assert worker.prefill.lookup(ids, n, None) == (0, pytest.approx(n / 1000))
    cached, seconds = worker.prefill.lookup(ids, n, None)
    assert cached == (n - 1) // 16 * 16 and cached > 0
    assert seconds == pytest.approx((n - cached) / 1000)
    assert worker.prefill.lookup(ids, n, 5) == (5, pytest.approx((n - 5) / 1000))
    off = SimWorker(SimConfig(prefill_us_per_token=1000))
    assert off.prefill.lookup(None, n, None) == (None, pytest.approx(n / 1000))



def test_a_worker_prefills_one_prompt_at_a_time() -> None:
    async def scenario() -> None:
        prefill = Prefill(PrefixCache(0), us_per_token=1e6)  # a second per token: only cancels end them
        first = asyncio.create_task(prefill.run(None, 5, None))
        second = asyncio.create_task(prefill.run(None, 5, None))
        await async_wait_until(prefill.gpu.locked, 5, "the first prompt on the GPU", interval=0)
        assert prefill.gpu.locked() and not first.done() and not second.done()
        # a fully cached prompt computes nothing and does not wait for the GPU
        assert await asyncio.wait_for(prefill.run(None, 5, 5), 5) == 5
        first.cancel()
        await async_wait_until(lambda: first.done() and prefill.gpu.locked(), 5, "the GPU handed to the second prompt",
                               interval=0)
        assert prefill.gpu.locked() and not second.done()  # the second prompt holds it now
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        assert not prefill.gpu.locked()

    asyncio.run(scenario())


# ---------------------------------------------------------------- metrics and scraping

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 12345.0
"""

VLLM_V0_TEXT = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4 1718000000000
"""

SGLANG_TEXT = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"""


def test_the_parsers_read_vllm_and_sglang_metrics() -> None:
    assert waiting_requests("vllm", VLLM_TEXT) == 3.0  # summed over engines
    assert kv_cache_usage("vllm", VLLM_TEXT) == 0.5  # the mean over engines
    assert kv_cache_usage("vllm", VLLM_V0_TEXT) == 0.4  # the old name, a timestamp after the value
    assert waiting_requests("sglang", SGLANG_TEXT) == 4.0
    assert kv_cache_usage("sglang", SGLANG_TEXT) == 0.28
    assert kv_cache_usage("sglang", VLLM_TEXT) is None and kv_cache_usage("vllm", SGLANG_TEXT) is None
    assert kv_cache_usage("vllm", "vllm:kv_cache_usage_perc{engine=\"0\"} 1.5\n") == 1.0  # clamped
    assert kv_cache_usage("vllm", "vllm:kv_cache_usage_perc_other 0.9\nvllm:kv_cache_usage_perc{a=\"b\"} oops\n") is None


def test_the_sims_metrics_read_back_through_the_parsers() -> None:
    cache = PrefixCache(10, block_tokens=4)
    cache.lookup(list(range(13)))  # 3 blocks of 10
    for engine in ("vllm", "sglang"):
        text = render_metrics(engine, "m", Stats(waiting=2), cache)
        assert waiting_requests(engine, text) == 2.0
        assert kv_cache_usage(engine, text) == pytest.approx(0.3)
    lines = cache_metric_lines("vllm", 'model_name="m"', cache)
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 13.0' in lines
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 0.0' in lines


def test_kv_usage_is_a_tie_breaker_in_the_load() -> None:
    full = Worker("http://a", in_flight=1, kv_usage=1.0)
    empty = Worker("http://b", in_flight=1, kv_usage=0.1)
    busier = Worker("http://c", in_flight=2, kv_usage=0.0)
    assert full.load == 1 + KV_LOAD_WEIGHT and KV_LOAD_WEIGHT < 1
    assert busier.load > full.load  # a full cache never outweighs a request in flight
    balancer = LeastLoad()
    assert all(balancer.choose([full, empty, busier]) is empty for _ in range(3))
    assert full.describe()["kv_usage"] == 1.0


# ---------------------------------------------------------------- the sim process


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_sim_reports_cached_tokens_and_cache_metrics(engine: str) -> None:
    sim = Sim("--engine", engine, "--model", "sim-model", "--kv-cache-blocks", "64", "--kv-block-size", "16")
    try:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is a pool"}]
        status, one = sim.chat({"messages": first})
        assert status == 200
        assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        answer = one["choices"][0]["message"]["content"]
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and a worker"}]
        status, two = sim.chat({"messages": second})
        assert status == 200
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        # the first prompt and its answer were cached: every full block of them hits
        assert cached == (count_prompt_tokens(first) + len(answer.split())) // 16 * 16 and cached > 0
        _, marked = sim.chat({"messages": first[:1] + [{"role": "user", "content": "what is a pool [sim:cached=3]"}]})
        assert marked["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
        text = _metrics(sim.port)
        assert 0 < kv_cache_usage(engine, text) <= 1
        if engine == "vllm":
            m = sim.metrics()
            assert m["vllm:prefix_cache_queries_total"] == sum(
                r["usage"]["prompt_tokens"] for r in (one, two, marked))
            assert m["vllm:prefix_cache_hits_total"] >= cached
        else:
            assert 0 < sim.metrics()["sglang:cache_hit_rate"] < 1
    finally:
        assert sim.stop() == 0


def test_without_the_flag_the_sim_caches_nothing() -> None:
    sim = Sim()
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
        for _ in range(2):
            _, out = sim.chat({"messages": messages})
            assert out["usage"].get("prompt_tokens_details") is None
        assert kv_cache_usage("vllm", _metrics(sim.port)) == 0.0
    finally:
        assert sim.stop() == 0


# ---------------------------------------------------------------- through the router


@pytest.fixture(scope="module")
def affine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    pool = sim_pool_toml(name="cached", replicas=2, extra_args='["--kv-cache-blocks", "256"]').replace(
        'name = "cached"', 'name = "cached"\npolicy = "affinity"\nscrape_metrics = true')
    body = pool + f'\n[[models]]\nname = "chat"\npool = "cached"\n\n[auth]\nadmin_key = "{ADMIN}"\n'
    proc = start_router(tmp_path_factory.mktemp("prefix-cache"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


def _pools(router: RouterProcess) -> dict:
    req = urllib.request.Request(router.base_url + "/admin/pools", headers={"authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


def test_a_continuation_hits_the_prefix_cache_of_its_worker(affine: RouterProcess) -> None:
    client = openai.OpenAI(base_url=affine.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    raw = client.responses.with_raw_response.create(model="chat", instructions=SYSTEM, input="what is a pool")
    first, worker = raw.parse(), raw.headers["x-router-worker"]
    assert first.usage.input_tokens_details.cached_tokens == 0
    raw = client.responses.with_raw_response.create(model="chat", instructions=SYSTEM, input="and a worker",
                                                    previous_response_id=first.id)
    second = raw.parse()
    assert raw.headers["x-router-worker"] == worker
    assert 0 < second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    third = client.responses.create(model="chat", instructions=SYSTEM, input="and a cache",
                                    previous_response_id=second.id)
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens_details.cached_tokens

    assert kv_cache_usage("sim", urllib.request.urlopen(worker + "/metrics").read().decode()) > 0
    deadline = time.monotonic() + 20  # the health loop scrapes every 0.5 s
    seen = 0.0
    while time.monotonic() < deadline and not seen:
        workers = _pools(affine)["pools"][0]["workers"]
        seen = next(w["kv_usage"] for w in workers if w["url"] == worker)
        time.sleep(0.1)
    assert seen > 0
    asked = urllib.request.Request(affine.base_url + "/health", headers={"authorization": f"Bearer {ADMIN}"})
    health = json.loads(urllib.request.urlopen(asked).read())
    assert any(w["kv_usage"] > 0 for p in health["pools"] for w in p["workers"]), health



# ---------------------------------------------------------------- harmony: the real token ids


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_harmony_sim_caches_the_real_prompt_ids(engine: str, vocab_dir: Path, enc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    sim = _sim(vocab_dir, "--engine", engine, "--kv-cache-blocks", "64")
    try:
        ids = harmony_prompt(enc, "what is a pool [sim:tokens=3]")
        first, again = harmony_generate(sim, engine, ids), harmony_generate(sim, engine, ids)
        if engine == "vllm":
            assert first["body"]["usage"]["prompt_tokens_details"] is None  # nothing cached: no details
            cached = again["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        else:
            assert first["body"]["meta_info"]["cached_tokens"] == 0
            cached = again["body"]["meta_info"]["cached_tokens"]
        assert cached == (len(ids) - 1) // 16 * 16 and cached > 0
        assert 0 < kv_cache_usage(engine, _metrics(sim.port)) <= 1
    finally:
        assert sim.stop() == 0
