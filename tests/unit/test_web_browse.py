"""Browsing for chat models: web_search__open_page and web_search__find_in_page beside web_search.

On plain data (offering, the calls' items, history rendering, the browser state) and against the
fake search server (opening and finding on the real backend, its guard included).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from backends.sim.script import schema_instance
from router.dialects.chat import ChatOptions, build_request, to_messages
from router.dialects.deltas import Finish, ToolCallDelta
from router.dialects.harmony import _router_call as harmony_router_call
from router.protocol.errors import InvalidRequest
from router.protocol.requests import CreateResponse
from router.protocol.shapes import response_object
from router.protocol.tools import FIND_IN_PAGE, OPEN_PAGE, build_toolset
from router.tools.allowlist import UrlAllowlist
from router.tools.netguard import NetGuard
from router.tools.registry import Browsing, RouterTools
from router.tools.web_search import HttpJsonSearch
from router.turns.assembler import Assembler
from router.turns.tool_items import RouterCallItem
from tests.support.fake_search import FakeSearch

WEB = [{"type": "web_search"}]
SEARCHABLE = frozenset({"web_search"})


# -- offering ------------------------------------------------------------------------------


def test_a_served_web_search_is_three_functions_for_chat_models() -> None:
    tools = build_toolset(WEB, "auto", SEARCHABLE)
    assert [(t.engine_name, t.kind, t.name) for t in tools.offered] == [
        ("web_search", "web_search", "web_search"),
        (OPEN_PAGE, "web_search", "open_page"),
        (FIND_IN_PAGE, "web_search", "find"),
    ]
    assert OPEN_PAGE == "web_search__open_page" and FIND_IN_PAGE == "web_search__find_in_page"
    # gpt-oss calls the same three by its browser's names.
    assert tools.lookup("browser.search").engine_name == "web_search"
    assert tools.lookup("browser.open") is tools.lookup(OPEN_PAGE)
    assert tools.lookup("browser.find") is tools.lookup(FIND_IN_PAGE)
    body = build_request(CreateResponse(model="m", input="x", tools=WEB), [], tools, ChatOptions(), model="m", stream=False)
    functions = {t["function"]["name"]: t["function"] for t in body["tools"]}
    assert list(functions) == ["web_search", OPEN_PAGE, FIND_IN_PAGE]
    assert set(functions[OPEN_PAGE]["parameters"]["properties"]) == {"url", "result"}
    assert functions[FIND_IN_PAGE]["parameters"]["required"] == ["pattern"]
    assert all(f["description"] for f in functions.values())


def test_without_a_backend_none_is_offered() -> None:
    tools = build_toolset(WEB, "auto", frozenset())
    assert tools.offered == []
    assert tools.lookup(OPEN_PAGE) is None and tools.lookup(FIND_IN_PAGE) is None and tools.lookup("browser.open") is None


def test_the_names_leave_client_function_names_free() -> None:
    fn = {"type": "function", "name": "open_page", "parameters": {"type": "object", "properties": {}}}
    find = {**fn, "name": "find_in_page"}
    tools = build_toolset([fn, find, *WEB], "auto", SEARCHABLE)
    assert tools.lookup("open_page").kind == "function" and tools.lookup("find_in_page").kind == "function"
    assert tools.lookup(OPEN_PAGE).kind == "web_search"
    # The namespaced name itself is taken, like a client namespace's: two tools may not share it.
    with pytest.raises(InvalidRequest) as err:
        build_toolset([{**fn, "name": OPEN_PAGE}, *WEB], "auto", SEARCHABLE)
    assert err.value.param == "tools"


def test_allowed_tools_naming_web_search_keeps_its_browsing() -> None:
    fn = {"type": "function", "name": "f"}
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search_preview"}]}
    tools = build_toolset([fn, *WEB], choice, SEARCHABLE)
    assert [t.engine_name for t in tools.offered] == ["web_search", OPEN_PAGE, FIND_IN_PAGE]


def test_what_the_simulated_worker_sends() -> None:
    """The sim fills every property with a fixed valid value: open_page gets result 1 (and a url that is no URL)."""
    tools = build_toolset(WEB, "auto", SEARCHABLE)
    opened = schema_instance(tools.lookup(OPEN_PAGE).parameters)
    assert opened["result"] == 1 and not opened["url"].startswith("http")
    found = schema_instance(tools.lookup(FIND_IN_PAGE).parameters)
    assert found["pattern"] == "small" and not found["url"].startswith("http")


# -- items -----------------------------------------------------------------------------------


def _call(name: str, arguments: dict[str, Any]) -> tuple[Assembler, RouterCallItem, list[dict[str, Any]]]:
    req = CreateResponse(model="m", input="hi", tools=WEB)
    asm = Assembler(response_object(req, response_id="resp_t", created_at=1), tools=build_toolset(WEB, "auto", SEARCHABLE))
    events = asm.start()
    events += asm.feed([ToolCallDelta(0, "call_1", name, orjson.dumps(arguments).decode()), Finish("tool_calls")])
    events += asm.close_turn()
    (call,) = asm.last_turn_calls
    assert isinstance(call, RouterCallItem) and call.pending
    return asm, call, events


def test_open_page_by_number_gets_its_url_when_it_ran() -> None:
    _asm, call, events = _call(OPEN_PAGE, {"url": "and", "result": 1})
    assert call.item["type"] == "web_search_call" and call.item["action"] == {"type": "open_page", "url": None}
    call.finish(events, output="https://a.example/1", sources=[{"type": "url", "url": "https://a.example/1"}])
    assert call.item["status"] == "completed"
    assert call.item["action"] == {"type": "open_page", "url": "https://a.example/1"}  # no sources on an open
    kinds = [e["type"] for e in events]
    assert kinds.index("response.web_search_call.in_progress") < kinds.index("response.web_search_call.searching") \
        < kinds.index("response.web_search_call.completed") < kinds.index("response.output_item.done")


def test_find_with_a_url_names_it_at_once() -> None:
    _, call, events = _call(FIND_IN_PAGE, {"pattern": "cod", "url": "https://a.example/1"})
    assert call.item["action"] == {"type": "find_in_page", "pattern": "cod", "url": "https://a.example/1"}
    _, later, events = _call(FIND_IN_PAGE, {"pattern": "cod"})
    assert later.item["action"]["url"] == ""  # not known yet; the SDK types it as a string
    later.finish(events, output="https://a.example/2")
    assert later.item["action"] == {"type": "find_in_page", "pattern": "cod", "url": "https://a.example/2"}


def test_a_failed_open_is_a_failed_item() -> None:
    _, call, events = _call(OPEN_PAGE, {"result": 9})
    call.finish(events, error={"message": "no page to open"})
    assert call.item["status"] == "failed" and call.item["action"] == {"type": "open_page", "url": None}


# -- history ---------------------------------------------------------------------------------

SEARCH = {"id": "ws_1", "type": "web_search_call", "status": "completed",
          "action": {"type": "search", "query": "fish", "sources": [{"type": "url", "url": "https://a.example/1"},
                                                                    {"type": "url", "url": "https://a.example/2"}]}}
OPEN = {"id": "ws_2", "type": "web_search_call", "status": "completed",
        "action": {"type": "open_page", "url": "https://a.example/2"}}
FIND = {"id": "ws_3", "type": "web_search_call", "status": "completed",
        "action": {"type": "find", "pattern": "cod", "url": "https://a.example/2"}}
USER = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "fish?"}]}


def test_history_gives_each_call_back_as_the_function_it_called() -> None:
    items = [USER, SEARCH, {**OPEN, "_output": "https://a.example/2\n\npage two"}, FIND]
    messages = to_messages(items, None, ChatOptions())
    calls = [(m["tool_calls"][0]["function"]["name"], orjson.loads(m["tool_calls"][0]["function"]["arguments"]))
             for m in messages if m.get("tool_calls")]
    assert calls == [("web_search", {"query": "fish"}), (OPEN_PAGE, {"url": "https://a.example/2"}),
                     (FIND_IN_PAGE, {"pattern": "cod", "url": "https://a.example/2"})]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results == ["https://a.example/1\nhttps://a.example/2", "https://a.example/2\n\npage two",
                       "https://a.example/2\n\n(find results not kept)"]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["ws_1", "ws_2", "ws_3"]
    # every call names a function the model is offered, with arguments its schema takes
    offered = {t.engine_name: t.parameters for t in build_toolset(WEB, "auto", SEARCHABLE).offered}
    for name, arguments in calls:
        assert set(arguments) <= set(offered[name]["properties"]) and set(offered[name].get("required", ())) <= set(arguments)


def test_a_find_in_page_action_from_a_newer_client_reads_as_a_find() -> None:
    """Newer OpenAI SDKs name the find action ``find_in_page``; a history sent back with it still works."""
    newer = {**FIND, "action": {**FIND["action"], "type": "find_in_page"}}
    messages = to_messages([USER, newer], None, ChatOptions())
    assert messages[1]["tool_calls"][0]["function"]["name"] == FIND_IN_PAGE
    assert Browsing.from_items([SEARCH, newer]).last_page == "https://a.example/2"


def test_a_failed_open_goes_back_without_a_url() -> None:
    failed = {"id": "ws_9", "type": "web_search_call", "status": "failed", "action": {"type": "open_page", "url": None}}
    messages = to_messages([USER, failed], None, ChatOptions())
    assert messages[1]["tool_calls"][0]["function"] == {"name": OPEN_PAGE, "arguments": "{}"}
    assert messages[2]["content"] == "(no page opened)"


def test_harmony_history_still_uses_the_browser() -> None:
    recipients = [harmony_router_call(item)[0].recipient for item in (SEARCH, OPEN, FIND)]
    assert recipients == ["browser.search", "browser.open", "browser.find"]


def test_browsing_is_rebuilt_from_the_items() -> None:
    assert Browsing.from_items([USER]) == Browsing()
    browser = Browsing.from_items([USER, SEARCH, OPEN])
    assert browser.links == ["https://a.example/1", "https://a.example/2"] and browser.last_page == "https://a.example/2"
    # A find names the page it read; the newest search wins, even one that found nothing; failures do not count.
    newer = {**SEARCH, "id": "ws_4", "action": {"type": "search", "query": "none", "sources": []}}
    failed = {"id": "ws_5", "type": "web_search_call", "status": "failed", "action": {"type": "open_page", "url": "https://x/"}}
    moved = {**FIND, "action": {**FIND["action"], "url": "https://a.example/1"}}
    browser = Browsing.from_items([SEARCH, OPEN, moved, newer, failed])
    assert browser.links == [] and browser.last_page == "https://a.example/1"


# -- running, on the real backend and the fake search server ---------------------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeSearch]:
    with FakeSearch() as server:
        yield server


def _tools(fake: FakeSearch) -> RouterTools:
    guard = NetGuard.permitting(["127.0.0.0/8"])  # the fake's pages are on 127.0.0.1
    search = HttpJsonSearch(fake.search_url, timeout_s=5, guard=guard)
    return RouterTools(allowlist=UrlAllowlist([]), search=search, max_results=3, guard=guard)


def test_search_open_by_number_then_find(fake: FakeSearch) -> None:
    async def main() -> list[Any]:
        tools = _tools(fake)
        items: list[dict[str, Any]] = []
        searched = await tools.run("web_search", "web_search", {"query": "fish"}, browser=Browsing.from_items(items))
        items.append({"type": "web_search_call", "status": "completed",
                      "action": {"type": "search", "query": "fish", "sources": searched.sources}})
        browser = Browsing.from_items(items)
        opened = await tools.run("web_search", "open_page", {"url": "and", "result": 2}, browser=browser)
        found = await tools.run("web_search", "find", {"pattern": "PAGE"}, browser=browser)
        first = await tools.run("web_search", "open_page", {"result": 1}, browser=Browsing.from_items(items))
        harmony = await tools.run("web_search", "open_page", {"id": 0}, browser=Browsing.from_items(items))
        small = await tools.run("web_search", "find", {"pattern": "small", "url": fake.base + "/page/1"}, browser=browser)
        missing = await tools.run("web_search", "find", {"pattern": "whale"}, browser=browser)
        return [searched, opened, found, first, harmony, small, missing]

    searched, opened, found, first, harmony, small, missing = asyncio.run(main())
    assert searched.prompt_text.startswith("[1] Page one\n" + fake.base + "/page/1")
    page2 = fake.base + "/page/2"
    assert opened.output == page2 and opened.error is None and opened.prompt_text == f"{page2}\n\nplain text page two"
    assert opened.sources == [{"type": "url", "url": page2, "title": "Page two"}]  # the result's title, for citations
    assert found.output == page2 and found.prompt_text == f"{page2}\n\nplain text page two"  # the page opened last
    assert first.output == harmony.output == fake.base + "/page/1"  # [1] is gpt-oss's link 0
    assert first.sources == [{"type": "url", "url": fake.base + "/page/1", "title": "Page one"}]
    assert small.output == fake.base + "/page/1" and small.prompt_text.endswith("\n\nSmall plates on Fridays.")
    # a find naming a page reads it, so it is the page a later find reads
    assert missing.error is None and missing.prompt_text == f"'whale' not found in {fake.base}/page/1"


def test_only_pages_the_results_named_can_be_opened(fake: FakeSearch) -> None:
    async def main() -> list[Any]:
        tools = _tools(fake)
        nothing = await tools.run("web_search", "open_page", {"result": 1}, browser=Browsing())
        await tools.run("web_search", "web_search", {"query": "fish"}, browser=Browsing())
        browser = Browsing(links=[fake.base + "/page/1"])
        beyond = await tools.run("web_search", "open_page", {"result": 2}, browser=browser)
        secret = await tools.run("web_search", "open_page", {"url": fake.base + "/secret"}, browser=browser)
        found = await tools.run("web_search", "find", {"pattern": "secret", "url": fake.base + "/secret"}, browser=browser)
        nowhere = await tools.run("web_search", "find", {"pattern": "x"}, browser=Browsing())
        no_url = await tools.run("web_search", "open_page", {"url": "page one"}, browser=browser)
        return [nothing, beyond, secret, found, nowhere, no_url]

    nothing, beyond, secret, found, nowhere, no_url = asyncio.run(main())
    for outcome in (nothing, beyond, nowhere, no_url):  # a url that is no URL does not open the first result
        assert outcome.error == {"message": "no page to open"} and outcome.prompt_text.startswith("error: no such page")
    for outcome in (secret, found):
        assert outcome.error is not None and outcome.output == fake.base + "/secret"
        assert "not a search result" in outcome.prompt_text and outcome.sources is None
    assert fake.hits["/secret"] == 0
