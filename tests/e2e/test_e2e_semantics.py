"""Full Responses semantics through a chat pool, driven by the openai SDK end to end."""

from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel

from tests.conftest import MODEL, THINK_MODEL
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}


def sent_request(response: openai.types.responses.Response) -> dict:
    """What the worker received, apart from messages (the sim's [sim:echo=request])."""
    return json.loads(response.output_text)


def events_of(client: openai.OpenAI, **kwargs) -> tuple[list[dict], dict]:  # type: ignore[no-untyped-def]
    events = [e.model_dump() for e in client.responses.create(stream=True, **kwargs)]
    return events, check_stream(events)


def without_ids(output: list) -> list[dict]:
    """Output items minus fresh ids and the SDK's unset (None) fields, for comparing two runs."""
    items = [i if isinstance(i, dict) else i.model_dump() for i in output]
    return [{k: v for k, v in item.items() if k not in ("id", "call_id") and v is not None} for item in items]


# -- function tools ---------------------------------------------------------------


def test_strict_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Weather in Oslo? [sim:call=get_weather]", tools=[WEATHER])
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and isinstance(args["days"], int)
    assert first.tools[0].name == "get_weather" and first.tools[0].strict is True
    # The Agents SDK's continuation: only the tool output, plus previous_response_id.
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}],
    )
    assert second.status == "completed" and second.output_text.startswith("tool said: sunny, 21C")
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]


def test_function_call_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input="two calls [sim:call=get_weather,get_time]", tools=[WEATHER, TIME])
    plain = client.responses.create(**kwargs)
    events, final = events_of(client, **kwargs)
    assert without_ids(final["output"]) == without_ids(plain.output)
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["call_id"] for c in calls}) == 2
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 2, "arguments should stream in fragments"
    done = {e["item_id"]: e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"}
    assert done == {c["id"]: c["arguments"] for c in calls}
    # Both outputs go back in one continuation.
    outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": f"result {i}"} for i, c in enumerate(calls)]
    follow = client.responses.create(model=MODEL, previous_response_id=final["id"], input=outputs, tools=[WEATHER, TIME])
    assert follow.output_text.startswith("tool said: result 1")


def test_stream_helper_with_strict_tool(client: openai.OpenAI) -> None:
    class Lookup(BaseModel):
        city: str
        days: int

    tool = openai.pydantic_function_tool(Lookup, name="lookup")
    with client.responses.stream(model=MODEL, input="look it up [sim:call=lookup]", tools=[tool]) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and isinstance(call.parsed_arguments, Lookup)


def test_namespace_and_custom_tools(client: openai.OpenAI) -> None:
    tools = [
        {"type": "namespace", "name": "crm", "description": "customer records",
         "tools": [{"type": "function", "name": "find", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
        {"type": "custom", "name": "run_sql", "description": "runs SQL"},
    ]
    first = client.responses.create(model=MODEL, input="go [sim:call=crm__find,run_sql]", tools=tools)
    find, sql = first.output
    assert (find.type, find.name, find.namespace) == ("function_call", "find", "crm")
    assert sql.type == "custom_tool_call" and sql.name == "run_sql" and isinstance(sql.input, str) and sql.input
    follow = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=tools,
        input=[{"type": "function_call_output", "call_id": find.call_id, "output": "found"},
               {"type": "custom_tool_call_output", "call_id": sql.call_id, "output": "3 rows"},
               {"role": "user", "content": "and now? [sim:echo]"}],
    )
    messages = json.loads(follow.output_text)
    assistant = next(m for m in messages if m.get("tool_calls"))
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["crm__find", "run_sql"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["found", "3 rows"]


def test_tool_choice_forms_reach_the_worker(client: openai.OpenAI) -> None:
    forced = client.responses.create(model=MODEL, input="anything", tools=[WEATHER, TIME],
                                     tool_choice={"type": "function", "name": "get_time"})
    assert [i.name for i in forced.output] == ["get_time"]
    required = client.responses.create(model=MODEL, input="anything", tools=[WEATHER], tool_choice="required")
    assert required.output[0].type == "function_call"
    none = client.responses.create(model=MODEL, input="no tools [sim:call=get_weather]", tools=[WEATHER], tool_choice="none")
    assert none.output[0].type == "message"
    sent = sent_request(client.responses.create(
        model=MODEL, input="[sim:echo=request]", tools=[WEATHER, TIME], parallel_tool_calls=False,
        tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]},
    ))
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_time"]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False


def test_builtin_tools_are_echoed_not_offered(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="[sim:echo=request]", tools=[{"type": "web_search"}, WEATHER])
    assert "web_search" in [t.type for t in response.tools]
    assert [t["function"]["name"] for t in sent_request(response)["tools"]] == ["get_weather"]


# -- structured output ---------------------------------------------------------------


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]


def test_parse_with_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="Make up a person.", text_format=Person)
    assert isinstance(parsed.output_parsed, Person)
    assert parsed.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input="Make up a person.", text_format=Person) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person)


