"""The sim publishes its prefix cache's KV events as vLLM does, and the router's subscriber
(backends/kv_subscriber.py) indexes them: real processes, real ZMQ sockets, both encodings."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from backends.kv_subscriber import KVSubscriber
from backends.sim.cache import chat_token_ids
from harness import free_port
from policies.kv_index import KVIndex
from tests.support.sim_proc import Sim
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.e2e

WORDS = " ".join(f"w{i}" for i in range(60))  # 60 words: a prompt of several 16-token blocks


@pytest.fixture(params=["map", "array"])
def sim(request: pytest.FixtureRequest) -> Iterator[tuple[Sim, str, str]]:
    port, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    worker = Sim("--kv-cache-blocks", "8", "--kv-events-config", json.dumps(config),
                 "--kv-events-encoding", request.param)
    try:
        yield worker, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    finally:
        worker.stop()


def _chat(sim: Sim, text: str) -> dict:
    status, _, body = sim.request("POST", "/v1/chat/completions", {
        "model": "sim-model", "messages": [{"role": "user", "content": f"{text} [sim:tokens=2]"}]})
    assert status == 200, body
    return json.loads(body)


def test_the_index_sees_what_the_sim_caches_and_evicts(sim: tuple[Sim, str, str]) -> None:
    worker, endpoint, replay = sim
    status, _, sources = worker.request("GET", "/kv_event_sources")
    assert status == 200 and json.loads(sources)["0"]["topic"] == "kv"

    async def main() -> None:
        index = KVIndex()
        # Subscribed after a first request: what the sim stored before is caught up through replay.
        first = _chat(worker, WORDS)
        sub = KVSubscriber(index, "sim", endpoint, replay_endpoint=replay, topic="kv")
        task = asyncio.create_task(sub.run())
        try:
            messages = [{"role": "user", "content": f"{WORDS} [sim:tokens=2]"}]
            prompt = chat_token_ids(messages)
            for i in range(100):  # the slow joiner: send until a message arrives (each prompt, new blocks)
                _chat(worker, " ".join(f"probe{i}-{j}" for j in range(20)))
                await asyncio.sleep(0.02)
                if sub.counts.messages:
                    break
            await async_wait_until(lambda: sub.counts.replayed >= 1, 10, "the earlier batches replayed")
            again = _chat(worker, WORDS)
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"] == len(prompt)
            # What the index says the sim holds is what the sim reports it reused (its last token never is).
            assert cached > 0 and index.overlap(prompt[:cached + 1]).get("sim") == cached
            # Eight blocks of room: unrelated prompts evict it, and the index follows.
            for i in range(6):
                _chat(worker, " ".join(f"x{i}-{j}" for j in range(40)))
            await async_wait_until(lambda: "sim" not in index.overlap(prompt), 10, "the evicted prefix gone from the index")
            assert len(index) <= 8 and sub.counts.bad == 0 and sub.counts.dropped == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
