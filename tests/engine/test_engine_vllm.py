"""A real vLLM (CPU build) behind the router: the router's launcher starts the engines itself.

One router, two managed pools of one worker each, shared by the module:

- ``tiny-chat``: a random tiny Llama through the chat dialect (``/v1/chat/completions``);
- ``tiny-oss``: a random tiny gpt-oss through the harmony dialect (the router renders
  harmony tokens and calls vLLM's ``/inference/v1/generate``, which needs ``--enable-scale-out``).

The models are random, so what they say is noise: the tests check shapes, counts and
lifecycles, never words. The chat model's weights keep its end token from being sampled
(scripts/build_tiny_models.py), so a plain generation always runs to its token limit,
while a grammar (structured output) still ends it. Token counts are checked against
what the engine itself reports: its ``/tokenize`` endpoint and its ``/metrics`` counters.

Preparation (venv, models) is ``scripts/prepare_vllm_cpu.py``, via tests/support/engine_env.py:
if it fails, these tests fail with its reason. Run: ``python -m pytest -m engine``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import RouterProcess, free_range, start_router
from tests.support.engine_env import engine_cpu, serving, vllm_prepared  # noqa: F401 - vllm_prepared: the session fixture
from tests.support.streamrules import check_stream, text_of

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

CHAT = "tiny-chat"
OSS = "tiny-oss"
# Long enough that an answer lasts seconds even on an idle machine (~2 ms a token here): the
# cancel and kill tests must interrupt a generation that is still running.
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 300
# Both pools start one after the other (the router starts pools in order).
ROUTER_READY_S = 2 * START_TIMEOUT_S + 30


_ENGINE_CPU = engine_cpu()


def _pool(name: str, model: Path, prepared: Any, *, dialect: str, env: dict[str, str]) -> str:
    first, last = free_range()
    command = [*_ENGINE_CPU, str(prepared.python), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}",
               "--host", "{host}", "--port", "{port}", "--dtype", "float32",
               "--max-model-len", str(MAX_MODEL_LEN), "--enable-scale-out",
               # No torch.compile warm-up: halves the start-up (about a minute on 2 cores).
               "--enforce-eager"]
    env_toml = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}"
    return f"""
