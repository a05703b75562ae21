"""Harmony pools mean what chat pools mean: text.format (responses.parse), forced tool choices and
truncation "auto", through a real router process, sim workers on vLLM's and SGLang's generate
wires (and vLLM's completions fallback), and the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from harness import RouterProcess, start_router
from tests.e2e.test_e2e_harmony import harmony_pool
from tests.support.fake_search import FakeSearch
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e

CONTEXT = 8192  # harmony_pool's --max-model-len and context_length
MODELS = ["oss-vllm", "oss-sglang", "oss-vllm-completions"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "description": "Clock of a zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}


class Forecast(BaseModel):
    city: str
    degrees: int
    windy: bool
    hours: list[str]


@pytest.fixture(scope="module")
def parity_router(tmp_path_factory: pytest.TempPathFactory, harmony_vocab: Path) -> Iterator[RouterProcess]:
    search = FakeSearch().start()  # web_search runs on the router: a hosted tool to force
    body = (
        f'[harmony]\nvocab_dir = "{harmony_vocab}"\n'
        + harmony_pool("oss-vllm", "vllm", harmony_vocab)
        + harmony_pool("oss-sglang", "sglang", harmony_vocab)
        + harmony_pool("oss-vllm-completions", "vllm", harmony_vocab, scale_out=False)
        + "".join(f'\n[[models]]\nname = "{m}"\npool = "{m}"\n' for m in MODELS)
        + f'\n[tools]\nprivate_networks = ["127.0.0.0/8"]\n[tools.web_search]\nurl = "{search.search_url}"\n'
    )
    try:
        proc = start_router(tmp_path_factory.mktemp("harmony-parity"), body)
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        search.stop()


@pytest.fixture(scope="module")
def oss(parity_router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=parity_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


# -- text.format -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_parse_returns_the_object_after_free_reasoning(oss: openai.OpenAI, model: str) -> None:
    prompt = "the forecast for Paris [sim:reason=5]"
    parsed = oss.responses.parse(model=model, input=prompt, text_format=Forecast)
    assert parsed.status == "completed"
    assert [i.type for i in parsed.output] == ["reasoning", "message"]
    assert len(parsed.output[0].content[0].text.split()) == 5  # the analysis was not held to the schema
    assert isinstance(parsed.output_parsed, Forecast)
    with oss.responses.stream(model=model, input=prompt, text_format=Forecast) as stream:
        events = [event.model_dump(warnings=False) for event in stream]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Forecast) and final.output_parsed == parsed.output_parsed
    assert check_stream(events)["status"] == "completed"
    # The same prompt without a format: plain words, no JSON.
    plain = oss.responses.create(model=model, input=prompt)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.output_text)


@pytest.mark.parametrize("model", MODELS)
def test_json_object(oss: openai.OpenAI, model: str) -> None:
    response = oss.responses.create(model=model, input="some JSON please [sim:reason=0]", text={"format": {"type": "json_object"}})
    assert response.status == "completed" and [i.type for i in response.output] == ["message"]
    assert isinstance(json.loads(response.output_text), dict)


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_json_schema_beside_tools_still_calls_them(oss: openai.OpenAI, model: str) -> None:
    """The Agents SDK sends output_type's schema with the agent's tools: the model may still call one."""
    response = oss.responses.parse(model=model, input="what is the weather in Paris?", tools=[WEATHER], text_format=Forecast)
    call = next(i for i in response.output if i.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answer = oss.responses.parse(model=model, previous_response_id=response.id, tools=[WEATHER], text_format=Forecast,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.status == "completed" and isinstance(answer.output_parsed, Forecast)


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_a_schema_the_engine_cannot_compile_is_its_answer(oss: openai.OpenAI, model: str) -> None:
    """A schema with no finite instance: the engine's 400, in the OpenAI error shape."""
    fmt = {"type": "json_schema", "name": "loop", "schema": {"$ref": "#"}}
    engine_says = "Invalid grammar specification: 'triggers'" if model == "oss-vllm" else "Invalid grammar request"
    with pytest.raises(openai.BadRequestError) as err:
        oss.responses.create(model=model, input="x", text={"format": fmt})
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "upstream_rejected" and engine_says in body["message"]
    if model == "oss-vllm":  # refused before the stream starts
        with pytest.raises(openai.BadRequestError):
            oss.responses.create(model=model, input="x", text={"format": fmt}, stream=True)
    else:  # SGLang says it inside its stream: the response fails
        events = [e.model_dump() for e in oss.responses.create(model=model, input="x", text={"format": fmt}, stream=True)]
        final = check_stream(events)
        assert final["status"] == "failed" and engine_says in final["error"]["message"]


# -- forced tool choices ---------------------------------------------------------------------


def calls_of(response: Any) -> list[Any]:
    assert response.status == "completed"
    assert not any(i.type == "message" for i in response.output), response.output
    return [i for i in response.output if i.type == "function_call"]


