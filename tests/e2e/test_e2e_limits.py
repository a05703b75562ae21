"""Per-key limits through a real router process: requests and tokens per minute, concurrency,
429 with Retry-After, OpenAI's x-ratelimit-* headers, the openai SDK's retry, per-model limits,
and keys left alone by another key's limits (router/limits/)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

SLOW, FAST, OPEN, TOKENS = "sk-limits-slow-key-1", "sk-limits-fast-key-2", "sk-limits-open-key-3", "sk-limits-tokens-key-4"
CONFIG = sim_pool_toml(replicas=1) + f"""
[auth]
keys = [
  {{name = "slow", key = "{SLOW}", limits = {{requests_per_minute = 3}}}},
  {{name = "fast", key = "{FAST}", limits = {{requests_per_minute = 600, max_in_flight = 2, models = {{m2 = {{requests_per_minute = 1}}}}}}}},
  {{name = "open", key = "{OPEN}"}},
  {{name = "tokens", key = "{TOKENS}", limits = {{tokens_per_minute = 2000}}}},
]

[limits]
default_output_tokens = 100

[[models]]
name = "m"
pool = "sim"

[[models]]
name = "m2"
pool = "sim"
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = start_router(tmp_path_factory.mktemp("limits"), CONFIG)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def clear_of_a_minute_boundary(need_s: float = 5.0) -> None:
    """The windows are wall-clock minutes: a test that counts on one window waits out a boundary near."""
    into = time.time() % 60
    if into > 60 - need_s:
        time.sleep(60 - into + 0.05)


def create(router: RouterProcess, key: str, model: str = "m", **extra: object) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/responses", headers={"authorization": f"Bearer {key}"},
                      json={"model": model, "input": "hello there", "max_output_tokens": 16, **extra}, timeout=30)


def test_requests_per_minute_refuses_with_retry_after_and_headers(router: RouterProcess) -> None:
    clear_of_a_minute_boundary()
    answers = [create(router, SLOW) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-limit-requests"] for a in answers] == ["3", "3", "3"]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert answers[-1].headers["x-ratelimit-reset-requests"].endswith("s")
    refused = create(router, SLOW)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "requests per minute" in error["message"] and "'slow'" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    assert int(refused.headers["retry-after-ms"]) > 0
    # A refused stream is refused before its 200: no event stream begins.
    streamed = create(router, SLOW, stream=True)
    assert streamed.status_code == 429 and streamed.headers["content-type"].startswith("application/json")
    # Another key is not touched by this one's limit, and a key with no limits gets no headers.
    other = create(router, OPEN)
    assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers


def test_refused_requests_are_not_stored_and_not_counted(router: RouterProcess) -> None:
    before = httpx.get(f"{router.url}/metrics").text
    assert 'responses_router_key_requests_rejected_total{key="slow",reason="requests_per_minute"}' in before


def test_a_model_limit_beside_the_keys(router: RouterProcess) -> None:
    clear_of_a_minute_boundary()
    assert create(router, FAST, "m2").status_code == 200
    refused = create(router, FAST, "m2")
    assert refused.status_code == 429 and "on model 'm2'" in refused.json()["error"]["message"]
    assert create(router, FAST, "m").status_code == 200  # the key's other model is not limited so


def test_max_in_flight(router: RouterProcess) -> None:
    """Two streams held open; the third request is refused at once, and admitted once one ends."""
    client = httpx.Client(timeout=30, headers={"authorization": f"Bearer {FAST}"})
    body = {"model": "m", "input": "[sim:tokens=400] [sim:itl_ms=5]", "stream": True}
    with client.stream("POST", f"{router.url}/v1/responses", json=body) as one, \
            client.stream("POST", f"{router.url}/v1/responses", json=body) as two:
        assert one.status_code == two.status_code == 200
        third = create(router, FAST)
        assert third.status_code == 429 and "in flight" in third.json()["error"]["message"]
        assert third.headers["retry-after"] == "1"
    deadline = time.monotonic() + 10
    while (answer := create(router, FAST)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)  # the closed streams end as cancelled, and free their slots
    assert answer.status_code == 200


def test_tokens_per_minute_reserves_and_settles(router: RouterProcess) -> None:
    """Each request reserves its prompt and 100 output tokens; what it used settles at its end, so
    more requests fit than the reservations alone would let in."""
    clear_of_a_minute_boundary()
    answers = [create(router, TOKENS, max_output_tokens=400) for _ in range(3)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    remaining = int(answers[-1].headers["x-ratelimit-remaining-tokens"])
    assert answers[-1].headers["x-ratelimit-limit-tokens"] == "2000" and remaining < 2000
    # Settled: the reservations (3 x over 400) gave back what the answers did not use.
    standing = create(router, TOKENS, max_output_tokens=16)
    assert int(standing.headers["x-ratelimit-remaining-tokens"]) > 2000 - 3 * 400
    too_large = create(router, TOKENS, max_output_tokens=5000)
    assert too_large.status_code == 429 and too_large.headers["x-should-retry"] == "false"
    assert "Request too large" in too_large.json()["error"]["message"]


def test_the_openai_sdk_retries_through_a_429(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A key allowed one request at a time: while a stream holds its slot, the SDK (max_retries at
    its default) is refused with 429, waits as Retry-After says and gets through; the
    x-ratelimit-* headers count what was used."""
    key = "sk-limits-sdk-key-5"
    proc = start_router(tmp_path_factory.mktemp("limits-sdk"), sim_pool_toml(replicas=1) + f"""
[auth]
keys = [{{name = "sdk", key = "{key}", limits = {{requests_per_minute = 50, max_in_flight = 1}}}}]
[[models]]
name = "m"
pool = "sim"
""")
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=key)
        clear_of_a_minute_boundary()
        first = client.responses.with_raw_response.create(model="m", input="hi", max_output_tokens=64)
        assert first.headers["x-ratelimit-remaining-requests"] == "49"
        holder = httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"})
        with holder.stream("POST", f"{proc.url}/v1/responses",
                           json={"model": "m", "input": "[sim:tokens=60] [sim:itl_ms=10]", "stream": True}) as held:
            assert held.status_code == 200
            started = time.monotonic()
            raw = client.responses.with_raw_response.create(model="m", input="hi", max_output_tokens=64)
            waited = time.monotonic() - started
            for _ in held.iter_bytes():
                pass
        assert raw.parse().status == "completed"
        assert waited >= 0.9  # refused once, retried after Retry-After (1 s), not at once
        # Used: the first, the held stream, the SDK's: the refused attempt is not counted.
        assert raw.headers["x-ratelimit-remaining-requests"] == "47"
        assert 'responses_router_key_requests_rejected_total{key="sdk",reason="max_in_flight"} 1' in \
            httpx.get(f"{proc.url}/metrics").text
    finally:
        assert proc.stop() == 0
