"""Harmony pools' constraints as plain data: text.format and forced tool choices -> the structural
tag both engines take (router/dialects/harmony_constrain.py), the request bodies that carry it
(router/dialects/harmony_turn.py), and the sim's reading and holding of it
(backends/sim/harmony_script.py), read back by the router's own parser."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai_harmony import HarmonyEncoding

from backends.sim.harmony_script import Answer, constrained_text, read_constraint
from backends.sim.script import SimError
from router.dialects.deltas import Finish, ReasoningDelta, TextDelta, ToolCallDelta
from router.dialects.harmony import HarmonyParser, render_prompt
from router.dialects.harmony_constrain import FINAL_BEGIN, structural_tag
from router.dialects.harmony_turn import HarmonyTurn
from router.protocol.errors import InvalidRequest
from router.protocol.requests import CreateResponse
from router.protocol.tools import ToolSet, build_toolset

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "description": "The time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "degrees": {"type": "integer", "minimum": 3}},
          "required": ["city", "degrees"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
RUNNABLE = frozenset({"web_search", "code_interpreter"})
USER = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]


def tag(fmt: dict | None, tools: list[dict], choice: Any = "auto", runnable: frozenset[str] = frozenset()) -> dict | None:
    toolset = build_toolset(tools, choice, runnable)
    text = structural_tag(fmt, toolset.choice, toolset.offered)
    return None if text is None else json.loads(text)


def content(parsed: dict) -> list[dict]:
    """The constrained part's tags (after the optional analysis / commentary messages)."""
    last = parsed["format"]["elements"][-1]
    return last["elements"] if last["type"] == "or" else [last]


def optional_begins(parsed: dict) -> list[str]:
    return [el["content"]["elements"][0]["begin"] for el in parsed["format"]["elements"] if el["type"] == "optional"]


def test_nothing_to_hold_is_no_constraint() -> None:
    assert tag(None, []) is None
    assert tag({"type": "text"}, [WEATHER]) is None
    assert tag(None, [WEATHER], "auto") is None
    assert tag(None, [WEATHER], "none") is None


def test_json_schema_holds_only_the_final_message_after_free_analysis() -> None:
    parsed = tag(JSON_SCHEMA, [])
    assert parsed is not None and parsed["type"] == "structural_tag"
    assert optional_begins(parsed) == ["<|channel|>analysis<|message|>"]  # the analysis stays free
    (final,) = content(parsed)
    assert final == {"type": "tag", "begin": FINAL_BEGIN, "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": ""}
    assert content(tag({"type": "json_object"}, []))[0]["content"]["json_schema"] == {"type": "object"}  # type: ignore[arg-type]


def test_json_schema_with_tools_under_auto_still_lets_the_model_call_them() -> None:
    parsed = tag(JSON_SCHEMA, [WEATHER])
    assert parsed is not None
    begins = [t["begin"] for t in content(parsed)]
    assert begins[0] == FINAL_BEGIN
    assert "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" in begins
    assert all(t["content"]["json_schema"] == WEATHER["parameters"] for t in content(parsed)[1:])
    assert content(tag(JSON_SCHEMA, [WEATHER], "none")) == content(tag(JSON_SCHEMA, []))  # type: ignore[arg-type]


@pytest.mark.parametrize(("choice", "names"), [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "name": "get_time"}, {"get_time"}),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}, {"get_weather"}),
])
def test_a_forced_choice_allows_calls_only(choice: Any, names: set[str]) -> None:
    for fmt in (None, JSON_SCHEMA):  # the format holds the final message, which a forced turn never writes
        parsed = tag(fmt, [WEATHER, TIME], choice)
        assert parsed is not None
        tags = content(parsed)
        assert not any(t["begin"].startswith("<|channel|>final<|message|>") for t in tags)
        called = {t["begin"].split("to=functions.")[1].split(" ")[0].split("<|")[0] for t in tags}
        assert called == names
        schemas = {"get_weather": WEATHER["parameters"], "get_time": TIME["parameters"]}
        assert all(t["content"]["json_schema"] == schemas[t["begin"].split("functions.")[1].split(" ")[0].split("<|")[0]]
                   for t in tags)
        assert optional_begins(parsed) == ["<|channel|>analysis<|message|>", "<|channel|>commentary<|message|>"]


