"""The sim calls a declared function that a plain prompt mentions (backends/sim/tools.py), under
tool_choice "auto": the word matching itself, then over real HTTP on both engines' chat shapes and
on the harmony generate APIs. Markers still win; a text marker, tool_choice "none" and a tool's
answer never call."""

from __future__ import annotations

import json

import pytest
from openai_harmony import Role

from tests.e2e.test_sim_harmony import enc, generate, parse, prompt, vocab_dir, wire  # noqa: F401 - enc, vocab_dir: fixtures
from tests.e2e.test_sim_harmony import sglang as harmony_sglang  # noqa: F401 - a fixture
from tests.e2e.test_sim_harmony import sglang_inc as harmony_sglang_inc  # noqa: F401 - a fixture
from tests.e2e.test_sim_harmony import vllm as harmony_vllm  # noqa: F401 - a fixture
from tests.e2e.test_sim_scripting import TOOLS, conforms, deltas, engine  # noqa: F401 - engine: a fixture
from tests.support.sim_proc import sglang, user, vllm  # noqa: F401 - vllm, sglang: fixtures

CITY_TIME = {"type": "function", "function": {
    "name": "getCityTime", "description": "The local clock of a place",
    "parameters": {"type": "object", "required": ["place", "format"], "additionalProperties": False, "properties": {
        "place": {"type": "string", "minLength": 2}, "format": {"type": "string", "enum": ["24h", "12h"]},
        "offset": {"type": "integer", "minimum": -12, "maximum": 14}}}}}
NEWS = {"type": "function", "function": {"name": "search_news_articles", "description": "Search recent headlines."}}


def test_words_of_names_descriptions_and_messages():
    from backends.sim.tools import mentioned_function, words

    assert words("get_weather") == {"weather"} and words("getCityTime") == {"city", "time"}
    assert words("HTTPServer-status.v2") == {"http", "server", "status"}
    assert words("What's the WEATHER in Paris, please?") == {"weather", "paris"}
    assert words("cities boxes headlines status is it a") == {"city", "box", "headline", "status"}  # plurals fold; short words go
    functions = {"get_weather": "Weather.", "getCityTime": "The local clock of a place", "ping": None}
    assert mentioned_function("weather in Oslo?", functions) == "get_weather"
    assert mentioned_function("what time is it in the city?", functions) == "getCityTime"  # two words beat one
    assert mentioned_function("PING the server", functions) == "ping"
    assert mentioned_function("Which clocks are right?", functions) == "getCityTime"  # from the description
    assert mentioned_function("hello there, how are you?", functions) is None
    assert mentioned_function("get it for me, use the tool", functions) is None  # stop words and tool verbs
    assert mentioned_function("[sim:tokens=3] go", {"token_count": None}) is None  # markers are not words
    assert mentioned_function("weather and time", {"a_weather": None, "b_weather": None}) == "a_weather"  # ties: first


