"""Whatever a client sends, the request stage refuses it with an APIError (a 400 naming the field) or
accepts something the rest can serialize: no other exception, which would be a 500.

Pure data: the request model, the checks ``prepare`` runs before anything is called or stored, the
chat body a worker would get, and the JSON the store would write. Every value of three rich
templates (every input item kind, every tool kind, every tool_choice form) is replaced in turn by
values of the wrong shape, as a careless client sends them (a structural fuzz once found 154
kinds of 500 this way); hypothesis then puts random JSON at random places.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.http import parse_model
from router.dialects.chat import ChatOptions, build_request
from router.protocol.errors import APIError
from router.protocol.items import normalize_input
from router.protocol.requests import CreateResponse, check_supported
from router.protocol.shapes import response_object
from router.protocol.tools import build_toolset
from router.turns.history import check_tool_outputs, resolve_input

TEMPLATES: list[dict[str, Any]] = [
    {"model": "m", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]}],
     "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}},
                "strict": False},
               {"type": "custom", "name": "c", "format": {"type": "text"}},
               {"type": "namespace", "name": "ns", "description": "d",
                "tools": [{"type": "function", "name": "g", "parameters": {"type": "object"}}]},
               {"type": "mcp", "server_label": "m", "server_url": "https://mcp.example.com/mcp", "allowed_tools": ["a"],
                "require_approval": {"never": {"tool_names": ["a"]}}, "headers": {"h": "v"}}],
     "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
     "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": False},
              "verbosity": "low"},
     "reasoning": {"effort": "low", "summary": "auto"}, "metadata": {"k": "v"}, "include": ["message.output_text.logprobs"],
     "max_output_tokens": 5, "temperature": 0.5, "top_p": 0.9, "store": True, "stream": False,
     "context_management": [{"type": "compaction", "compact_threshold": 1000}], "truncation": "auto"},
    {"model": "m", "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "r"}]},
        {"type": "custom_tool_call", "call_id": "c2", "name": "c", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "o"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "t"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a", "annotations": []}],
         "phase": "final_answer"},
        {"type": "mcp_call", "server_label": "m", "name": "n", "arguments": "{}", "output": "o"},
        {"type": "item_reference", "id": "fc_1"},
        {"role": "user", "content": "go"}],
     "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "custom", "name": "c"}],
     "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": True},
    {"model": "m", "input": "hi", "instructions": "be brief", "tool_choice": {"type": "mcp", "server_label": "m"},
     "tools": [{"type": "mcp", "server_label": "m", "server_url": "https://mcp.example.com/mcp"}],
     "conversation": {"id": "conv_x"}, "service_tier": "auto", "prompt_cache_key": "k", "user": "u"},
]

ODD: list[Any] = [5, "x", [], {}, None, [5], ["x"], [{}], 10**30, 2**64, -1, True, 1.5]


def accepted_or_refused(body: Any) -> None:
    """The request stage either raises an APIError or yields what can be sent and stored."""
    try:
        req = parse_model(CreateResponse, json.dumps(body).encode())  # json: orjson writes no integer past 64 bits
        check_supported(req)
        tools = build_toolset(req.tools, req.tool_choice)
        items = normalize_input(req.input)
        items = resolve_input([], items, {})
        check_tool_outputs(items)
        response = response_object(req, response_id="resp_x")
        chat = build_request(req, items, tools, ChatOptions(), model="m", stream=False)
    except APIError:
        return
    orjson.dumps(chat)  # what the worker gets
    orjson.dumps(response)  # what the client and the store get
    for item in items:
        orjson.dumps(item)


def paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from paths(child, (*path, key))


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    out = copy.deepcopy(value)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return out


def test_the_templates_are_accepted() -> None:
    for body in TEMPLATES:  # the harness itself must not refuse good requests (it would test nothing)
        req = parse_model(CreateResponse, json.dumps(body).encode())
        check_supported(req)
        build_toolset(req.tools, req.tool_choice)


def test_every_value_of_the_wrong_shape_is_refused_or_served() -> None:
    tried = 0
    for body in TEMPLATES:
        for path in paths(body):
            if path in ((), ("model",)):
                continue
            for odd in ODD:
                accepted_or_refused(replaced(body, path, odd))
                tried += 1
    assert tried > 1500


JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEMPLATES), st.data(), JSON)
def test_random_json_anywhere_is_refused_or_served(body: dict[str, Any], data: st.DataObject, value: Any) -> None:
    choices = [p for p in paths(body) if p not in ((), ("model",))]
    path = data.draw(st.sampled_from(choices))
    accepted_or_refused(replaced(body, path, value))
