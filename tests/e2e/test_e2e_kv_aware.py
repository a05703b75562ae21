"""policy = "kv_aware" through a real router process and two managed sim workers that publish their
KV events: a prompt goes where its prefix is cached (by the index, not by chain affinity), the
engine reports the cached tokens, and where nothing is cached the pick goes by load."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from harness import RouterProcess, sim_pool_toml, start_router
from tests.support.waits import wait_until

pytestmark = pytest.mark.e2e

SYSTEM = " ".join(f"rule{i}" for i in range(120))  # a long shared instruction: several 16-token blocks
SHARED_BLOCKS = (3 + 120) // 16  # its message, as the sim counts tokens (a 3-token header, a token a word)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    body = (sim_pool_toml(replicas=2).replace('engine = "sim"', 'engine = "sim"\npolicy = "kv_aware"')
            + "[pools.kv_events]\nenabled = true\n" + '\n[[models]]\nname = "m"\npool = "sim"\n')
    proc = start_router(tmp_path_factory.mktemp("kv-aware"), body)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _create(router: RouterProcess, instructions: str, text: str) -> httpx.Response:
    resp = httpx.post(router.base_url + "/v1/responses", timeout=30,
                      json={"model": "m", "instructions": instructions, "input": text, "store": False})
    assert resp.status_code == 200, resp.text
    return resp


def _blocks(router: RouterProcess, url: str) -> int:
    health = httpx.get(router.base_url + "/health", timeout=10).json()
    return next(w for p in health["pools"] for w in p["workers"] if w["url"] == url)["kv_events"]["blocks"]


def test_a_shared_prefix_goes_where_it_is_cached_and_the_engine_says_it_reused_it(router: RouterProcess) -> None:
    first = _create(router, SYSTEM, "first question")
    home = first.headers["x-router-worker"]
    wait_until(lambda: _blocks(router, home) >= 8, 15, "the shared prefix indexed on its worker")
    for i in range(6):  # new conversations (no previous_response_id): only the index knows where the prefix is
        again = _create(router, SYSTEM, f"another question {i}")
        assert again.headers["x-router-worker"] == home
        cached = again.json()["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= SHARED_BLOCKS * 16, again.json()["usage"]  # every full block of the shared instruction
    decisions = httpx.get(router.base_url + "/health", timeout=10).json()["pools"][0]["kv_decisions"]
    assert decisions.get("cache", 0) >= 6


def test_unrelated_prompts_spread_by_load(router: RouterProcess) -> None:
    workers = Counter(_create(router, f"topic {i} " + " ".join(f"t{i}w{j}" for j in range(40)), "go").headers["x-router-worker"]
                      for i in range(12))
    assert len(workers) == 2, workers  # nothing cached anywhere: not all on one worker


def test_the_metrics_explain_the_picks(router: RouterProcess) -> None:
    _create(router, SYSTEM, "one more")
    text = httpx.get(router.base_url + "/metrics", timeout=10).text

    def samples(name: str) -> dict[str, float]:
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name + "{")}

    decisions = samples("responses_router_kv_decisions_total")
    assert decisions['responses_router_kv_decisions_total{pool="sim",reason="cache"}'] >= 7
    expected = samples("responses_router_kv_expected_cached_tokens_total")['responses_router_kv_expected_cached_tokens_total{pool="sim"}']
    reported = sum(samples("responses_router_cached_tokens_total").values())
    assert expected >= 7 * SHARED_BLOCKS * 16 and reported >= expected * 0.5  # the engine found what the index said
    assert sum(samples("responses_router_kv_index_blocks").values()) > 0
    assert sum(samples("responses_router_kv_event_messages_total").values()) > 0
    assert not any(samples("responses_router_kv_event_problems_total").values())
