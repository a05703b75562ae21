"""A real vLLM (CPU build) publishing its KV-cache events to the router (engine tier): the router's
launcher starts it with --kv-events-config on a socket of the router's own, indexes the real
BlockStored events, routes by them (policy kv_aware, the engine's own /tokenize), and the
engine's own counters say the prefix was reused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from harness import RouterProcess, start_router
from tests.engine.test_engine_vllm import CHAT, ROUTER_READY_S, _metrics, _pool, _wait, _worker
from tests.support.engine_env import serving, vllm_prepared  # noqa: F401 - vllm_prepared: the session fixture

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

# Long enough for a few full blocks of the CPU build's 128 tokens, the same in every request.
SHARED = "You are a careful assistant for a library. " + " ".join(f"Rule {i}: be precise about item {i}." for i in range(60))


@pytest.fixture(scope="module")
def kv_router(tmp_path_factory: pytest.TempPathFactory, vllm_prepared: Any) -> Iterator[RouterProcess]:  # noqa: F811
    prepared = vllm_prepared
    pool = _pool(CHAT, prepared.chat_model, prepared, dialect="chat", env=prepared.engine_env())
    pool = pool.replace('engine = "vllm"\n', 'engine = "vllm"\npolicy = "kv_aware"\n', 1)
    # The command is the tier's own (pinned, eager): the cached-token report is asked for here.
    pool = pool.replace('"--enforce-eager"]', '"--enforce-eager", "--enable-prompt-tokens-details"]', 1)
    body = pool + "[pools.kv_events]\nenabled = true\n" + f'\n[[models]]\nname = "{CHAT}"\npool = "{CHAT}"\n'
    yield from serving(start_router(tmp_path_factory.mktemp("engine-kv"), body, wait=False), ROUTER_READY_S,
                       "a vLLM CPU worker publishing KV events")


def test_the_router_indexes_real_block_stored_events_and_the_engine_reuses_them(kv_router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=kv_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    worker = _worker(kv_router, CHAT)
    hits_before = _metrics(worker["url"]).get("vllm:prefix_cache_hits_total", 0.0)
    first = client.responses.create(model=CHAT, instructions=SHARED, input="What is rule 3?", max_output_tokens=8)
    assert first.usage.input_tokens > 3 * 128
    blocks = _wait(lambda: _worker(kv_router, CHAT)["kv_events"]["blocks"], 60, "the engine's blocks indexed")
    assert blocks >= 3
    events = _worker(kv_router, CHAT)["kv_events"]
    assert events["bad"] == 0 and events["gaps"] == 0 and events["messages"] >= 1
    again = client.responses.create(model=CHAT, instructions=SHARED, input="And rule 7?", max_output_tokens=8)
    assert again.usage.input_tokens_details.cached_tokens >= 3 * 128  # the engine says it reused the shared blocks
    assert _metrics(worker["url"]).get("vllm:prefix_cache_hits_total", 0.0) > hits_before
    assert _worker(kv_router, CHAT)["kv_events"]["blocks"] >= blocks
    (pool,) = httpx.get(kv_router.base_url + "/health", timeout=10).json()["pools"]
    assert pool["kv_decisions"].get("cache", 0) >= 1  # the second went by the index (the engine's /tokenize ids)
