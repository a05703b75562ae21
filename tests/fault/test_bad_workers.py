"""Worker answers of the wrong shape or size, or none at all, through a real router process.

The worker is tests/fault/hostile_worker.py on raw sockets. Every bad answer
becomes, at once, a 502 (a JSON request) or ``error`` + ``response.failed`` (a
stream) whose message names what was wrong, and the stored response says
``failed``; the router keeps serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness import ROOT, RouterProcess, free_port, http_status, start_router
from harness import die_with_parent as _die_with_pytest

pytestmark = pytest.mark.e2e

MODEL = "hostile"
FRAME_LIMIT = 256 * 1024
ANSWER_LIMIT = 1024 * 1024


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "tests.fault.hostile_worker", str(port), MODEL], cwd=ROOT,
                              preexec_fn=_die_with_pytest, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(100):
            if http_status(f"http://127.0.0.1:{port}/health") == 200:
                break
            import time
            time.sleep(0.1)
        pool = f"""
[[pools]]
name = "bad"
engine = "vllm"
model = "{MODEL}"
urls = ["http://127.0.0.1:{port}"]
health_interval_s = 0.5
first_byte_timeout_s = 2
max_answer_bytes = {ANSWER_LIMIT}
max_frame_bytes = {FRAME_LIMIT}

[[models]]
name = "{MODEL}"
pool = "bad"
"""
        proc = start_router(tmp_path_factory.mktemp("bad-workers"), pool)
        yield proc
        proc.stop()
    finally:
        worker.kill()
        worker.wait()


def _create(router: RouterProcess, text: str) -> httpx.Response:
    return httpx.post(router.base_url + "/v1/responses", json={"model": MODEL, "input": text}, timeout=30)


def _stream(router: RouterProcess, text: str) -> list[dict[str, Any]]:
    """The events of a streamed create, to the stream's end (the router's, within 30 s)."""
    events = []
    with httpx.stream("POST", router.base_url + "/v1/responses", json={"model": MODEL, "input": text, "stream": True},
                      timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def _failed_with(router: RouterProcess, events: list[dict[str, Any]], words: str) -> None:
    """The stream ended with error + response.failed naming ``words``, and the response is stored failed."""
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-2:] == ["error", "response.failed"], types
    assert words in events[-2]["message"], events[-2]
    response_id = events[-1]["response"]["id"]
    stored = httpx.get(f"{router.base_url}/v1/responses/{response_id}", timeout=10).json()
    assert stored["status"] == "failed", stored


def _still_serves(router: RouterProcess) -> None:
    resp = _create(router, "hello")
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "completed", resp.json()


@pytest.mark.parametrize("frame, words", [
    ('{"choices": "nope"}', "'choices' that is not a list"),
    ('{"choices": ["x"]}', "a choice that is not an object"),
    ('{"choices": [{"index": 0, "delta": {"tool_calls": "zz"}}]}', "'tool_calls' that is not a list"),
    ('{"choices": [{"index": 0, "delta": {"content": 5}}]}', "'content' that is not a string"),
    ('{"choices": [{"index": 0, "delta": "x"}]}', "'delta' that is not an object"),
    ('[1, 2]', "not a JSON object"),
])
def test_a_wrong_shaped_frame_fails_the_stream_at_once(router: RouterProcess, frame: str, words: str) -> None:
    _failed_with(router, _stream(router, f"bad:frame {frame}"), words)
    _still_serves(router)


@pytest.mark.parametrize("answer, words", [
    ("{}", "no choices"),
    ('{"choices": []}', "no choices"),
    ('{"choices": "nope"}', "'choices' that is not a list"),
    ('{"choices": [{"message": {"tool_calls": "zz"}}]}', "'tool_calls' that is not a list"),
    ('[]', "not a JSON object"),
])
def test_a_wrong_shaped_answer_is_a_502_naming_it(router: RouterProcess, answer: str, words: str) -> None:
    resp = _create(router, f"bad:answer {answer}")
    assert resp.status_code == 502, resp.text
    assert words in resp.json()["error"]["message"], resp.json()
    _still_serves(router)


@pytest.mark.parametrize("kind", ["huge_answer", "huge_chunked"])
def test_an_answer_past_max_answer_bytes_is_a_502(router: RouterProcess, kind: str) -> None:
    resp = _create(router, f"bad:{kind} {20 * ANSWER_LIMIT}")
    assert resp.status_code == 502, resp.text
    assert "max_answer_bytes" in resp.json()["error"]["message"], resp.json()
    _still_serves(router)


def test_a_frame_past_max_frame_bytes_fails_the_stream(router: RouterProcess) -> None:
    _failed_with(router, _stream(router, f"bad:huge_frame {20 * FRAME_LIMIT}"), "max_frame_bytes")
    _still_serves(router)


def test_a_stream_with_no_first_token_fails_after_first_byte_timeout(router: RouterProcess) -> None:
    """read_timeout_s is 300 s here: only the 2 s first-byte timeout ends it within the client's 30 s."""
    _failed_with(router, _stream(router, "bad:silent"), "no answer began within 2 s")
    _still_serves(router)


def test_a_worker_that_never_answers_a_stream_is_a_clear_error(router: RouterProcess) -> None:
    with httpx.stream("POST", router.base_url + "/v1/responses",
                      json={"model": MODEL, "input": "bad:no_head", "stream": True}, timeout=30) as resp:
        body = resp.read()
    assert resp.status_code in (502, 503), body
    assert json.loads(body)["error"]["type"] == "server_error"
    _still_serves(router)
