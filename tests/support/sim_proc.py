"""A sim worker (backends/sim/) as a process, and module-scoped fixtures for one per engine.

Shared by the sim's own tests (test_sim.py, test_sim_scripting.py,
test_sim_harmony.py, test_sim_prefix_cache.py).
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"



class Sim:
    """One sim worker process and small clients for it."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backends.sim", "--port", str(self.port), *args],
            cwd=ROOT, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, "sim worker exited during start-up"
            assert time.monotonic() < deadline, "sim worker did not become healthy"
            try:
                if self.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        # The line is printed (and flushed) before the loop serves anything.
        self.ready_line = self.proc.stdout.readline().strip()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                             max_retries=0, **kw)

    def request(self, method: str, path: str, body: object = None,
                raw: bytes | None = None) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            data = raw if raw is not None else (
                None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type") or "", resp.read()
        finally:
            conn.close()

    def chat(self, body: dict) -> tuple[int, dict]:
        status, _, payload = self.request("POST", "/v1/chat/completions", {"model": MODEL, **body})
        return status, json.loads(payload)

    def metrics(self) -> dict[str, float]:
        """Series name (labels stripped) -> value, summed over label sets."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics").read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name = series.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
                out[series] = float(value)
        return out

    def wait_metric(self, name: str, predicate, timeout: float = 5.0) -> dict[str, float]:
        """Poll /metrics until predicate(value) holds; fail at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m[name]):
                return m
            assert time.monotonic() < deadline, f"{name} stuck at {m[name]}"
            time.sleep(0.01)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def vllm():
    sim = Sim("--max-model-len", "4096")
    yield sim
    assert sim.stop() == 0  # SIGTERM is a clean exit


@pytest.fixture(scope="module")
def sglang():
    sim = Sim("--engine", "sglang", "--model", "sg-model")
    yield sim
    assert sim.stop() == 0


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]

