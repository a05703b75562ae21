"""gpt-oss pools through harmony: the router renders tokens, sim workers speak vLLM's and SGLang's generate APIs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from harness import RouterProcess, sim_engine_pool_toml, start_router
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def harmony_pool(name: str, engine: str, vocab: Path, *, incremental: bool = False, scale_out: bool = True,
                 honor_service_tier: bool = False) -> str:
    args = ["--dialect", "harmony", "--harmony-vocab-dir", str(vocab), "--max-model-len", "8192"]
    if incremental:
        args.append("--incremental-streaming-output")
    if not scale_out:
        args.append("--no-scale-out")
    return sim_engine_pool_toml(name, engine, model="gpt-oss-sim", sim_args=args, honor_service_tier=honor_service_tier,
                                settings='dialect = "harmony"\ncontext_length = 8192\n')


@pytest.fixture(scope="module")
def harmony_router(tmp_path_factory: pytest.TempPathFactory, harmony_vocab: Path) -> Iterator[RouterProcess]:
    from harness import sim_pool_toml

    body = (
        f'[harmony]\nvocab_dir = "{harmony_vocab}"\n'
        + harmony_pool("oss-vllm", "vllm", harmony_vocab)
        + harmony_pool("oss-sglang", "sglang", harmony_vocab)
        + harmony_pool("oss-sglang-inc", "sglang", harmony_vocab, incremental=True)
        + harmony_pool("oss-vllm-completions", "vllm", harmony_vocab, scale_out=False)
        + sim_pool_toml(name="chat", replicas=1)
        + "".join(f'\n[[models]]\nname = "{m}"\npool = "{m}"\n'
                  for m in ("oss-vllm", "oss-sglang", "oss-sglang-inc", "oss-vllm-completions", "chat"))
    )
    proc = start_router(tmp_path_factory.mktemp("harmony"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def oss(harmony_router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=harmony_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


ENGINES = ["oss-vllm", "oss-sglang", "oss-sglang-inc", "oss-vllm-completions"]


@pytest.mark.parametrize("model", ENGINES)
def test_reasoning_then_answer(oss: openai.OpenAI, model: str) -> None:
    response = oss.responses.create(model=model, input="hello [sim:reason=5] [sim:tokens=4]")
    assert response.status == "completed"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and len(reasoning.content[0].text.split()) == 5
    assert message.type == "message" and len(response.output_text.split()) == 4
    usage = response.usage
    assert usage.input_tokens > 20 and usage.output_tokens > 9  # counted in tokens, channel headers included
    events = [e.model_dump() for e in oss.responses.create(model=model, input="hello [sim:reason=5] [sim:tokens=4]", stream=True)]
    final = check_stream(events)
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == response.output_text
    assert final["usage"] == response.usage.model_dump()


@pytest.mark.parametrize("model", ENGINES)
def test_usage_counts_reasoning_and_cached_tokens(oss: openai.OpenAI, enc: Any, model: str) -> None:
    """reasoning_tokens: the analysis tokens the router parsed (the message's <|message|> and content, as
    vLLM's Responses server counts them); cached_tokens: what the engine reports (vLLM's
    usage.prompt_tokens_details, SGLang's meta_info), streamed or not."""
    prompt = "hello [sim:reason=6] [sim:tokens=3] [sim:cached=5]"
    plain = oss.responses.create(model=model, input=prompt)
    reasoning = plain.output[0]
    assert reasoning.type == "reasoning"
    analysis = 1 + len(enc.encode(reasoning.content[0].text, disallowed_special=()))
    usage = plain.usage
    assert usage.output_tokens_details.reasoning_tokens == analysis < usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 5
    events = [e.model_dump() for e in oss.responses.create(model=model, input=prompt, stream=True)]
    assert check_stream(events)["usage"] == usage.model_dump()
    none = oss.responses.create(model=model, input="hello [sim:reason=0] [sim:tokens=3]").usage
    assert none.output_tokens_details.reasoning_tokens == 0 and none.output_tokens > 3


@pytest.mark.parametrize("model", ENGINES)
def test_function_tool_round_trip(oss: openai.OpenAI, model: str) -> None:
    first = oss.responses.create(model=model, input="weather? [sim:call=get_weather]", tools=[WEATHER])
    call = next(i for i in first.output if i.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    second = oss.responses.create(model=model, previous_response_id=first.id, tools=[WEATHER],
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.status == "completed" and second.output_text.startswith("tool said: sunny")


def test_two_calls_in_one_turn(oss: openai.OpenAI) -> None:
    time_tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    response = oss.responses.create(model="oss-vllm", input="both [sim:call=get_weather,get_time]", tools=[WEATHER, time_tool])
    assert [i.name for i in response.output if i.type == "function_call"] == ["get_weather", "get_time"]


class Forecast(BaseModel):
    """A city's forecast for some days."""

    city: str = Field(description="the city")
    days: int


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_a_tool_whose_parameters_have_a_description_is_called(oss: openai.OpenAI, model: str) -> None:
    """A pydantic schema (the Agents SDK's function tools) has a top-level description: harmony then
    renders the tool's argument block differently; the sim still finds the tool and fills its fields."""
    tool = {"type": "function", "name": "forecast", "description": "Forecast for a city",
            "parameters": Forecast.model_json_schema()}
    assert "description" in tool["parameters"]
    for text in ("weather? [sim:call=forecast]", "what is the forecast for Oslo?"):
        response = oss.responses.create(model=model, input=text, tools=[tool, WEATHER])
        calls = [i for i in response.output if i.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("forecast", {"city": "sim", "days": 1})], text


def test_multi_turn_and_moving_between_engines(oss: openai.OpenAI) -> None:
    previous = None
    for model in ["oss-vllm", "chat", "oss-sglang", "oss-vllm", "chat"]:
        response = oss.responses.create(model=model, input=f"turn on {model}", previous_response_id=previous)
        assert response.status == "completed", model
        previous = response.id
    # The chat pool sees the whole history, harmony turns included (stored as items, not tokens).
    echo = oss.responses.create(model="chat", input="recap [sim:echo]", previous_response_id=previous)
    users = [m["content"] for m in json.loads(echo.output_text) if m["role"] == "user"]
    assert users == ["turn on oss-vllm", "turn on chat", "turn on oss-sglang", "turn on oss-vllm", "turn on chat", "recap [sim:echo]"]


def test_length_cut_is_incomplete(oss: openai.OpenAI) -> None:
    response = oss.responses.create(model="oss-vllm", input="long [sim:tokens=200]", max_output_tokens=30)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 30


@pytest.mark.parametrize("model", ENGINES)
def test_garbage_tokens_still_give_a_well_formed_response(oss: openai.OpenAI, model: str) -> None:
    events = [e.model_dump() for e in oss.responses.create(model=model, input="noise [sim:garbage=40]", stream=True)]
    final = check_stream(events)
    assert final["status"] in ("completed", "incomplete")
    stored = oss.responses.retrieve(final["id"])
    assert stored.status == final["status"]


def test_builtin_recipient_without_a_backend(oss: openai.OpenAI) -> None:
    response = oss.responses.create(model="oss-vllm", input="search [sim:builtin=browser.search]")
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "tool_not_available"


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}
FILE = {"type": "input_file", "file_data": "data:text/plain;base64,aGk=", "filename": "a.txt"}


def refusal(oss: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as err:
        oss.responses.create(**kwargs)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "unsupported_content_type", body
    assert "reads text only" in body["message"]
    return body


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_images_and_files_are_a_400_naming_the_part(oss: openai.OpenAI, model: str) -> None:
    """gpt-oss reads text only: the part is named before any worker call or write, never dropped."""
    conversation = oss.conversations.create()
    for part, stream in ((IMAGE, False), (FILE, True)):
        content = [{"type": "input_text", "text": "what is this?"}, part]
        body = refusal(oss, model=model, conversation=conversation.id, stream=stream, input=[{"role": "user", "content": content}])
        assert body["param"] == "input[0].content[1]" and part["type"] in body["message"]
    answer = {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "a"}, IMAGE]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    body = refusal(oss, model=model, tools=[WEATHER], input=[{"role": "user", "content": "hi"}, call, answer])
    assert body["param"] == "input[2].output[1]"
    assert oss.conversations.items.list(conversation.id).data == []  # nothing was written


def test_an_image_an_earlier_turn_read_is_a_400_naming_that_item(oss: openai.OpenAI) -> None:
    """A chat pool read the image; a harmony pool cannot go on from it, and says which item holds it."""
    looked = oss.responses.create(model="chat", input=[{"role": "user", "content": [{"type": "input_text", "text": "look"}, IMAGE]}])
    assert looked.status == "completed"
    item = oss.responses.input_items.list(looked.id).data[0].id
    body = refusal(oss, model="oss-vllm", input="and now?", previous_response_id=looked.id)
    assert body["param"] == "previous_response_id" and repr(item) in body["message"] and "content[1]" in body["message"]
    body = refusal(oss, model="oss-sglang", stream=True, input=[{"type": "item_reference", "id": item}])
    assert body["param"] == "input[0]" and repr(item) in body["message"]
    conversation = oss.conversations.create(items=[{"type": "message", "role": "user", "content": [IMAGE]}])
    body = refusal(oss, model="oss-vllm", conversation=conversation.id, input="what was it?")
    assert body["param"] == "conversation"
    assert len(oss.conversations.items.list(conversation.id).data) == 1
    # The chain itself is fine: a pool that reads images goes on from it.
    assert oss.responses.create(model="chat", input="and now?", previous_response_id=looked.id).status == "completed"


def test_logprobs_are_refused_on_harmony(oss: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oss.responses.create(model="oss-vllm", input="x", top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_an_error_frame_after_the_200_fails_the_response(oss: openai.OpenAI, model: str) -> None:
    """Engines report some failures inside the stream (`data: {"error": ...}`): never a clean finish."""
    events = [e.model_dump() for e in oss.responses.create(model=model, input="x [sim:error_after=3]", stream=True)]
    final = check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "upstream_error"
    assert final["error"]["code"] == "server_error" and "simulated" in final["error"]["message"].lower()
    assert oss.responses.retrieve(final["id"]).status == "failed"


def test_encrypted_reasoning_in_a_stateless_tool_loop(oss: openai.OpenAI) -> None:
    prompt = "weather? [sim:reason=5] [sim:call=get_weather]"
    first = oss.responses.create(model="oss-vllm", input=prompt, tools=[WEATHER], store=False,
                                 include=["reasoning.encrypted_content"])
    reasoning = next(i for i in first.output if i.type == "reasoning")
    call = next(i for i in first.output if i.type == "function_call")
    assert reasoning.encrypted_content and reasoning.content[0].text not in reasoning.encrypted_content
    user = [{"role": "user", "content": prompt}]
    tail = [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    blob = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    # The analysis of a tool loop in progress is kept in the prompt: opening the blob adds its tokens.
    with_reasoning = oss.responses.input_tokens.count(model="oss-vllm", input=[*user, blob, *tail], tools=[WEATHER])
    without = oss.responses.input_tokens.count(model="oss-vllm", input=[*user, *tail], tools=[WEATHER])
    assert with_reasoning.input_tokens > without.input_tokens
    second = oss.responses.create(model="oss-vllm", input=[*user, blob, *tail], tools=[WEATHER], store=False)
    assert second.status == "completed" and second.output_text.startswith("tool said: sunny")
    blob["encrypted_content"] = reasoning.encrypted_content[::-1]
    with pytest.raises(openai.BadRequestError) as err:
        oss.responses.create(model="oss-vllm", input=[*user, blob, *tail], tools=[WEATHER], store=False)
    assert err.value.body["code"] == "invalid_encrypted_content"


def test_a_schema_that_is_not_json_is_a_400(harmony_router: RouterProcess, oss: openai.OpenAI) -> None:
    """NaN is not JSON (openai-harmony could not render it either): a clear 400 at the request's
    boundary, as on every pool (router/api/http.py)."""
    anchor = oss.responses.create(model="oss-vllm", input="before [sim:tokens=3]")
    for stream in ("false", "true"):
        body = ('{"model":"oss-vllm","input":"hi","stream":%s,"previous_response_id":"%s","tools":[{"type":"function",'  # noqa: UP031 - JSON's braces
                '"name":"f","parameters":{"type":"object","properties":{"x":{"type":"number","default":NaN}}}}]}'
                % (stream, anchor.id))
        resp = httpx.post(harmony_router.base_url + "/v1/responses", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json" and "NaN" in error["message"]
    # A number too large for a float reads as infinity: harmony's renderer refuses it, as clearly.
    body = ('{"model":"oss-vllm","input":"hi","tools":[{"type":"function","name":"f","parameters":'
            '{"type":"object","properties":{"x":{"type":"number","maximum":1e400}}}}]}')
    resp = httpx.post(harmony_router.base_url + "/v1/responses", content=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools" and resp.json()["error"]["code"] == "invalid_tools"
    # Nothing was disturbed: the chain goes on.
    assert oss.responses.retrieve(anchor.id).status == "completed"
    assert oss.responses.create(model="oss-vllm", input="after", previous_response_id=anchor.id).status == "completed"