def test_a_mention_calls_the_function_under_auto(engine):  # noqa: F811
    tools = [*TOOLS, CITY_TIME, NEWS]
    for text, name in [("What's the weather like in Paris?", "get_weather"),
                       ("what TIME is it in that city", "getCityTime"),
                       ("any news today?", "search_news_articles"), ("Headlines please", "search_news_articles"),
                       ("can you ping it", "ping"), ("Look up Oslo", "lookup")]:
        choice = engine.ok({"messages": user(text), "tools": tools})["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (text, choice)
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == name, text
        params = next(t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name)
        assert conforms(json.loads(call["function"]["arguments"]), params)
    args = json.loads(engine.ok({"messages": user("the clock in Oslo"), "tools": [CITY_TIME]})["choices"][0][
        "message"]["tool_calls"][0]["function"]["arguments"])
    assert args["format"] in ("24h", "12h") and -12 <= args["offset"] <= 14 and len(args["place"]) >= 2
    # streamed the same way
    chunks = engine.stream({"messages": user("weather in Rome?"), "tools": tools})
    names = [tc["function"]["name"] for d in deltas(chunks) for tc in d.get("tool_calls") or ()
             if tc["function"].get("name")]
    assert names == ["get_weather"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_mention_gives_way(engine):  # noqa: F811
    """Markers win; tool_choice none and a tool's answer never call; nothing mentioned, plain text."""
    marker = engine.ok({"messages": user("weather please [sim:call=ping]"), "tools": TOOLS})["choices"][0]
    assert [c["function"]["name"] for c in marker["message"]["tool_calls"]] == ["ping"]
    none = engine.ok({"messages": user("weather please"), "tools": TOOLS, "tool_choice": "none"})["choices"][0]
    assert none["finish_reason"] == "stop" and not none["message"].get("tool_calls")
    plain = engine.ok({"messages": user("Hello there, how are you?"), "tools": TOOLS})["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] and not plain["message"].get("tool_calls")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    answered = engine.ok({"messages": [*user("weather please"), {"role": "assistant", "content": None,
                                                                  "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                          "tools": TOOLS})["choices"][0]
    assert answered["message"]["content"] == "tool said: sunny" and not answered["message"].get("tool_calls")
    # required: the mentioned function rather than the first
    required = engine.ok({"messages": user("ping!"), "tools": TOOLS, "tool_choice": "required"})["choices"][0]
    assert [c["function"]["name"] for c in required["message"]["tool_calls"]] == ["ping"]
    # only the last user message counts
    later = engine.ok({"messages": [*user("weather please"), {"role": "assistant", "content": "sunny"},
                                    *user("thanks, bye")], "tools": TOOLS})["choices"][0]
    assert later["finish_reason"] == "stop" and not later["message"].get("tool_calls")


def test_a_text_marker_asks_for_text(engine):  # noqa: F811
    """[sim:echo], [sim:refuse] and [sim:tokens=N] script the text: a mentioned function is not called."""
    for text in ("weather? [sim:tokens=3]", "weather? [sim:echo]", "weather? [sim:refuse]"):
        choice = engine.ok({"messages": user(text), "tools": TOOLS})["choices"][0]
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls"), text


@pytest.fixture(params=["harmony_vllm", "harmony_sglang", "harmony_sglang_inc"])
def harmony_engine(request) -> tuple[str, object]:
    return request.param.removeprefix("harmony_"), request.getfixturevalue(request.param)


def test_function_descriptions_read_from_the_rendered_tools(enc):  # noqa: F811
    from backends.sim.harmony import function_descriptions

    text = next(m for m in enc.parse_messages_from_completion_tokens(
        prompt(enc, "hi")[:-2], role=None) if m.author.role == Role.DEVELOPER).content[0].text
    assert function_descriptions(text) == {"get_weather": "Weather of a city", "noargs": "Takes nothing"}


def test_a_mentioned_function_is_called(harmony_engine, enc):  # noqa: F811
    """No marker: the function the last user message mentions is called; none mentioned, the final answer."""
    name, sim = harmony_engine
    msgs = parse(enc, generate(sim, wire(name), prompt(enc, "How is the weather in Oslo?"))["ids"])
    assert [(c, r) for c, r, _, _ in msgs] == [("analysis", None), ("commentary", "functions.get_weather")]
    assert json.loads(msgs[1][3]) == {"location": "sim", "unit": "c"}  # the schema's required fields
    assert [m[1] for m in parse(enc, generate(sim, wire(name), prompt(enc, "which CITY is it?"))["ids"])] == [
        None, "functions.get_weather"]  # a word of the description
    plain = parse(enc, generate(sim, wire(name), prompt(enc, "Hello there, how are you?"))["ids"])
    assert [(c, r) for c, r, _, _ in plain] == [("analysis", None), ("final", None)]
    marker = parse(enc, generate(sim, wire(name), prompt(enc, "weather? [sim:call=noargs]"))["ids"])
    assert [m[1] for m in marker] == [None, "functions.noargs"]  # the marker wins
    answered = parse(enc, generate(sim, wire(name), prompt(enc, "weather?", tool_reply="sunny"))["ids"])
    assert answered[-1][::3] == ("final", "tool said: sunny")  # a tool's answer is not called again