def test_json_schema_and_object_reach_the_worker(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
    sent = sent_request(client.responses.create(
        model=MODEL, input="[sim:echo=request]",
        text={"format": {"type": "json_schema", "name": "pt", "schema": schema, "strict": True}},
    ))
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"name": "pt", "schema": schema, "strict": True}}
    answer = client.responses.create(model=MODEL, input="an object", text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(answer.output_text), dict)


# -- reasoning, logprobs, usage, refusal --------------------------------------------------


def test_reasoning_items_with_summary(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input="think first [sim:reason=6] [sim:tokens=4]", reasoning={"effort": "high", "summary": "auto"})
    plain = client.responses.create(**kwargs)
    reasoning, message = plain.output
    assert reasoning.type == "reasoning" and len(reasoning.content[0].text.split()) == 6
    assert reasoning.summary[0].text == reasoning.content[0].text
    assert message.type == "message" and len(plain.output_text.split()) == 4
    assert plain.usage.output_tokens == 10
    events, final = events_of(client, **kwargs)
    kinds = [e["type"] for e in events]
    for kind in ("response.reasoning_text.delta", "response.reasoning_text.done", "response.reasoning_summary_part.added",
                 "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done"):
        assert kind in kinds, kind
    assert without_ids(final["output"]) == without_ids(plain.output)
    sent = sent_request(client.responses.create(model=MODEL, input="[sim:echo=request]", reasoning={"effort": "low"}))
    assert sent["reasoning_effort"] == "low"


def test_think_tags_and_reasoning_given_back(client: openai.OpenAI) -> None:
    first = client.responses.create(model=THINK_MODEL, input="ponder [sim:think=5] [sim:tokens=3]")
    reasoning, _message = first.output
    assert reasoning.type == "reasoning" and len(reasoning.content[0].text.split()) == 5
    assert "<think>" not in first.output_text and len(first.output_text.split()) == 3
    second = client.responses.create(model=THINK_MODEL, input="again [sim:echo]", previous_response_id=first.id)
    assistant = next(m for m in json.loads(second.output_text) if m["role"] == "assistant")
    assert assistant["reasoning_content"] == reasoning.content[0].text  # this pool's engine takes reasoning back


def test_logprobs(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="[sim:tokens=3]", top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in logprobs)
    events, _ = events_of(client, model=MODEL, input="[sim:tokens=3]", top_logprobs=2, include=["message.output_text.logprobs"])
    assert all(e["logprobs"] for e in events if e["type"] == "response.output_text.delta")


def test_cached_tokens_in_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="a long shared prefix [sim:cached=3]")
    assert response.usage.input_tokens_details.cached_tokens == 3


def test_refusal(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="something bad [sim:refuse]")
    (message,) = response.output
    assert message.content[0].type == "refusal" and message.content[0].refusal
    events, final = events_of(client, model=MODEL, input="something bad [sim:refuse]")
    assert "response.refusal.delta" in [e["type"] for e in events]
    assert final["output"][0]["content"][0]["type"] == "refusal"


# -- input items -------------------------------------------------------------------


