"""Experiments between pools, sticky arms, worker affinity, shadow traffic, the admin API."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness import ROOT, RouterProcess, free_port, http_status, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

ADMIN = "admin-key-123456"


@pytest.fixture(scope="module")
def ab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    body = (
        sim_pool_toml(name="a", replicas=2).replace('name = "a"', 'name = "a"\npolicy = "affinity"')
        + sim_pool_toml(name="b", replicas=1)
        + sim_pool_toml(name="candidate", replicas=1)
        + """
[[models]]
name = "ab"
arms = [{ pool = "a", weight = 90 }, { pool = "b", weight = 10 }]
shadow = { pool = "candidate", rate = 1.0, max_concurrency = 64 }
"""
        + f'\n[auth]\nadmin_key = "{ADMIN}"\n'
    )
    proc = start_router(tmp_path_factory.mktemp("ab"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


def create(client: openai.OpenAI, **kwargs):  # type: ignore[no-untyped-def]
    raw = client.responses.with_raw_response.create(model="ab", **kwargs)
    return raw.parse(), raw.headers


def admin(router: RouterProcess) -> dict:
    req = urllib.request.Request(router.base_url + "/admin/pools", headers={"authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


def test_weighted_arms_are_sticky_and_workers_affine(ab: RouterProcess) -> None:
    client = openai.OpenAI(base_url=ab.base_url + "/v1", api_key="x", max_retries=0)
    arms: Counter[str] = Counter()
    for i in range(300):
        first, headers = create(client, input=f"hello {i}", user=f"user-{i}")
        arm = headers["x-router-arm"]
        arms[arm] += 1
        assert headers["x-router-pool"] == arm
        if i % 10 == 0:  # continuations stay on their arm, and on their worker in the affinity pool
            second, again = create(client, input="more", previous_response_id=first.id)
            _third, last = create(client, input="more", previous_response_id=second.id)
            assert again["x-router-arm"] == last["x-router-arm"] == arm
            if arm == "a":
                assert again["x-router-worker"] == headers["x-router-worker"] == last["x-router-worker"]
    share = arms["b"] / 300
    assert 0.04 <= share <= 0.17, arms  # 10% expected; 300 draws
    # The same user key always gets the same arm.
    for i in range(20):
        _, headers = create(client, input="again", user=f"user-{i}")
        _, again = create(client, input="again", user=f"user-{i}")
        assert headers["x-router-arm"] == again["x-router-arm"]


def test_a_90_10_experiment_over_2000_conversations_lands_within_tolerance_and_stays_sticky(tmp_path: Path) -> None:
    """2,000 new conversations (user keys, so the split is reproducible) at 32 at once; the
    b share must be within 4 binomial sigmas of 10% (n=2000: 200 +- 54), and every 20th
    conversation's second turn, chained without the user key, stays on its arm (and worker)."""
    body = (
        sim_pool_toml(name="a", replicas=2).replace('name = "a"', 'name = "a"\npolicy = "affinity"')
        + sim_pool_toml(name="b", replicas=1)
        + '\n[[models]]\nname = "ab"\narms = [{ pool = "a", weight = 90 }, { pool = "b", weight = 10 }]\n'
    )
    router = start_router(tmp_path, body)
    n, p, every = 2000, 0.1, 20
    arms: Counter[str] = Counter()
    moved: list[tuple[int, str, str]] = []

    async def conversation(client: openai.AsyncOpenAI, gate: asyncio.Semaphore, i: int) -> None:
        async with gate:
            sampled = i % every == 0
            raw = await client.responses.with_raw_response.create(
                model="ab", input=f"hello {i} [sim:tokens=1]", user=f"conversation-{i}", store=sampled)
            arm, worker = raw.headers["x-router-arm"], raw.headers["x-router-worker"]
            assert raw.headers["x-router-pool"] == arm
            arms[arm] += 1
            if sampled:
                again = await client.responses.with_raw_response.create(
                    model="ab", input="more [sim:tokens=1]", previous_response_id=raw.parse().id, store=False)
                if again.headers["x-router-arm"] != arm or (arm == "a" and again.headers["x-router-worker"] != worker):
                    moved.append((i, f"{arm} {worker}", f"{again.headers['x-router-arm']} {again.headers['x-router-worker']}"))

    async def run() -> None:
        gate = asyncio.Semaphore(32)
        async with openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            await asyncio.gather(*(conversation(client, gate, i) for i in range(n)))

    try:
        asyncio.run(run())
    finally:
        assert router.stop() == 0, router.log()
    assert sum(arms.values()) == n and set(arms) == {"a", "b"}
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(arms["b"] - n * p) <= 4 * sigma, arms
    assert moved == []


