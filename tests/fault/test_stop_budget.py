"""SIGTERM on a busy router, on its default stop budget: it exits within ``stop_timeout_s``
(9 s, inside a 10 s stop such as docker's), having ended what was running and said so."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness import sim_pool_toml, start_router
from tests.support.waits import running_on_workers, wait_until

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"
STOP_TIMEOUT_S = 9.0  # the default
SLACK_S = 3.0  # the interpreter's own exit, on a loaded 2-core machine


def test_sigterm_with_a_stream_and_a_background_response_running_exits_within_the_budget(tmp_path: Path) -> None:
    pool = sim_pool_toml(model=MODEL, replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    router = start_router(tmp_path, pool)
    slow = "[sim:tokens=3000] [sim:itl_ms=20]"  # a minute of tokens: only the stop ends them
    background = httpx.post(router.base_url + "/v1/responses", timeout=10,
                            json={"model": MODEL, "input": slow, "background": True}).json()
    assert background["status"] == "queued"
    events: list[dict[str, object]] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", router.base_url + "/v1/responses", timeout=60,
                          json={"model": MODEL, "input": slow, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(10)
    wait_until(lambda: running_on_workers(router) == 2, 10, "the stream and the background response on the worker")
    began = time.monotonic()
    router.proc.send_signal(signal.SIGTERM)
    try:
        router.proc.wait(timeout=STOP_TIMEOUT_S + SLACK_S)
    except subprocess.TimeoutExpired:
        router.proc.kill()
        raise AssertionError(f"the router was still running {STOP_TIMEOUT_S + SLACK_S} s after SIGTERM:\n"
                             f"{router.log()[-3000:]}") from None
    took = time.monotonic() - began
    reader.join(timeout=10)
    assert router.proc.returncode == 0, router.log()[-3000:]
    types = [e["type"] for e in events]
    assert types[-2:] == ["error", "response.failed"], types[-5:]
    assert events[-2]["code"] == "router_stopped"
    # The grace (5 s) was given: the stop did not cut the running requests at once.
    assert took >= 5.0, took