[[pools]]
name = "{name}"
engine = "vllm"
dialect = "{dialect}"
model = "{model}"
context_length = {MAX_MODEL_LEN}
health_interval_s = 0.5
[pools.managed]
replicas = 1
port_range = [{first}, {last}]
command = {json.dumps(command)}
env = {env_toml}
start_timeout_s = {START_TIMEOUT_S}
stop_timeout_s = 15
log_dir = "logs"
"""


@pytest.fixture(scope="module")
def engine_router(tmp_path_factory: pytest.TempPathFactory, vllm_prepared: Any) -> Iterator[RouterProcess]:  # noqa: F811
    prepared = vllm_prepared
    env = prepared.engine_env()
    body = (
        f'[harmony]\nvocab_dir = "{prepared.vocab_dir}"\n'
        + _pool(CHAT, prepared.chat_model, prepared, dialect="chat", env=env)
        + _pool(OSS, prepared.oss_model, prepared, dialect="harmony", env=env)
        + f'\n[[models]]\nname = "{CHAT}"\npool = "{CHAT}"\n[[models]]\nname = "{OSS}"\npool = "{OSS}"\n'
    )
    tmp = tmp_path_factory.mktemp("engine")
    yield from serving(start_router(tmp, body, wait=False), ROUTER_READY_S, "two vLLM CPU workers")


@pytest.fixture(scope="module")
def client(engine_router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- helpers: the router's /health, the worker's own endpoints ---------------------------


def _get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _post_json(url: str, body: dict[str, Any], timeout: float = 30) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _health(router: RouterProcess) -> dict[str, Any]:
    try:
        return _get_json(router.base_url + "/health")
    except urllib.error.HTTPError as exc:  # 503 still carries the body
        return json.loads(exc.read())


def _worker(router: RouterProcess, pool: str) -> dict[str, Any]:
    """The pool's one worker as the router's /health describes it (url, healthy, process pid...)."""
    found = next(p for p in _health(router)["pools"] if p["name"] == pool)
    (worker,) = found["workers"]
    return worker


_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$")


def _metrics(worker_url: str) -> dict[str, float]:
    """vLLM's Prometheus gauges and counters (one engine, one model: labels dropped)."""
    with urllib.request.urlopen(worker_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _engine_prompt_tokens(router: RouterProcess, pool: str, model: Path, messages: list[dict[str, str]]) -> int:
    """How many tokens the engine's own chat template + tokenizer make of ``messages``."""
    url = _worker(router, pool)["url"]
    body = _post_json(url + "/tokenize", {"model": str(model), "messages": messages, "add_generation_prompt": True})
    return body["count"]


def _wait(predicate, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


# -- chat dialect ---------------------------------------------------------------------


def test_chat_text(client: openai.OpenAI, engine_router: RouterProcess, vllm_prepared: Any) -> None:  # noqa: F811
    response = client.responses.create(model=CHAT, input="Hello there", max_output_tokens=12)
    # The end token is suppressed: the generation always runs to the limit.
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert isinstance(response.output_text, str) and response.output_text
    usage = response.usage
    expected_in = _engine_prompt_tokens(engine_router, CHAT, vllm_prepared.chat_model, [{"role": "user", "content": "Hello there"}])
    assert usage.input_tokens == expected_in
    assert usage.output_tokens == 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    stored = client.responses.retrieve(response.id)
    assert stored.status == "incomplete" and stored.output_text == response.output_text


def test_chat_stream(client: openai.OpenAI) -> None:
    events = [e.model_dump() for e in client.responses.create(model=CHAT, input="Stream, please", max_output_tokens=20, stream=True)]
    final = check_stream(events)
    assert final["status"] == "incomplete"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == text_of(final)
    usage = final["usage"]
    assert usage["output_tokens"] == 20 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert client.responses.retrieve(final["id"]).usage.model_dump() == usage


def test_chat_usage_matches_engine_counters(client: openai.OpenAI, engine_router: RouterProcess) -> None:
    url = _worker(engine_router, CHAT)["url"]
    before = _metrics(url)
    response = client.responses.create(model=CHAT, input="Count me", max_output_tokens=7)
    after = _metrics(url)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == response.usage.output_tokens == 7
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == response.usage.input_tokens


def test_chat_max_output_tokens_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=CHAT, input="Talk a lot", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def test_chat_json_schema(client: openai.OpenAI) -> None:
    """vLLM's structured output (xgrammar) works on CPU: the grammar forces valid JSON and then the end token."""
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(model=CHAT, input="Answer in JSON", text=fmt, max_output_tokens=300)
    assert response.status == "completed", (response.status, response.incomplete_details, response.output_text)
    data = json.loads(response.output_text)
    assert set(data) == {"ok", "color"} and isinstance(data["ok"], bool) and data["color"] in ("red", "green", "blue")
    assert response.text.format.type == "json_schema"


def test_chat_five_turn_chain(client: openai.OpenAI, engine_router: RouterProcess, vllm_prepared: Any) -> None:  # noqa: F811
    previous = None
    messages: list[dict[str, str]] = []
    inputs: list[int] = []
    for turn in range(5):
        text = f"turn {turn}"
        response = client.responses.create(model=CHAT, input=text, previous_response_id=previous, max_output_tokens=6)
        assert response.status == "incomplete" and response.usage.output_tokens == 6
        messages += [{"role": "user", "content": text}]
        # The engine saw the whole chain: its own template and tokenizer give the same count.
        assert response.usage.input_tokens == _engine_prompt_tokens(engine_router, CHAT, vllm_prepared.chat_model, messages), turn
        messages += [{"role": "assistant", "content": response.output_text}]
        inputs.append(response.usage.input_tokens)
        previous = response.id
    assert inputs == sorted(inputs) and len(set(inputs)) == 5
    items = client.responses.input_items.list(previous, order="asc", limit=100)
    assert [i.role for i in items.data if i.type == "message"] == ["user"]  # the response's own input


def _engine_generating(client: openai.OpenAI, rid: str) -> None:
    """Waits until the engine's first tokens for background response ``rid`` have reached the router:
    a text delta in its event log, replayed (read until one comes). Not read off vLLM: on this 2-core
    machine a busy vLLM CPU engine starves its own API server, so its /metrics can come late, in bursts."""
    with client.responses.retrieve(rid, stream=True) as replay:
        assert any(event.type == "response.output_text.delta" for event in replay), f"{rid} ended with no text"


def test_background_cancel_stops_the_engine_request(client: openai.OpenAI, engine_router: RouterProcess) -> None:
    """Cancelled while generating: vLLM aborts the request long before its token budget."""
    url = _worker(engine_router, CHAT)["url"]
    before = _metrics(url)
    assert before["vllm:num_requests_running"] == 0
    budget = MAX_MODEL_LEN - 100  # seconds of generation, even on an idle machine
    queued = client.responses.create(model=CHAT, input="A long background story", background=True,
                                      max_output_tokens=budget)
    assert queued.status in ("queued", "in_progress")
    _engine_generating(client, queued.id)
    client.responses.cancel(queued.id)
    final = _wait(lambda: (r := client.responses.retrieve(queued.id)).status in ("cancelled", "completed", "incomplete",
                                                                                 "failed") and r, 30, "a final status")
    assert final.status == "cancelled", f"the response finished as {final.status} before the cancel took effect"
    # The router dropped its upstream request and vLLM aborted it.
    _wait(lambda: _metrics(url)["vllm:num_requests_running"] == 0, 30, "vllm:num_requests_running back to 0")
    generated = _metrics(url)["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < budget, f"vLLM generated all {generated} tokens: the request was not aborted"
    # The engine is free again: a plain request is served.
    assert client.responses.create(model=CHAT, input="after cancel", max_output_tokens=3).usage.output_tokens == 3


# -- harmony dialect over /inference/v1/generate -------------------------------------


def test_harmony_generate_stream(client: openai.OpenAI, engine_router: RouterProcess) -> None:
    """Whatever the random gpt-oss emits, the response is well formed and counted in engine tokens."""
    url = _worker(engine_router, OSS)["url"]
    before = _metrics(url)
    events = [e.model_dump() for e in client.responses.create(model=OSS, input="Hello", max_output_tokens=24, stream=True)]
    after = _metrics(url)
    final = check_stream(events)
    assert final["status"] in ("completed", "incomplete"), final.get("error")
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert final["usage"]["output_tokens"] == generated and 0 < generated <= 24
    assert final["usage"]["input_tokens"] == prompt
    stored = client.responses.retrieve(final["id"])
    assert stored.status == final["status"]


def test_harmony_generate_non_stream(client: openai.OpenAI, engine_router: RouterProcess) -> None:
    url = _worker(engine_router, OSS)["url"]
    before = _metrics(url)
    response = client.responses.create(model=OSS, input="Say something", max_output_tokens=16)
    after = _metrics(url)
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason in ("max_output_tokens", "content_filter", "tool_not_available")
    assert response.usage.output_tokens == after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert response.usage.input_tokens == after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    # A second turn on the chain renders the first one back into harmony tokens.
    second = client.responses.create(model=OSS, input="And again", previous_response_id=response.id, max_output_tokens=8)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > response.usage.input_tokens


# -- a worker killed mid-stream (last: it takes the chat worker down) --------------------


def test_worker_killed_mid_stream_fails_the_stream_then_restarts(client: openai.OpenAI, engine_router: RouterProcess) -> None:
    worker = _worker(engine_router, CHAT)
    pid = worker["process"]["pid"]
    events: list[dict[str, Any]] = []
    killed = False
    stream = client.responses.create(model=CHAT, input="A long story to interrupt", max_output_tokens=MAX_MODEL_LEN - 100,
                                     stream=True)
    for event in stream:
        events.append(event.model_dump())
        if not killed and event.type == "response.output_text.delta":  # the engine is generating: its first tokens are here
            os.killpg(pid, signal.SIGKILL)  # the engine and its helper processes, as a crash would
            killed = True
    assert killed, "the stream ended before its first event"
    final = check_stream(events)
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"], kinds[-5:]
    assert final["status"] == "failed" and final["error"]
    assert client.responses.retrieve(final["id"]).status == "failed"

    # The launcher restarts the worker: /health shows it healthy again (a new process), and it serves.
    restarted = _wait(lambda: (w := _worker(engine_router, CHAT))["healthy"] and w["process"]["pid"] != pid and w,
                      START_TIMEOUT_S + 60, "the killed worker restarted and healthy", interval=1)
    assert restarted["process"]["restarts"] >= 1
    response = client.responses.create(model=CHAT, input="back again", max_output_tokens=4)
    assert response.status == "incomplete" and response.usage.output_tokens == 4


def test_harmony_worker_killed_mid_generate_fails_the_stream(client: openai.OpenAI, engine_router: RouterProcess) -> None:
    """The same over /inference/v1/generate. A random gpt-oss writes no channel header, so the router holds its
    tokens back as an unfinished header: nothing but the lifecycle events arrives before the end, and the kill is
    timed instead of triggered by a delta. Last test: the restart of this worker is not waited for."""
    pid = _worker(engine_router, OSS)["process"]["pid"]
    timer = threading.Timer(2.0, os.killpg, (pid, signal.SIGKILL))
    events: list[dict[str, Any]] = []
    try:
        stream = client.responses.create(model=OSS, input="A long answer to interrupt", stream=True,
                                         max_output_tokens=MAX_MODEL_LEN - 100)
        timer.start()
        events = [e.model_dump() for e in stream]
    finally:
        timer.cancel()
    final = check_stream(events)
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"], f"{kinds[-5:]}, usage {final.get('usage')}"
    assert final["status"] == "failed" and final["error"]
    assert client.responses.retrieve(final["id"]).status == "failed"