def test_a_named_hosted_tool_forces_gpt_oss_own_recipient() -> None:
    parsed = tag(None, [WEATHER, {"type": "web_search"}, {"type": "code_interpreter"}], {"type": "web_search"}, RUNNABLE)
    assert parsed is not None
    begins = {t["begin"] for t in content(parsed)}
    assert "<|channel|>analysis to=browser.search" in begins and " to=browser.search" in begins
    assert all("browser.search" in b for b in begins)
    parsed = tag(None, [WEATHER, {"type": "code_interpreter"}], {"type": "code_interpreter"}, RUNNABLE)
    assert parsed is not None and all(t["begin"].endswith("to=python") for t in content(parsed))
    required = tag(None, [WEATHER, {"type": "web_search"}], "required", RUNNABLE)
    assert required is not None
    recipients = {t["begin"].split("to=")[1].split(" ")[0].split("<|")[0] for t in content(required)}
    assert recipients == {"functions.get_weather", "browser.search", "browser.open", "browser.find"}


# -- the request bodies -------------------------------------------------------------------


def turn(enc: HarmonyEncoding, engine: str, *, completions: bool = False, **req: Any) -> tuple[HarmonyTurn, ToolSet]:
    request = CreateResponse(model="m", input="hi", **req)
    tools = build_toolset(req.get("tools") or [], req.get("tool_choice") or "auto")
    return HarmonyTurn(request, tools, enc, engine=engine, context_length=None, request_id="resp_1", model="m",
                       use_completions=completions), tools


def test_each_wire_carries_the_same_tag(enc: HarmonyEncoding) -> None:
    items = USER
    expected = structural_tag(JSON_SCHEMA, build_toolset([], "auto").choice, [])
    vllm = turn(enc, "vllm", text={"format": JSON_SCHEMA})[0].request(items, stream=True)
    assert vllm["sampling_params"]["structured_outputs"] == {"structural_tag": expected} and vllm["reasoning_ended"] is True
    sglang = turn(enc, "sglang", text={"format": JSON_SCHEMA})[0].request(items, stream=False)
    assert sglang["sampling_params"]["structural_tag"] == expected and "reasoning_ended" not in sglang
    completions = turn(enc, "vllm", completions=True, text={"format": JSON_SCHEMA})[0].request(items, stream=False)
    assert completions["structured_outputs"] == {"structural_tag": expected}
    plain = turn(enc, "vllm")[0].request(items, stream=False)
    assert "structured_outputs" not in plain["sampling_params"] and "reasoning_ended" not in plain


def test_the_schema_is_described_to_the_model(enc: HarmonyEncoding) -> None:
    items = USER
    ids = turn(enc, "vllm", text={"format": JSON_SCHEMA})[0].prompt_ids(items)
    text = enc.decode(ids)
    assert "# Response Formats\n\n## weather\n\n" + json.dumps(SCHEMA, separators=(",", ":")) in text
    assert ids[-2:] == enc.encode("<|start|>assistant", allowed_special="all")
    assert "# Response Formats" not in enc.decode(render_prompt(items, encoding=enc, instructions=None, tools=None,
                                                                 reasoning_effort=None))


def test_a_schema_json_cannot_carry_is_a_400(enc: HarmonyEncoding) -> None:
    bad = {**JSON_SCHEMA, "schema": {"type": "number", "maximum": float("inf")}}
    with pytest.raises(InvalidRequest) as err:
        turn(enc, "vllm", text={"format": bad})[0].request(USER, stream=False)
    assert err.value.param == "text.format.schema"


def test_a_forced_turn_that_ends_in_a_message_is_refused(enc: HarmonyEncoding) -> None:
    """An engine that did not hold the constraint: never a completed plain message."""
    answer = enc.encode("<|channel|>final<|message|>hello<|return|>", allowed_special="all")
    frame = {"choices": [{"index": 0, "token_ids": answer, "finish_reason": "stop"}]}
    forced, _ = turn(enc, "vllm", tools=[WEATHER], tool_choice="required")
    forced.request(USER, stream=False)
    with pytest.raises(ValueError, match="tool_choice requires a tool call"):
        forced.completion(frame)
    free, _ = turn(enc, "vllm", tools=[WEATHER], tool_choice="auto")
    free.request(USER, stream=False)
    assert Finish("stop") in free.completion(frame)
    call = enc.encode("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",
                      allowed_special="all")
    forced, _ = turn(enc, "vllm", tools=[WEATHER], tool_choice="required")
    forced.request(USER, stream=False)
    assert Finish("tool_calls") in forced.completion({"choices": [{"index": 0, "token_ids": call, "finish_reason": "stop"}]})


# -- the sim holds it, and the router reads what it made ---------------------------------------


