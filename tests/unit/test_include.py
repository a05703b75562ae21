"""``include`` on plain data: what a create, its events, a retrieve and an input-items listing show.

OpenAI returns a code_interpreter_call's ``outputs``, a web search's ``action.sources`` and an
input message's image URLs only when ``include`` names them; the stored response keeps all of it
(a later retrieve that asks sees it, the next turn's prompt gives the model its tools' results).
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.dialects.deltas import Finish, TextDelta, ToolCallDelta
from router.protocol.errors import InvalidRequest
from router.protocol.requests import KNOWN_INCLUDES, CreateResponse, check_include, check_supported
from router.protocol.shapes import input_item_view, item_view, response_object, response_view
from router.protocol.tools import build_toolset
from router.turns.assembler import Assembler
from router.turns.tool_items import RouterCallItem

LOGS = [{"type": "logs", "logs": "2\n"}]
CODE = {"id": "ci_1", "type": "code_interpreter_call", "status": "completed", "code": "print(1 + 1)",
        "container_id": "cntr_1", "outputs": LOGS}
SOURCES = [{"type": "url", "url": "https://a.example/1"}]
SEARCH = {"id": "ws_1", "type": "web_search_call", "status": "completed",
          "action": {"type": "search", "query": "fish", "sources": SOURCES}}
OPEN = {"id": "ws_2", "type": "web_search_call", "status": "completed", "action": {"type": "open_page", "url": "https://a.example/1"}}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]}
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}
LOOK = {"id": "msg_2", "type": "message", "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": "look"}, IMAGE]}

SHOWN = st.sets(st.sampled_from(sorted(KNOWN_INCLUDES)))


def test_tool_results_are_shown_only_when_included() -> None:
    assert item_view(CODE, ())["outputs"] is None
    assert item_view(CODE, {"code_interpreter_call.outputs"})["outputs"] == LOGS
    assert item_view(SEARCH, ())["action"] == {"type": "search", "query": "fish"}
    for value in ("web_search_call.action.sources", "web_search_call.results"):  # results: the sources it returned
        assert item_view(SEARCH, {value})["action"]["sources"] == SOURCES
    assert CODE["outputs"] == LOGS and SEARCH["action"]["sources"] == SOURCES  # the items keep all of it


@given(SHOWN)
def test_views_never_change_their_item_and_hide_only_what_include_leaves_out(include: set[str]) -> None:
    body = {"id": "resp_1", "object": "response", "output": [CODE, SEARCH, OPEN, MESSAGE]}
    before = copy.deepcopy(body)
    shown = response_view(body, include)
    assert body == before
    assert shown["output"][2:] == body["output"][2:]  # nothing to hide in an open_page or a message
    outputs = "code_interpreter_call.outputs" in include
    sources = bool(include & {"web_search_call.action.sources", "web_search_call.results"})
    assert (shown["output"][0]["outputs"] is not None) == outputs
    assert ("sources" in shown["output"][1]["action"]) == sources
    assert (shown is body) == (outputs and sources)  # nothing left out: no copy made


def test_input_image_urls_are_listed_only_when_included() -> None:
    assert input_item_view(LOOK, ())["content"] == [LOOK["content"][0], {**IMAGE, "image_url": None}]
    assert input_item_view(LOOK, {"message.input_image.image_url"}) is LOOK
    assert input_item_view(MESSAGE, ()) is MESSAGE
    assert LOOK["content"][1]["image_url"].startswith("data:")


def test_a_listing_error_stored_as_an_object_is_shown_as_a_string() -> None:
    """The SDK types ``mcp_list_tools.error`` as a string; earlier versions stored an object there."""
    old = {"id": "mcpl_1", "type": "mcp_list_tools", "server_label": "calc", "tools": [],
           "error": {"type": "http_error", "code": 502, "message": "could not list tools: refused"}}
    before = copy.deepcopy(old)
    assert item_view(old, ())["error"] == "could not list tools: refused" and old == before
    assert response_view({"output": [old, MESSAGE]}, ())["output"] == [{**old, "error": "could not list tools: refused"}, MESSAGE]
    assert item_view({**old, "error": {"type": "http_error"}}, ())["error"] == "{'type': 'http_error'}"
    for error in ("could not list tools: refused", None):
        item = {**old, "error": error}
        assert item_view(item, ()) is item


def test_include_values_are_checked() -> None:
    assert check_include(None) == frozenset()
    assert check_include(["web_search_call.results", "message.input_image.image_url"], "include") == {
        "web_search_call.results", "message.input_image.image_url"}
    with pytest.raises(InvalidRequest) as err:
        check_include(["code_interpreter_call.outputs", "nope"])
    assert err.value.param == "include[1]" and err.value.code == "invalid_value"
    # No item they name can come from this router (no file search, no computer use): a 400, not a no-op.
    for value, tool in (("file_search_call.results", "file_search"), ("computer_call_output.output.image_url", "computer use")):
        with pytest.raises(InvalidRequest) as err:
            check_supported(CreateResponse(model="m", include=["reasoning.encrypted_content", value]))
        assert err.value.param == "include[1]" and err.value.code == "unsupported_parameter" and tool in err.value.message


def run_code_call(include: list[str]) -> tuple[Assembler, list[dict[str, Any]]]:
    """A chat model's call to the code interpreter, run, then its answer: every event of it."""
    tools_ = [{"type": "code_interpreter", "container": "auto"}, {"type": "web_search"}]
    req = CreateResponse(model="m", input="hi", tools=tools_, include=include)
    asm = Assembler(response_object(req, response_id="resp_t", created_at=1),
                    tools=build_toolset(tools_, "auto", frozenset({"code_interpreter", "web_search"})), include=include)
    events = asm.start()
    events += asm.feed([ToolCallDelta(0, "call_1", "python", orjson.dumps({"code": "print(1 + 1)"}).decode()),
                        ToolCallDelta(1, "call_2", "web_search", orjson.dumps({"query": "fish"}).decode()), Finish("tool_calls")])
    events += asm.close_turn()
    code, search = asm.last_turn_calls
    assert isinstance(code, RouterCallItem) and isinstance(search, RouterCallItem)
    code.finish(events, outputs=LOGS)
    search.finish(events, sources=SOURCES)
    events += asm.feed([TextDelta("2"), Finish("stop")])
    events += asm.finish()
    return asm, events


@pytest.mark.parametrize("include", [[], ["code_interpreter_call.outputs", "web_search_call.action.sources"]])
def test_events_show_what_include_names_and_the_response_keeps_all(include: list[str]) -> None:
    asm, events = run_code_call(include)
    code, search = asm.response["output"][:2]
    assert code["outputs"] == LOGS and search["action"]["sources"] == SOURCES  # what is stored
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]
    assert final["type"] == "response.completed"
    for shown_code, shown_search in ((done[0], done[1]), tuple(final["response"]["output"][:2])):
        assert shown_code["outputs"] == (LOGS if include else None)
        assert ("sources" in shown_search["action"]) == bool(include)
    assert final["response"]["output"] == response_view(asm.response, include)["output"]
