"""A saturated pool's fair queue through a real router process (backends/gate.py): a flooding
key does not take the pool from a light one, is queued up to its share and then refused with 429
and Retry-After; priority bands; a client that leaves leaves the queue; nothing acknowledged is lost."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import random
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

FLOOD, LIGHT, BATCH = "sk-fair-flood-key-1", "sk-fair-light-key-2", "sk-fair-batch-key-3"
# Two workers of at most 4 calls each; every answer takes its 200 ms of "prefill" first.
CONFIG = sim_pool_toml(replicas=2, extra_args='["--ttft-ms", "200"]').replace(
    'engine = "sim"', 'engine = "sim"\nmax_in_flight_per_worker = 4', 1) + f"""
[auth]
keys = [
  {{name = "flood", key = "{FLOOD}"}},
  {{name = "light", key = "{LIGHT}"}},
  {{name = "batch", key = "{BATCH}", limits = {{priority = "batch"}}}},
]

[limits.queue]
max_queued_per_key = 16
max_wait_s = 20

[[models]]
name = "m"
pool = "sim"
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = start_router(tmp_path_factory.mktemp("fair"), CONFIG)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def first_token_s(client: httpx.Client, url: str, key: str, text: str = "hi", **extra: object) -> tuple[float, str]:
    """A stream's time to its first text delta, and how it ended."""
    started = time.monotonic()
    first = 0.0
    ended = ""
    with client.stream("POST", f"{url}/v1/responses", headers={"authorization": f"Bearer {key}"},
                       json={"model": "m", "input": text, "stream": True, **extra}) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not first and line.startswith("data: ") and '"response.output_text.delta"' in line:
                first = time.monotonic() - started
            if line.startswith("data: ") and ('"response.completed"' in line or '"response.failed"' in line):
                ended = "completed" if '"response.completed"' in line else "failed"
    return first, ended


class Flood:
    """``n`` clients of one key, in a process of their own (their threads do not hold up the light
    key's client), each sending stream after stream of 5 to 40 tokens (answers of one length
    would free the pool's slots all at once, in lockstep); on 429 each waits as Retry-After says."""

    def __init__(self, url: str, n: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.results: multiprocessing.queues.Queue[dict[str, object]] = context.Queue()
        self.process = context.Process(target=flood, args=(url, n, self.stop, self.results), daemon=True)
        self.completed = self.refused = self.lost = 0
        self.retry_after: set[str] = set()

    def __enter__(self) -> Flood:
        self.process.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        result = self.results.get(timeout=90)
        self.process.join(30)
        self.completed, self.refused, self.lost = int(result["completed"]), int(result["refused"]), int(result["lost"])  # type: ignore[call-overload]
        self.retry_after = set(result["retry_after"])  # type: ignore[call-overload]


def flood(url: str, n: int, stop: threading.Event, results: multiprocessing.queues.Queue[dict[str, object]]) -> None:
    counts = {"completed": 0, "refused": 0, "lost": 0}
    retry_after: set[str] = set()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                with http.stream("POST", f"{url}/v1/responses", headers={"authorization": f"Bearer {FLOOD}"},
                                 json={"model": "m", "input": f"[sim:tokens={random.randint(5, 40)}] [sim:itl_ms=10]",
                                       "stream": True}) as answer:
                    body = answer.read().decode()
                    with lock:
                        if answer.status_code == 429:
                            counts["refused"] += 1
                            retry_after.add(answer.headers.get("retry-after", ""))
                        elif answer.status_code == 200 and '"response.completed"' in body:
                            counts["completed"] += 1
                        else:
                            counts["lost"] += 1
                if answer.status_code == 429:
                    stop.wait(float(answer.headers.get("retry-after", "1")))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    results.put({**counts, "retry_after": sorted(retry_after)})


def test_a_flooding_key_does_not_take_the_pool_from_a_light_one(router: RouterProcess) -> None:
    with httpx.Client(timeout=60) as client:
        idle = [first_token_s(client, router.url, LIGHT)[0] for _ in range(5)]
        with Flood(router.url, 100) as flood:
            time.sleep(2)  # the pool saturated, the flood's share queued
            loaded = []
            for _ in range(8):
                ttft, ended = first_token_s(client, router.url, LIGHT)
                assert ended == "completed"
                loaded.append(ttft)
                time.sleep(0.5)
        metrics = client.get(f"{router.url}/metrics").text
    print(f"light key p50 TTFT idle {statistics.median(idle):.3f} s, under the flood {statistics.median(loaded):.3f} s")
    assert statistics.median(loaded) <= 1.5 * statistics.median(idle), (idle, loaded)
    assert flood.refused > 0 and flood.retry_after == {"1"}
    assert flood.completed > 0 and flood.lost == 0
    assert 'responses_router_key_requests_queued_total{key="flood"}' in metrics
    # Every response the flood was acknowledged is stored completed (none half-kept).
    assert 'status="failed"' not in "".join(line for line in metrics.splitlines() if line.startswith("responses_router_requests_total"))


def test_interactive_passes_batch_and_flex_goes_last(router: RouterProcess) -> None:
    """With the pool held by long streams and a batch and a flex request waiting, an interactive
    request arriving after both is served first, and flex last."""
    order: list[str] = []
    lock = threading.Lock()

    def one(name: str, key: str, **extra: object) -> None:
        with httpx.Client(timeout=60) as client:
            _ttft, ended = first_token_s(client, router.url, key, "[sim:tokens=2]", **extra)
        assert ended == "completed"
        with lock:
            order.append(name)

    def hold(tokens: int) -> None:
        with httpx.Client(timeout=60) as client:
            first_token_s(client, router.url, FLOOD, f"[sim:tokens={tokens}] [sim:itl_ms=10]")

    # The 8 slots held, freed one at a time 0.4 s apart from ~1.2 s on: each waiter is through
    # (200 ms to its first token, 2 tokens) before the next slot frees.
    holders = [threading.Thread(target=hold, args=(100 + 40 * i,)) for i in range(8)]
    for thread in holders:
        thread.start()
    time.sleep(0.5)  # all 8 slots held for ~1.2 s
    waiting = [threading.Thread(target=one, args=("flex", LIGHT), kwargs={"service_tier": "flex"}),
               threading.Thread(target=one, args=("batch", BATCH))]
    for thread in waiting:
        thread.start()
        time.sleep(0.1)
    last = threading.Thread(target=one, args=("interactive", LIGHT))
    last.start()
    for thread in [*holders, *waiting, last]:
        thread.join(60)
    assert order == ["interactive", "batch", "flex"]


def test_a_client_that_leaves_leaves_the_queue(router: RouterProcess) -> None:
    holders = [threading.Thread(target=lambda: httpx.post(
        f"{router.url}/v1/responses", headers={"authorization": f"Bearer {FLOOD}"},
        json={"model": "m", "input": "[sim:tokens=300] [sim:itl_ms=10]"}, timeout=60)) for _ in range(8)]
    for thread in holders:
        thread.start()
    time.sleep(0.5)
    with pytest.raises(httpx.ReadTimeout):  # it waits in the queue, and its client gives up
        httpx.post(f"{router.url}/v1/responses", headers={"authorization": f"Bearer {LIGHT}"},
                   json={"model": "m", "input": "hi"}, timeout=0.5)
    for thread in holders:
        thread.join(60)
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'responses_router_key_requests_rejected_total{key="light",reason="queue_client_left"} 1' in metrics
    assert httpx.post(f"{router.url}/v1/responses", headers={"authorization": f"Bearer {LIGHT}"},
                      json={"model": "m", "input": "hi"}, timeout=30).status_code == 200