def test_shadow_traffic_never_changes_what_the_client_sees(ab: RouterProcess) -> None:
    client = openai.OpenAI(base_url=ab.base_url + "/v1", api_key="x", max_retries=0)
    before = admin(ab)
    candidate = next(p for p in before["pools"] if p["name"] == "candidate")
    served = sum(w["served"] for w in candidate["workers"])
    answer, headers = create(client, input="mirror me [sim:tokens=4]")
    assert headers["x-router-pool"] in ("a", "b") and len(answer.output_text.split()) == 4
    failing, _ = create(client, input="quick")
    assert failing.status == "completed"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = admin(ab)
        candidate = next(p for p in state["pools"] if p["name"] == "candidate")
        if sum(w["served"] for w in candidate["workers"]) >= served + 2:
            break
        time.sleep(0.1)
    assert sum(w["served"] for w in candidate["workers"]) >= served + 2
    model = next(m for m in state["models"] if m["model"] == "ab")
    assert model["shadow"]["mirrored"] >= 2
    with pytest.raises(openai.NotFoundError):  # mirrored requests are never stored
        client.responses.retrieve(answer.id + "_shadow")


def test_a_down_arm_fails_over_and_is_counted(tmp_path: Path) -> None:
    sim_port = free_port()
    sim = subprocess.Popen([sys.executable, "-m", "backends.sim", "--port", str(sim_port)], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while http_status(f"http://127.0.0.1:{sim_port}/health") != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        body = (
            sim_pool_toml(name="a", replicas=1)
            + f'\n[[pools]]\nname = "b"\nengine = "sim"\nmodel = "sim-model"\nurls = ["http://127.0.0.1:{sim_port}"]\n'
            + 'health_interval_s = 0.2\n'
            + '\n[[models]]\nname = "ab"\narms = [{ pool = "a", weight = 50 }, { pool = "b", weight = 50 }]\n'
            + f'\n[auth]\nadmin_key = "{ADMIN}"\n'
        )
        router = start_router(tmp_path, body)
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        homes = {}
        for i in range(40):
            homes[i] = create(client, input="x", user=f"u{i}")[1]["x-router-arm"]
        assert set(homes.values()) == {"a", "b"}
        os.kill(sim.pid, signal.SIGKILL)
        sim.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pools = {p["name"]: p for p in admin(router)["pools"]}
            if pools["b"]["healthy_workers"] == 0:
                break
            time.sleep(0.1)
        for i in range(40):
            response, headers = create(client, input="x", user=f"u{i}")
            assert response.status == "completed" and headers["x-router-arm"] == "a"
        failovers = admin(router)["models"][0]["failovers"]
        moved = sum(f["count"] for f in failovers if f["from"] == "b" and f["to"] == "a")
        assert moved == sum(1 for arm in homes.values() if arm == "b")
        assert router.stop() == 0
    finally:
        sim.kill()


def test_admin_api_adds_and_removes_workers(ab: RouterProcess, tmp_path: Path) -> None:
    with httpx.Client(base_url=ab.base_url) as c:
        assert c.get("/health").json() == {"status": "ok"}  # the insides (worker URLs, PIDs) need the admin key
        assert c.get("/health", headers={"authorization": f"Bearer {ADMIN}"}).json()["pools"]
        assert c.get("/admin/pools").status_code == 401
        assert c.get("/admin/pools", headers={"authorization": "Bearer wrong"}).status_code == 401
        auth = {"authorization": f"Bearer {ADMIN}"}
        port = free_port()
        sim = subprocess.Popen([sys.executable, "-m", "backends.sim", "--port", str(port)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while http_status(f"http://127.0.0.1:{port}/health") != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            added = c.post("/admin/pools/b/workers", json={"url": f"http://127.0.0.1:{port}"}, headers=auth)
            assert added.status_code == 200, added.text
            assert any(w["url"].endswith(str(port)) and w["healthy"] for w in added.json()["workers"])
            assert c.post("/admin/pools/b/workers", json={"url": "ftp://x"}, headers=auth).status_code == 400
            for url in ("http://", "http://:8000", "http://h:notaport", "http://u@h:1"):  # no host, a bad port, userinfo
                refused = c.post("/admin/pools/b/workers", json={"url": url}, headers=auth)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "url", url
            assert c.post("/admin/pools/zz/workers", json={"url": "http://x"}, headers=auth).status_code == 404
            removed = c.delete("/admin/pools/b/workers", params={"url": f"http://127.0.0.1:{port}"}, headers=auth)
            assert removed.status_code == 200 and not any(w["url"].endswith(str(port)) for w in removed.json()["workers"])
            managed = added.json()["workers"][0]["url"]
            assert c.delete("/admin/pools/b/workers", params={"url": managed}, headers=auth).status_code == 404
        finally:
            sim.kill()


def test_metrics_and_the_arm_report(ab: RouterProcess) -> None:
    client = openai.OpenAI(base_url=ab.base_url + "/v1", api_key="x", max_retries=0)
    for i in range(10):
        with client.responses.stream(model="ab", input=f"count me [sim:tokens=5] {i}", user=f"m{i}") as stream:
            stream.get_final_response()
    req = urllib.request.Request(ab.base_url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req) as resp:
        text = resp.read().decode()
    assert 'responses_router_requests_total{model="ab",arm="a",pool="a",status="completed"}' in text
    assert "responses_router_time_to_first_token_seconds_bucket" in text
    assert 'responses_router_worker_healthy{pool="candidate"' in text
    assert http_status(ab.base_url + "/metrics") == 401  # guarded by the admin key
    run = subprocess.run([sys.executable, "-m", "router", "report", "--url", ab.base_url, "--admin-key", ADMIN],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "ab" in run.stdout and " a " in run.stdout.replace("|", " ")