@pytest.mark.parametrize("model", MODELS)
def test_required_forces_a_call(oss: openai.OpenAI, model: str) -> None:
    prompt = "hello there [sim:reason=3]"  # mentions no tool: under auto the model answers
    free = oss.responses.create(model=model, input=prompt, tools=[WEATHER, TIME])
    assert free.output_text and not any(i.type == "function_call" for i in free.output)
    (call,) = calls_of(oss.responses.create(model=model, input=prompt, tools=[WEATHER, TIME], tool_choice="required"))
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = [e.model_dump() for e in oss.responses.create(model=model, input=prompt, tools=[WEATHER, TIME],
                                                            tool_choice="required", stream=True)]
    final = check_stream(events)
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"] and final["status"] == "completed"


@pytest.mark.parametrize("model", MODELS)
def test_a_named_function_is_the_one_called(oss: openai.OpenAI, model: str) -> None:
    prompt = "what is the weather in Paris?"  # the model would call get_weather
    for choice in ({"type": "function", "name": "get_time"},
                   {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}):
        (call,) = calls_of(oss.responses.create(model=model, input=prompt, tools=[WEATHER, TIME], tool_choice=choice))
        assert call.name == "get_time", choice
        jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
        with oss.responses.stream(model=model, input=prompt, tools=[WEATHER, TIME], tool_choice=choice) as stream:
            (streamed,) = calls_of(stream.get_final_response())
        assert streamed.name == "get_time"


def test_allowed_tools_required_picks_among_the_allowed(oss: openai.OpenAI) -> None:
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "get_time"}, {"type": "function", "name": "get_weather"}]}
    (call,) = calls_of(oss.responses.create(model="oss-sglang", input="hi", tools=[WEATHER, TIME], tool_choice=choice))
    assert call.name in ("get_time", "get_weather")


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_a_named_hosted_tool_is_called(oss: openai.OpenAI, model: str) -> None:
    """tool_choice web_search: gpt-oss's own browser.search, run by the router, then the answer."""
    prompt = "hello there"
    free = oss.responses.create(model=model, input=prompt, tools=[{"type": "web_search"}])
    assert not any(i.type == "web_search_call" for i in free.output)
    for stream in (False, True):
        if stream:
            events = [e.model_dump() for e in oss.responses.create(model=model, input=prompt, tools=[{"type": "web_search"}],
                                                                    tool_choice={"type": "web_search_preview"}, stream=True)]
            output = check_stream(events)["output"]
        else:
            response = oss.responses.create(model=model, input=prompt, tools=[{"type": "web_search"}],
                                            tool_choice={"type": "web_search_preview"})
            output = [i.model_dump() for i in response.output]
        kinds = [i["type"] for i in output if i["type"] != "reasoning"]
        assert kinds == ["web_search_call", "message"], kinds
        call = next(i for i in output if i["type"] == "web_search_call")
        assert call["status"] == "completed" and call["action"]["type"] == "search" and call["action"]["query"] == prompt


# -- truncation ------------------------------------------------------------------------------


def long_history(enc: Any) -> list[dict[str, Any]]:
    """Three turns whose prompt overflows the context; the last two fit."""
    filler = " ".join(["alpha", "beta", "gamma", "delta"] * 800)
    size = len(enc.encode(filler, disallowed_special=()))
    assert 2 * size + 200 < CONTEXT < 3 * size, size
    turns: list[dict[str, Any]] = []
    for n in ("one", "two"):
        turns += [{"role": "user", "content": f"{filler} {n}"}, {"role": "assistant", "content": f"noted {n}"}]
    return [*turns, {"role": "user", "content": f"{filler} three [sim:tokens=3]"}]


@pytest.mark.parametrize("model", MODELS)
def test_truncation_auto_drops_the_oldest_turns(oss: openai.OpenAI, enc: Any, model: str) -> None:
    history = long_history(enc)
    with pytest.raises(openai.BadRequestError) as err:
        oss.responses.create(model=model, input=history)
    assert err.value.body["code"] == "context_length_exceeded"
    response = oss.responses.create(model=model, input=history, truncation="auto")
    assert response.status == "completed" and response.truncation == "auto"
    assert len(response.output_text.split()) == 3
    # the first turn went, the second stayed: the prompt holds two fillers
    assert CONTEXT // 2 < response.usage.input_tokens < CONTEXT
    events = [e.model_dump() for e in oss.responses.create(model=model, input=history, truncation="auto", stream=True)]
    final = check_stream(events)
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == response.usage.input_tokens


def test_truncation_auto_in_a_chain_and_a_last_turn_too_long(oss: openai.OpenAI, enc: Any) -> None:
    history = long_history(enc)
    first = oss.responses.create(model="oss-vllm", input=history[:2])
    second = oss.responses.create(model="oss-vllm", input=history[2:4], previous_response_id=first.id)
    third = oss.responses.create(model="oss-sglang", input=history[4:], previous_response_id=second.id, truncation="auto")
    assert third.status == "completed" and third.usage.input_tokens < CONTEXT
    # The stored chain is whole: truncation shaped the prompt only.
    assert len(oss.responses.input_items.list(second.id).data) == 2
    huge = " ".join(["alpha"] * (CONTEXT + 100))
    with pytest.raises(openai.BadRequestError) as err:
        oss.responses.create(model="oss-vllm", input=huge, truncation="auto")
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "input"
