"""The chat dialect on plain data: items -> messages and request, chunks -> deltas."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.dialects.chat import ChatOptions, ChatTurn, build_request, to_messages
from router.dialects.deltas import Finish, ReasoningDelta, RefusalDelta, TextDelta, ToolCallDelta, Usage
from router.dialects.think import ThinkSplitter
from router.protocol.errors import InvalidRequest
from router.protocol.items import normalize_input
from router.protocol.requests import CreateResponse
from router.protocol.tools import build_toolset

HISTORY = normalize_input([
    {"role": "developer", "content": "dev rules"},
    {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "https://x/y.png"}]},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
    {"role": "assistant", "content": "let me check", "phase": "commentary"},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
    {"type": "function_call", "call_id": "c2", "name": "find", "namespace": "crm", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "none"}]},
    {"type": "custom_tool_call", "call_id": "c3", "name": "run_sql", "input": "select 1"},
    {"type": "custom_tool_call_output", "call_id": "c3", "output": "1"},
    {"role": "user", "content": "thanks"},
])


def test_history_to_messages() -> None:
    messages = to_messages(HISTORY, "be brief", ChatOptions())
    assert messages == [
        {"role": "system", "content": "be brief\n\ndev rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "auto"}}]},
        {"role": "assistant", "content": "let me check", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "crm__find", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "none"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "run_sql", "arguments": '{"input":"select 1"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c3", "content": "1"},
        {"role": "user", "content": "thanks"},
    ]


def test_reasoning_goes_back_only_where_the_engine_takes_it() -> None:
    with_field = to_messages(HISTORY, None, ChatOptions(reasoning_field="reasoning_content"))
    assert with_field[2]["reasoning_content"] == "hmm"
    assert all("reasoning_content" not in m for m in to_messages(HISTORY, None, ChatOptions()))


def test_keep_system_messages_in_place() -> None:
    messages = to_messages(HISTORY, "inst", ChatOptions(system_messages="keep"))
    assert messages[:2] == [{"role": "system", "content": "inst"}, {"role": "system", "content": "dev rules"}]


def test_files_only_where_accepted() -> None:
    items = normalize_input([{"role": "user", "content": [{"type": "input_file", "file_data": "data:application/pdf;base64,AA", "filename": "a.pdf"}]}])
    with pytest.raises(InvalidRequest):
        to_messages(items, None, ChatOptions())
    (message,) = to_messages(items, None, ChatOptions(accepts_files=True))
    assert message["content"] == [{"type": "file", "file": {"file_data": "data:application/pdf;base64,AA", "filename": "a.pdf"}}]


def test_build_request_maps_every_setting() -> None:
    tools = [{"type": "function", "name": "get_weather", "strict": True, "parameters": {"type": "object"}},
             {"type": "namespace", "name": "crm", "description": "d", "tools": [{"type": "function", "name": "find"}]},
             {"type": "web_search"}]
    req = CreateResponse(
        model="m", input="x", tools=tools, tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "high"}, top_logprobs=3, max_output_tokens=50, temperature=0.3,
    )
    body = build_request(req, [], build_toolset(req.tools, req.tool_choice), ChatOptions(), model="served", stream=True)
    assert body["model"] == "served" and body["stream_options"] == {"include_usage": True}
    assert [t["function"]["name"] for t in body["tools"]] == ["get_weather", "crm__find"]  # web_search is not offered
    assert body["tools"][0]["function"]["strict"] is True and "strict" not in body["tools"][1]["function"]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}
    assert body["reasoning_effort"] == "high"
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["max_tokens"] == 50 and body["temperature"] == 0.3
    thinking = build_request(req, [], build_toolset([], "auto"), ChatOptions(reasoning_effort_as="enable_thinking"), model="m", stream=False)
    assert thinking["chat_template_kwargs"] == {"enable_thinking": True} and "tools" not in thinking


def test_tool_choice_forms() -> None:
    tools = [{"type": "function", "name": "a"}, {"type": "function", "name": "b"}, {"type": "custom", "name": "c"}]
    assert build_toolset(tools, "none").choice.mode == "none"
    allowed = build_toolset(tools, {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]})
    assert [t.name for t in allowed.offered] == ["b"] and allowed.choice.mode == "required"
    assert build_toolset(tools, {"type": "custom", "name": "c"}).choice.forced == "c"
    for bad, param in [({"type": "function", "name": "zz"}, "tool_choice.name"), ("sometimes", "tool_choice"),
                       ({"type": "mcp", "server_label": "x"}, "tool_choice.server_label")]:
        with pytest.raises(InvalidRequest) as err:
            build_toolset(tools, bad)
        assert err.value.param == param
    with pytest.raises(InvalidRequest) as err:
        build_toolset([{"type": "hologram"}], "auto")
    assert err.value.param == "tools[0].type"


DEFAULT_OPTIONS = ChatOptions()


def turn(options: ChatOptions = DEFAULT_OPTIONS) -> ChatTurn:
    return ChatTurn(CreateResponse(model="m", input="x"), build_toolset([], "auto"), options, model="m", path="/v1/chat/completions")


def test_decoder_stream_and_completion_agree() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "th"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 1}}},
    ]
    decoder = turn()
    streamed = [d for c in chunks for d in decoder.chunk(c)]
    call_id = streamed[2].call_id
    assert call_id.startswith("call_")
    assert streamed == [ReasoningDelta("th"), TextDelta("Hi"), ToolCallDelta(0, call_id, "f", ""), ToolCallDelta(0, None, None, "{}"),
                        Finish("tool_calls"), Usage(5, 2, 0, 1)]
    whole = turn().completion({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning_content": "th", "refusal": "no",
                                             "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}, "reasoning_tokens": 1},
    })
    assert [type(d) for d in whole] == [ReasoningDelta, TextDelta, RefusalDelta, ToolCallDelta, Finish, Usage]
    assert whole[-1] == Usage(5, 2, 3, 1)


@given(st.lists(st.sampled_from(["a", "<", "<th", "ink>", "<think>", "</think>", "</", "b c", "think>"]), max_size=12), st.data())
def test_think_splitter_is_chunking_independent(pieces, data) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    splitter = ThinkSplitter()
    out = [d for c in chunks for d in splitter.feed(c)] + splitter.flush()
    whole = ThinkSplitter()
    expected = whole.feed(text) + whole.flush()
    assert _merge(out) == _merge(expected)


def test_think_tags() -> None:
    splitter = ThinkSplitter()
    out = splitter.feed("<thi") + splitter.feed("nk>plan</th") + splitter.feed("ink>Answer") + splitter.flush()
    assert _merge(out) == [("ReasoningDelta", "plan"), ("TextDelta", "Answer")]


def _merge(deltas):  # type: ignore[no-untyped-def]
    out: list[tuple[str, str]] = []
    for d in deltas:
        kind = type(d).__name__
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + d.text)
        else:
            out.append((kind, d.text))
    return out


def test_max_output_tokens_within_the_context_and_the_room() -> None:
    """At most the pool's context goes out (vLLM clamps below it itself); the room an engine names caps it
    further, and uncapping (a shorter prompt) gives the context's bound back."""
    items = normalize_input("hi")

    def chat_turn(max_output_tokens: int | None, context: int | None) -> ChatTurn:
        req = CreateResponse(model="m", input="hi", max_output_tokens=max_output_tokens)
        return ChatTurn(req, build_toolset([], "auto"), DEFAULT_OPTIONS, model="m", path="/p", context_length=context)

    huge = chat_turn(100000, 4096)
    assert huge.request(items, stream=False)["max_tokens"] == 4096
    assert huge.cap_output(4000) is True and huge.request(items, stream=True)["max_tokens"] == 4000
    assert huge.cap_output(4000) is False  # the same room again: nothing new to send
    assert huge.cap_output(None) is True and huge.max_tokens == 4096
    small = chat_turn(50, 4096)
    assert small.request(items, stream=False)["max_tokens"] == 50 and small.cap_output(4000) is False
    assert chat_turn(100000, None).max_tokens == 100000  # context unknown: sent as asked, capped on the engine's word
    unset = chat_turn(None, 4096)
    assert "max_tokens" not in unset.request(items, stream=False) and unset.cap_output(10) is False