def parse(enc: HarmonyEncoding, text: str) -> list[Any]:
    parser = HarmonyParser(enc)
    return parser.feed(enc.encode(text, allowed_special="all")) + parser.finish()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_sim_answers_within_the_tag(enc: HarmonyEncoding, engine: str) -> None:
    def held(text_tag: str) -> dict:
        sp = {"structural_tag": text_tag} if engine == "sglang" else {"structured_outputs": {"structural_tag": text_tag}}
        fmt = read_constraint(engine, sp)
        assert fmt is not None
        return fmt

    scripted = Answer(reason="let me think", final="plain words", calls=["get_weather"], functions={"get_weather": {}})
    final = Answer(reason="let me think", final="plain words")
    json_tag = structural_tag(JSON_SCHEMA, build_toolset([], "auto").choice, []) or ""
    deltas = parse(enc, constrained_text(held(json_tag), final))
    assert deltas[0] == ReasoningDelta("let me think")
    text = "".join(d.text for d in deltas if type(d) is TextDelta)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert deltas[-1] == Finish("stop")
    toolset = build_toolset([WEATHER, TIME], {"type": "function", "name": "get_time"})
    deltas = parse(enc, constrained_text(held(structural_tag(None, toolset.choice, toolset.offered) or ""), scripted))
    calls = [d for d in deltas if type(d) is ToolCallDelta]
    assert calls[0].name == "get_time" and deltas[-1] == Finish("tool_calls")  # not the function the script meant
    jsonschema.validate(json.loads("".join(d.arguments for d in calls)), TIME["parameters"])
    toolset = build_toolset([WEATHER, TIME], "required")
    deltas = parse(enc, constrained_text(held(structural_tag(None, toolset.choice, toolset.offered) or ""), final))
    assert [d.name for d in deltas if type(d) is ToolCallDelta and d.name] == ["get_weather"]  # the first, as the chat sim


@pytest.mark.parametrize(("engine", "sp", "message"), [
    ("vllm", {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"$ref": "#"}}})}}, "Invalid grammar specification: 'triggers'"),
    ("vllm", {"structured_outputs": {"structural_tag": "{"}}, "Invalid grammar specification: Expecting property name"),
    ("vllm", {"structured_outputs": {"json": {"$ref": "#"}}}, "Failed to transform json schema into a grammar"),
    ("vllm", {"structured_outputs": {"json": {}, "json_object": True}}, "exactly one kind"),
    ("sglang", {"json_schema": json.dumps({"$ref": "#"})}, "Invalid grammar request: req.grammar_key=('json_schema'"),
    ("sglang", {"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "nope"}})},
     "Invalid grammar request: req.grammar_key=('structural_tag'"),
    ("sglang", {"json_schema": "{}", "regex": "a"}, "Only one of"),
])
def test_the_sim_refuses_a_bad_constraint_as_the_engine_does(engine: str, sp: dict, message: str) -> None:
    with pytest.raises(SimError) as err:
        read_constraint(engine, sp)
    assert err.value.args[0] == 400 and message in err.value.args[1]


def test_no_constraint_reads_as_none() -> None:
    assert read_constraint("vllm", {"max_tokens": 3}) is None
    assert read_constraint("sglang", {"max_new_tokens": 3}) is None


@pytest.mark.parametrize(("engine", "sp"), [
    ("sglang", {"json_schema": json.dumps(SCHEMA)}),
    ("vllm", {"structured_outputs": {"json": SCHEMA}}),
    ("vllm", {"structured_outputs": {"json": json.dumps(SCHEMA)}}),
])
def test_a_plain_json_constraint_holds_the_whole_output(engine: str, sp: dict) -> None:
    """Without a structural tag the engine holds every token: the sim answers the JSON alone."""
    fmt = read_constraint(engine, sp)
    assert fmt is not None
    text = constrained_text(fmt, Answer(reason="not allowed here", final="nor this"))
    assert text.endswith("<|return|>")
    jsonschema.validate(json.loads(text.removesuffix("<|return|>")), SCHEMA)
    assert "object" == json.loads(json.dumps(read_constraint("vllm", {"structured_outputs": {"json_object": True}})))[
        "json_schema"]["type"]


def test_a_forced_stream_that_ends_in_a_message_is_refused(enc: HarmonyEncoding) -> None:
    """The stream's way (``decode``, frame by frame, the plain-text fast path included)."""
    forced, _ = turn(enc, "vllm", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    forced.request(USER, stream=True)
    ids = enc.encode("<|channel|>final<|message|>hello there<|return|>", allowed_special="all")

    def frame(token: int) -> bytes:
        return json.dumps({"request_id": "r", "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                                           "token_ids": [token]}], "usage": None}).encode()
    for token in ids[:-1]:
        forced.decode(frame(token))
    with pytest.raises(ValueError, match="tool_choice requires a tool call"):
        forced.decode(frame(ids[-1]))