def test_every_input_item_shape(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="seed")
    reply = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}]},
            {"type": "message", "role": "assistant", "id": None, "content": [{"type": "output_text", "text": "ok"}], "phase": "final_answer"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "thought"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "item_reference", "id": first.output[0].id},
            {"id": first.output[0].id},
            {"role": "user", "content": "go on [sim:echo]"},
        ],
        previous_response_id=first.id,
        tools=[WEATHER],
    )
    messages = json.loads(reply.output_text)
    assert messages[2]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}
    assert messages[3] == {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert messages[4] == {"role": "tool", "tool_call_id": "call_1", "content": "rain"}
    assert messages[-1] == {"role": "user", "content": "go on [sim:echo]"}
    # References to items already in the chain are not repeated.
    assert sum(1 for m in messages if m.get("content") == first.output_text) == 1


# -- truncation -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_context(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A router whose only worker has a 150-token context."""
    from harness import sim_pool_toml, start_router

    body = sim_pool_toml(replicas=1, extra_args='["--max-model-len", "150"]') + '\n[[models]]\nname = "small"\npool = "sim"\n'
    proc = start_router(tmp_path_factory.mktemp("small"), body)
    yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0


def test_truncation_auto_drops_the_oldest_turns(small_context: openai.OpenAI) -> None:
    previous = None
    for turn in range(20):  # 10 tokens a turn: past the 150-token context by the 15th
        # One-token answers: only a prompt past the context itself cuts one (a max_output_tokens above the
        # room left is clamped to it, never a reason to drop turns).
        response = small_context.responses.create(model="small", input=f"turn {turn} [sim:tokens=1]",
                                                  previous_response_id=previous, truncation="auto", max_output_tokens=20)
        assert response.status == "completed" and response.truncation == "auto"
        assert response.usage is not None and response.usage.input_tokens < 150
        previous = response.id
    echo = small_context.responses.create(model="small", input="what do you see [sim:echo]", previous_response_id=previous,
                                          truncation="auto", max_output_tokens=60)
    # The oldest turns went until the prompt fit; the echo of the rest fills the room left, cut there.
    assert echo.status == "incomplete" and echo.usage is not None and echo.usage.total_tokens == 150
    first = re.match(r'\[\{"role":"user","content":"turn (\d+) ', echo.output_text)
    assert first is not None and int(first.group(1)) > 0, "the oldest turns should have been dropped from the prompt"
    # The store still has the whole chain: truncation only shapes the prompt.
    assert small_context.responses.retrieve(previous).previous_response_id is not None
    with pytest.raises(openai.BadRequestError) as err:
        small_context.responses.create(model="small", input="again", previous_response_id=previous, max_output_tokens=20)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "input"


# -- encrypted reasoning (stateless clients) -----------------------------------------


def test_encrypted_reasoning_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=THINK_MODEL, input="think [sim:think=4] [sim:tokens=2]", store=False,
                                    include=["reasoning.encrypted_content"])
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert reasoning.content[0].text not in reasoning.encrypted_content  # sealed, not encoded
    replay = [item.model_dump(exclude_none=True) for item in first.output]
    second = client.responses.create(model=THINK_MODEL, store=False, include=["reasoning.encrypted_content"],
                                     input=[{"role": "user", "content": "think [sim:think=4] [sim:tokens=2]"}, *replay,
                                            {"role": "user", "content": "and? [sim:echo]"}])
    assistant = next(m for m in json.loads(second.output_text) if m["role"] == "assistant")
    assert assistant["reasoning_content"] == reasoning.content[0].text  # the model got its own reasoning back
    # A client that drops the plain text still gets it back from the blob.
    blob_only = [{"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}]
    third = client.responses.create(model=THINK_MODEL, store=False,
                                    input=[*blob_only, replay[1], {"role": "user", "content": "[sim:echo]"}])
    assert json.loads(third.output_text)[0]["reasoning_content"] == reasoning.content[0].text
    tampered = reasoning.encrypted_content[:-6] + ("AAAAAA" if not reasoning.encrypted_content.endswith("AAAAAA") else "BBBBBB")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=THINK_MODEL, store=False, input=[
            {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": tampered},
            {"role": "user", "content": "x"}])
    assert err.value.body["code"] == "invalid_encrypted_content" and err.value.body["param"] == "input[0].encrypted_content"


def test_retrieve_with_include_seals_the_stored_reasoning(client: openai.OpenAI) -> None:
    """include on a retrieve, as on a create: the encrypted_content the create would have given."""
    stored = client.responses.create(model=THINK_MODEL, input="think [sim:think=4] [sim:tokens=2]")
    assert stored.output[0].type == "reasoning" and not stored.output[0].encrypted_content
    plain = client.responses.retrieve(stored.id)
    assert not plain.output[0].encrypted_content
    sealed = client.responses.retrieve(stored.id, include=["reasoning.encrypted_content"]).output[0]
    assert sealed.encrypted_content and sealed.content[0].text not in sealed.encrypted_content
    back = client.responses.create(model=THINK_MODEL, store=False, input=[
        {"type": "reasoning", "id": sealed.id, "summary": [], "encrypted_content": sealed.encrypted_content},
        stored.output[1].model_dump(exclude_none=True), {"role": "user", "content": "[sim:echo]"}])
    assert json.loads(back.output_text)[0]["reasoning_content"] == sealed.content[0].text  # it opens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.retrieve(stored.id, include=["everything"])  # type: ignore[list-item]
    assert err.value.body["code"] == "invalid_value" and err.value.body["param"] == "include[0]"


def test_openai_scheduling_hints_are_taken_and_left_alone(client: openai.OpenAI) -> None:
    """prompt_cache_options and background_options tune OpenAI's own cache and batch windows: taken (the
    SDK sends them as typed), with nothing to do here; the response is as without them."""
    response = client.responses.create(model=MODEL, input="hi", prompt_cache_options={"mode": "explicit"},
                                       background_options={"completion_window": "2h"})
    assert response.status == "completed" and response.output_text
