"""The sim's scripted semantics over real HTTP, on both engines' shapes: tool calls (single,
parallel, tool_choice, round trips), reasoning fields and think tags, structured output,
logprobs, cached tokens, refusals, echo and usage extras."""

from __future__ import annotations

import json
import re

import openai
import pytest

from backends.sim import VOCAB, count_prompt_tokens
from backends.sim.script import (
    FRAGMENT_CHARS,
    REFUSAL_TEXT,
    SimError,
    Step,
    chop,
    cut_steps,
    read_options,
    schema_instance,
    token_logprob,
)
from tests.support.sim_proc import MODEL, Sim, sglang, user, vllm  # noqa: F401 - vllm, sglang: fixtures


def conforms(value: object, schema: dict, root: dict | None = None) -> bool:
    """A tiny JSON-schema check (jsonschema is not a dependency): the keywords
    the schemas below use."""
    root = schema if root is None else root
    if "$ref" in schema:
        target = root
        for part in filter(None, schema["$ref"].lstrip("#").split("/")):
            target = target[part]
        return conforms(value, target, root)
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema and not any(conforms(value, s, root) for s in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(conforms(value, s, root) for s in schema["oneOf"]) != 1:
        return False
    kinds = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool,
             "integer": int, "number": (int, float)}
    types = schema.get("type", [])
    types = types if isinstance(types, list) else [types]
    if types and not any(isinstance(value, kinds[t]) and not (
            isinstance(value, bool) and t in ("integer", "number")) for t in types):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if not set(schema.get("required", [])) <= set(value):
            return False
        if schema.get("additionalProperties") is False and not set(value) <= set(props):
            return False
        return all(conforms(v, props[k], root) for k, v in value.items() if k in props)
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(conforms(v, schema.get("items", {}), root) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (schema.get("minimum", value) <= value <= schema.get("maximum", value)
                and value > schema.get("exclusiveMinimum", value - 1)
                and value < schema.get("exclusiveMaximum", value + 1))
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    return True


WEATHER_PARAMS = {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {
        "city": {"type": "string", "description": "where"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 3, "maximum": 5},
        "precise": {"type": "boolean"},
        "ratio": {"type": "number", "exclusiveMinimum": 2},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "at": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                                   "near": {"$ref": "#/$defs/place"}}},
    },
    "$defs": {"place": {"type": "object", "properties": {"name": {"type": "string",
                                                                    "minLength": 12}}}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": WEATHER_PARAMS, "strict": True}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, LOOKUP, PING]


class Engine:
    """One engine's sim with its model name, for tests that run on both."""

    def __init__(self, name: str, sim: Sim, model: str):
        self.name, self.sim, self.model = name, sim, model

    def chat(self, body: dict) -> tuple[int, dict]:
        return self.sim.chat({"model": self.model, **body})

    def ok(self, body: dict) -> dict:
        status, out = self.chat(body)
        assert status == 200, out
        return out

    def stream(self, body: dict) -> list[dict]:
        """The raw chunks of a streamed answer, [DONE] checked and dropped."""
        status, ctype, raw = self.sim.request("POST", "/v1/chat/completions", {
            "model": self.model, "stream": True, **body})
        frames = raw.decode().split("\n\n")
        assert status == 200 and ctype.startswith("text/event-stream"), raw
        assert frames[-2:] == ["data: [DONE]", ""]
        return [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]

    def client(self) -> openai.OpenAI:
        return self.sim.client()


@pytest.fixture(params=["vllm", "sglang"])
def engine(request) -> Engine:
    sim = request.getfixturevalue(request.param)
    return Engine(request.param, sim, MODEL if request.param == "vllm" else "sg-model")


def deltas(chunks: list[dict]) -> list[dict]:
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def call_id_ok(engine: str, call_id: str) -> bool:
    """vLLM: chatcmpl-tool-<32 hex>; SGLang: call_<24 hex>."""
    pattern = r"call_[0-9a-f]{24}" if engine == "sglang" else r"chatcmpl-tool-[0-9a-f]{32}"
    return re.fullmatch(pattern, call_id) is not None


def test_schema_instance_validates():
    schemas = [WEATHER_PARAMS, {}, {"type": "object"},
               {"type": "array", "items": {"type": "integer", "minimum": 7}, "maxItems": 1},
               {"type": ["null", "number"], "maximum": -3},
               {"oneOf": [{"const": "x"}, {"type": "integer"}]},
               {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 12},
               {"type": "string", "maxLength": 2},
               {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["kids"]}]
    for schema in schemas:
        value = schema_instance(schema)
        assert conforms(value, schema), (schema, value)
        assert schema_instance(schema) == value  # deterministic
    weather = schema_instance(WEATHER_PARAMS)
    assert set(weather) == set(WEATHER_PARAMS["properties"])  # optional ones filled too
    assert weather["unit"] == "celsius" and weather["days"] == 3 and weather["precise"] is True
    assert weather["ratio"] > 2 and len(weather["tags"]) == 2 and weather["at"] == \
        "2024-01-01T00:00:00Z" and len(weather["where"]["near"]["name"]) == 12
    assert schema_instance(None) == {} and schema_instance({"type": "integer", "minimum": 11,
                                                            "maximum": 20}) == 11


def test_pure_scripting_pieces():
    steps = [Step("reasoning", "a"), Step("call", call=0), Step("args", "{}", 0),
             Step("call", call=1), Step("args", "{", 1), Step("args", "}", 1)]
    assert cut_steps(steps, 9) == (steps, False)
    assert cut_steps(steps, 2) == (steps[:3], True)  # call 1's header goes with its arguments
    assert cut_steps(steps, 0) == ([], True)
    entry = token_logprob(" cache", 3, 4)
    assert entry["token"] == " cache" and entry["bytes"] == list(b" cache")
    assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
    assert [t["logprob"] for t in entry["top_logprobs"]] == [
        round(entry["logprob"] - 0.5 * j, 2) for j in range(4)]
    assert len({t["token"] for t in entry["top_logprobs"]}) == 4 and entry["logprob"] < 0
    assert token_logprob(" cache", 3, 0)["top_logprobs"] == [] and token_logprob(
        " cache", 3, 4) == entry
    opts = read_options({"tools": TOOLS, "tool_choice": {"type": "function",
                                                         "function": {"name": "lookup"}}})
    assert list(opts.tools) == ["get_weather", "lookup", "ping"] and opts.named == "lookup"
    for bad in ({"tool_choice": "sometimes"}, {"tool_choice": "required"},
                {"tools": [{"type": "function"}]}, {"top_logprobs": 21, "logprobs": True},
                {"top_logprobs": 2}, {"response_format": {"type": "json_schema"}},
                {"chat_template_kwargs": "x"}):
        with pytest.raises(SimError) as exc:
            read_options(bad)
        assert exc.value.args[0] == 400


def test_tool_call_non_stream(engine):
    messages = user("weather please [sim:call=get_weather]")
    body = engine.ok({"messages": messages, "tools": TOOLS})
    (choice,) = body["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call_id_ok(engine.name, call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    args = call["function"]["arguments"]
    assert conforms(json.loads(args), WEATHER_PARAMS)
    assert body["usage"]["completion_tokens"] == len(chop(args, FRAGMENT_CHARS)) > 2
    if engine.name == "sglang":
        assert call["index"] == 0 and choice["matched_stop"] is None
    else:
        assert set(call) == {"id", "type", "function"}
    sdk = engine.client().chat.completions.create(model=engine.model, messages=messages,
                                                  tools=TOOLS)
    assert sdk.choices[0].message.tool_calls[0].function.arguments == args  # deterministic
    assert sdk.choices[0].message.tool_calls[0].id != call["id"]  # ids are fresh
    # max_tokens cuts the arguments, like an engine would
    cut = engine.ok({"messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == args[:16]


def test_tool_call_stream_shape(engine):
    messages = user("weather please [sim:call=get_weather]")
    args = engine.ok({"messages": messages, "tools": TOOLS})["choices"][0]["message"][
        "tool_calls"][0]["function"]["arguments"]
    chunks = engine.stream({"messages": messages, "tools": TOOLS,
                            "stream_options": {"include_usage": True}})
    role, header, *fragments, finish, usage = chunks
    assert deltas([role]) == [{"role": "assistant", "content": ""}]
    (tc,) = header["choices"][0]["delta"]["tool_calls"]
    assert call_id_ok(engine.name, tc["id"])
    pieces = chop(args, FRAGMENT_CHARS)
    if engine.name == "vllm":  # DeltaToolCall dumped with exclude_unset
        assert header["choices"][0]["delta"] == {"tool_calls": [{
            "id": tc["id"], "type": "function", "index": 0,
            "function": {"name": "get_weather", "arguments": ""}}]}
        assert deltas(fragments) == [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]}
                                     for p in pieces]
        assert finish["choices"][0]["stop_reason"] is None
    else:  # pydantic ToolCall dumped whole: nulls on fragments
        assert header["choices"][0]["delta"] == {
            "role": None, "content": None, "reasoning_content": None, "tool_calls": [{
                "id": tc["id"], "index": 0, "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}]}
        assert deltas(fragments) == [{"role": None, "content": None, "reasoning_content": None,
                                      "tool_calls": [{"id": None, "index": 0, "type": "function",
                                                      "function": {"name": None, "arguments": p}}]}
                                     for p in pieces]
        assert finish["choices"][0]["matched_stop"] is None and header["usage"] is None
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(pieces)
    assert all(c["choices"][0]["finish_reason"] is None for c in [role, header, *fragments])

    # The SDK accumulates the same call.
    got = {"id": None, "name": None, "arguments": ""}
    for chunk in engine.client().chat.completions.create(
            model=engine.model, messages=messages, tools=TOOLS, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            got["id"] = got["id"] or d.id
            got["name"] = got["name"] or d.function.name
            got["arguments"] += d.function.arguments or ""
    assert got["name"] == "get_weather" and got["arguments"] == args
    assert call_id_ok(engine.name, got["id"])


def test_parallel_tool_calls(engine):
    for marker, names in (("get_weather,lookup", ["get_weather", "lookup"]),
                          ("ping,ping", ["ping", "ping"])):
        messages = user(f"two at once [sim:call={marker}]")
        calls = engine.ok({"messages": messages, "tools": TOOLS})["choices"][0]["message"][
            "tool_calls"]
        assert [c["function"]["name"] for c in calls] == names
        assert len({c["id"] for c in calls}) == 2 and all(call_id_ok(engine.name, c["id"])
                                                          for c in calls)
        chunks = engine.stream({"messages": messages, "tools": TOOLS})
        order = [(tc["index"], tc["function"].get("name") is not None)
                 for d in deltas(chunks) for tc in d.get("tool_calls") or []]
        first = next(i for i, (idx, _) in enumerate(order) if idx == 1)
        assert order[0] == (0, True) and order[first] == (1, True)
        assert all(idx == 0 for idx, _ in order[:first]) and all(idx == 1 for idx, _ in
                                                                 order[first:])
        streamed = ["".join(tc["function"]["arguments"] for d in deltas(chunks)
                            for tc in d.get("tool_calls") or [] if tc["index"] == i)
                    for i in (0, 1)]
        assert streamed == [c["function"]["arguments"] for c in calls]
    assert calls[0]["function"]["arguments"] == "{}"  # no parameters schema
    one = engine.ok({"messages": user("[sim:call=get_weather,lookup]"), "tools": TOOLS,
                     "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in one["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"]


def test_tool_choice(engine):
    required = engine.ok({"messages": user("anything"), "tools": TOOLS,
                          "tool_choice": "required"})["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["content"] == ""
    assert required["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    named_choice = {"type": "function", "function": {"name": "lookup"}}
    named = engine.ok({"messages": user("anything [sim:call=ping]"), "tools": TOOLS,
                       "tool_choice": named_choice})["choices"][0]
    (call,) = named["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) \
        == {"q": schema_instance(LOOKUP["function"]["parameters"])["q"]}
    # vLLM finishes a named tool_choice with "stop"; SGLang says "tool_calls"
    assert named["finish_reason"] == ("stop" if engine.name == "vllm" else "tool_calls")
    chunks = engine.stream({"messages": user("x"), "tools": TOOLS, "tool_choice": named_choice})
    assert chunks[-1]["choices"][0]["finish_reason"] == named["finish_reason"]
    none = engine.ok({"messages": user("[sim:call=ping] [sim:tokens=3]"), "tools": TOOLS,
                      "tool_choice": "none"})["choices"][0]
    assert none["finish_reason"] == "stop" and len(none["message"]["content"].split()) == 3
    assert not none["message"].get("tool_calls")


def test_tool_errors(engine):
    cases = [({"messages": user("[sim:call=nope]"), "tools": TOOLS}, "tools"),
             ({"messages": user("[sim:call=get_weather,nope]"), "tools": TOOLS}, "tools"),
             ({"messages": user("[sim:call=ping]")}, "tools"),
             ({"messages": user("x"), "tools": TOOLS,
               "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"messages": user("x"), "tool_choice": "required"}, "tool_choice")]
    for body, param in cases:
        status, out = engine.chat(body)
        err = out if engine.name == "sglang" else out["error"]
        assert status == 400 and err["param"] == param and err["code"] == 400, out
        assert err["type"] == "BadRequestError"
        assert (out["object"] == "error") if engine.name == "sglang" else set(out) == {"error"}
    with pytest.raises(openai.BadRequestError) as exc:
        engine.client().chat.completions.create(model=engine.model, tools=TOOLS,
                                                messages=user("[sim:call=nope]"))
    assert "nope" in str(exc.value)


def test_tool_round_trip(engine):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "system", "content": "be brief"},
               *user("weather? [sim:call=get_weather] [sim:reason=2]"),
               {"role": "assistant", "content": None, "tool_calls": [call]}]
    for result in ("sunny, 21 C", [{"type": "text", "text": "sunny, "},
                                   {"type": "text", "text": "21 C"}]):
        messages = [*history, {"role": "tool", "tool_call_id": "call_1", "content": result}]
        body = engine.ok({"messages": messages, "tools": TOOLS})
        (choice,) = body["choices"]
        assert choice["message"]["content"] == "tool said: sunny, 21 C"
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
        reasoning = "reasoning" if engine.name == "vllm" else "reasoning_content"
        assert len(choice["message"][reasoning].split()) == 2  # other markers still apply
        assert body["usage"]["completion_tokens"] == 2 + 5
        assert body["usage"]["prompt_tokens"] == count_prompt_tokens(messages) == 3 + 5 + 6 + 6 + 6
        chunks = engine.stream({"messages": messages, "tools": TOOLS})
        assert "".join(d.get("content") or "" for d in deltas(chunks)) == "tool said: sunny, 21 C"
    assert count_prompt_tokens(history[2:3]) == 3 + 3 + 3  # name + 2 argument words


def test_reasoning_field(engine):
    messages = user("think first [sim:reason=3] [sim:tokens=4]")
    body = engine.ok({"messages": messages})
    msg, usage = body["choices"][0]["message"], body["usage"]
    field = "reasoning" if engine.name == "vllm" else "reasoning_content"
    other = "reasoning_content" if engine.name == "vllm" else "reasoning"
    assert len(msg[field].split()) == 3 and other not in msg
    assert set(msg[field].split()) <= set(VOCAB) and msg[field] != msg["content"][:len(msg[field])]
    assert len(msg["content"].split()) == 4 and usage["completion_tokens"] == 7
    if engine.name == "vllm":
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    else:
        assert usage["reasoning_tokens"] == 3
    chunks = engine.stream({"messages": messages, "stream_options": {"include_usage": True}})
    got = deltas(chunks)[1:-1]
    assert [list(d) for d in got] == [[field]] * 3 + [["content"]] * 4
    assert "".join(d[field] for d in got[:3]) == msg[field]
    assert "".join(d["content"] for d in got[3:]) == msg["content"]
    final = chunks[-1]["usage"]
    if engine.name == "vllm":
        assert final == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": 7,
                         "total_tokens": usage["prompt_tokens"] + 7,
                         "completion_tokens_details": {"reasoning_tokens": 3}}
    else:
        assert final["reasoning_tokens"] == 3 and final["completion_tokens"] == 7
    cut = engine.ok({"messages": messages, "max_tokens": 2})
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == ""
    assert cut["choices"][0]["message"][field] == " ".join(msg[field].split()[:2])


def test_reasoning_field_option():
    sim = Sim("--reasoning-field", "reasoning_content")
    try:
        msg = sim.chat({"messages": user("[sim:reason=2] [sim:tokens=1]")})[1]["choices"][0][
            "message"]
        assert len(msg["reasoning_content"].split()) == 2 and "reasoning" not in msg
        _status, _, raw = sim.request("POST", "/v1/chat/completions", {
            "messages": user("[sim:reason=2] [sim:tokens=1]"), "stream": True})
        assert raw.decode().count('"reasoning_content":') == 2 and '"reasoning":' not in \
            raw.decode()
    finally:
        assert sim.stop() == 0


def test_think_tags(engine):
    messages = user("no parser [sim:think=2] [sim:tokens=3]")
    body = engine.ok({"messages": messages})
    msg, usage = body["choices"][0]["message"], body["usage"]
    match = re.fullmatch(r"<think>(\w+ \w+)</think>(\w+ \w+ \w+)", msg["content"])
    assert match is not None, msg["content"]
    assert msg["reasoning" if engine.name == "vllm" else "reasoning_content"] is None
    assert usage["completion_tokens"] == 2 + 2 + 3
    if engine.name == "vllm":
        assert usage["completion_tokens_details"] is None
    else:
        assert usage["reasoning_tokens"] == 0
    pieces = [d["content"] for d in deltas(engine.stream({"messages": messages}))[1:-1]]
    assert pieces[0] == "<think>" and pieces[3] == "</think>" and len(pieces) == 7
    assert "".join(pieces) == msg["content"]


def test_structured_output(engine):
    schema = {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]}},
        "rating": {"anyOf": [{"type": "number", "maximum": 0.5}, {"type": "null"}]}},
        "required": ["title", "year"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "movie", "schema": schema,
                                                  "strict": True}}
    body = engine.ok({"messages": user("a movie [sim:tokens=2]"), "response_format": fmt})
    content = body["choices"][0]["message"]["content"]
    assert conforms(json.loads(content), schema) and " " not in content  # compact
    assert json.loads(content) == {"title": json.loads(content)["title"], "year": 1900,
                                   "genres": ["drama"], "rating": 0.5}
    assert body["usage"]["completion_tokens"] == len(chop(content, FRAGMENT_CHARS))
    pieces = [d["content"] for d in deltas(engine.stream({
        "messages": user("a movie [sim:tokens=2]"), "response_format": fmt}))[1:-1]]
    assert len(pieces) == len(chop(content, FRAGMENT_CHARS)) > 3 and "".join(pieces) == content
    obj = engine.ok({"messages": user("json please"), "response_format": {"type": "json_object"}})
    parsed = json.loads(obj["choices"][0]["message"]["content"])
    assert list(parsed) == ["answer"] and parsed["answer"] in VOCAB
    text = engine.ok({"messages": user("[sim:tokens=2]"), "response_format": {"type": "text"}})
    assert len(text["choices"][0]["message"]["content"].split()) == 2


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"type": "object", "required": ["next"],
                                                   "properties": {"next": {"$ref": "#"}}}])
def test_a_schema_with_no_finite_instance_is_a_400(engine, schema):
    """As vLLM answers a schema its grammar backend cannot compile, streamed or not; the sim goes
    on serving (it used to recurse until Python gave up and answer 500 to every such request)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}
    for stream in (False, True):
        status, _, payload = engine.sim.request("POST", "/v1/chat/completions", {
            "model": engine.model, "messages": user("loop"), "response_format": fmt, "stream": stream})
        body = json.loads(payload)
        err = body["error"] if engine.name == "vllm" else body
        assert status == 400 and err["code"] == 400 and err["type"] == "BadRequestError", body
        assert err["message"].startswith("Failed to transform json schema into a grammar")
    assert engine.ok({"messages": user("still here [sim:tokens=2]")})["choices"][0]["message"]["content"]


def test_logprobs(engine):
    messages = user("with logprobs [sim:tokens=4]")
    body = engine.ok({"messages": messages, "logprobs": True, "top_logprobs": 3})
    content = body["choices"][0]["message"]["content"]
    entries = body["choices"][0]["logprobs"]["content"]
    tokens = [content.split(" ")[0], *(" " + w for w in content.split(" ")[1:])]
    assert [e["token"] for e in entries] == tokens
    for e in entries:
        assert e["logprob"] < 0 and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        assert all(t["logprob"] <= e["logprob"] for t in e["top_logprobs"])
    assert engine.ok({"messages": messages, "logprobs": True, "top_logprobs": 3}) \
        ["choices"][0]["logprobs"] == body["choices"][0]["logprobs"]
    chunks = engine.stream({"messages": messages, "logprobs": True, "top_logprobs": 3})
    streamed = [c["choices"][0]["logprobs"] for c in chunks[1:-1]]
    assert [s["content"] for s in streamed] == [[e] for e in entries]
    assert chunks[0]["choices"][0]["logprobs"] is None
    assert engine.ok({"messages": messages})["choices"][0]["logprobs"] is None
    zero = engine.ok({"messages": messages, "logprobs": True})["choices"][0]["logprobs"]
    assert [e["top_logprobs"] for e in zero["content"]] == [[]] * 4
    sdk = engine.client().chat.completions.create(model=engine.model, messages=messages,
                                                  logprobs=True, top_logprobs=2)
    assert [t.token for t in sdk.choices[0].logprobs.content] == tokens
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        status, _ = engine.chat({"messages": messages, **bad})
        assert status == 400


def test_cached_tokens(engine):
    messages = user("cache me [sim:cached=5]")
    prompt = count_prompt_tokens(messages)
    usage = engine.ok({"messages": messages})["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 5} and prompt > 5
    capped = engine.ok({"messages": user("cache me [sim:cached=999]")})["usage"]
    assert capped["prompt_tokens_details"] == {"cached_tokens": prompt}
    final = engine.stream({"messages": messages, "stream_options": {"include_usage": True}})[-1]
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


def test_refusal(engine):
    messages = user("something bad [sim:refuse]")
    msg = engine.ok({"messages": messages})["choices"][0]["message"]
    assert msg["refusal"] == REFUSAL_TEXT and msg["content"] is None
    sdk = engine.client().chat.completions.create(model=engine.model, messages=messages)
    assert sdk.choices[0].message.refusal == REFUSAL_TEXT
    assert sdk.choices[0].finish_reason == "stop"
    got = deltas(engine.stream({"messages": messages}))[1:-1]
    assert all(list(d) == ["refusal"] for d in got) and len(got) == 5
    assert "".join(d["refusal"] for d in got) == REFUSAL_TEXT


def test_echo_request(engine):
    body = {"messages": user("what did you get [sim:echo=request]"), "tools": [WEATHER],
            "tool_choice": "auto", "max_tokens": 500, "chat_template_kwargs": {
                "enable_thinking": False}, "reasoning_effort": "low", "parallel_tool_calls": False,
            "response_format": {"type": "json_object"}, "temperature": 0.5}
    content = engine.ok(body)["choices"][0]["message"]["content"]
    assert json.loads(content) == {k: v for k, v in body.items() if k != "messages"} | {
        "model": engine.model}
    chunks = engine.stream({**body, "stream_options": {"include_usage": True,
                                                        "continuous_usage_stats": True}})
    echoed = json.loads("".join(d.get("content") or "" for d in deltas(chunks)))
    assert echoed["stream"] is True and echoed["stream_options"]["continuous_usage_stats"] is True
    assert echoed["tools"] == [WEATHER] and echoed["max_tokens"] == 500


def test_continuous_usage_and_extras(engine):
    chunks = engine.stream({"messages": user("[sim:tokens=3] [sim:reason=1]"),
                            "chat_template_kwargs": {"enable_thinking": True},
                            "reasoning_effort": "high", "parallel_tool_calls": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [0, 1, 2, 3, 4, 4, 4]  # role, 4 tokens, finish, the usage chunk
    assert chunks[-1]["choices"] == []
    plain = engine.stream({"messages": user("[sim:tokens=2]"),
                           "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)  # only together with include_usage
    status, _out = engine.chat({"messages": user("x"), "chat_template_kwargs": ["no"]})
    assert status == 400
