"""The tool loop on the router: real MCP servers (both transports), a search backend, the sandbox."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import RouterProcess, free_port, sim_pool_toml, start_router
from tests.e2e.test_e2e_harmony import harmony_pool
from tests.support import mcp_servers
from tests.support.fake_search import FakeSearch
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    http = mcp_servers.start("streamable-http")
    sse = mcp_servers.start("sse")
    search = FakeSearch().start()
    try:
        yield {"http": http, "sse": sse, "search": search, "dead": f"http://127.0.0.1:{free_port()}/mcp"}
    finally:
        http.stop()
        sse.stop()
        search.stop()


@pytest.fixture(scope="module")
def tools_router(tmp_path_factory: pytest.TempPathFactory, servers: dict[str, Any], harmony_vocab: Path) -> Iterator[RouterProcess]:
    http, sse, search = servers["http"], servers["sse"], servers["search"]
    dead_base = servers["dead"].rsplit("/", 1)[0] + "/"
    # The sandbox runs code as an unprivileged user: its root must be reachable by others.
    containers = Path(tempfile.mkdtemp(prefix="rr-containers-"))
    containers.chmod(0o711)
    body = sim_pool_toml(replicas=1) + harmony_pool("oss", "vllm", harmony_vocab) + f"""
[harmony]
vocab_dir = "{harmony_vocab}"

[[models]]
name = "{MODEL}"
pool = "sim"
[[models]]
name = "oss"
pool = "oss"

[tools]
private_networks = ["127.0.0.0/8"]  # the request-named MCP servers and the search results are on loopback
[tools.mcp]
allow = ["{http.base}/", "{dead_base}"]
timeout_s = 10
[[tools.mcp.servers]]
label = "named"
url = "{sse.url}"
transport = "sse"

[tools.web_search]
url = "{search.search_url}"

[tools.code_interpreter]
root = "{containers}"
timeout_s = 20
"""
    proc = start_router(tmp_path_factory.mktemp("tools"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(tools_router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_router.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def calc(servers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "calc", "server_url": servers["http"].url, "require_approval": "never", **extra}


def types(response: Any) -> list[str]:
    return [item.type for item in response.output]


def test_mcp_list_call_answer(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    kwargs = dict(model=MODEL, input="add please [sim:call=mcp__calc__add]", tools=[calc(servers)])
    response = client.responses.create(**kwargs)
    assert types(response) == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, _ = response.output
    assert {t.name for t in listing.tools} >= {"add", "echo", "slow", "fail"}
    args = json.loads(call.arguments)
    assert call.status == "completed" and call.server_label == "calc" and call.name == "add"
    assert call.output == str(args["a"] + args["b"]) and call.error is None
    assert response.output_text == f"tool said: {call.output}"
    assert response.usage.output_tokens > len(response.output_text.split())  # both turns are counted
    events = [e.model_dump() for e in client.responses.create(stream=True, **kwargs)]
    final = check_stream(events)
    kinds = [e["type"] for e in events]
    for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed", "response.mcp_call.in_progress",
                 "response.mcp_call_arguments.done", "response.mcp_call.completed"):
        assert kind in kinds, kind
    assert [i["type"] for i in final["output"]] == types(response)
    assert final["output"][1]["output"] == call.output and final["usage"] == response.usage.model_dump()


def test_concurrent_calls_listing_reused_and_failures_fed_back(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    first = client.responses.create(model=MODEL, input="both [sim:call=mcp__calc__add,mcp__calc__echo]", tools=[calc(servers)])
    assert types(first) == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    add, echo = first.output[1], first.output[2]
    assert add.status == echo.status == "completed"
    assert first.output_text == f"tool said: {echo.output}"  # results went back in call order
    second = client.responses.create(model=MODEL, input="now fail [sim:call=mcp__calc__fail]", tools=[calc(servers)],
                                     previous_response_id=first.id)
    assert types(second) == ["mcp_call", "message"]  # listed once per conversation
    failed = second.output[0]
    assert failed.status == "failed" and failed.error.type == "mcp_tool_execution_error"
    assert second.status == "completed" and second.output_text.startswith("tool said: error")


def test_a_stream_left_while_a_tool_runs_stores_the_call_incomplete(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    """The client leaves while the router runs an MCP call (``slow``: at least 5 s): the stored response
    is ``cancelled`` and the call it was running ``incomplete``, not ``in_progress`` for ever."""
    stream = client.responses.create(model=MODEL, input="wait [sim:call=mcp__calc__slow]", tools=[calc(servers)], stream=True)
    rid = None
    for event in stream:
        if event.type == "response.created":
            rid = event.response.id
        elif event.type == "response.mcp_call_arguments.done":
            break  # the model's turn is over; the call now runs on the router
    stream.close()
    assert rid is not None
    deadline = time.monotonic() + 15
    stored = None
    while time.monotonic() < deadline:  # the router stores it once it sees the client gone
        try:
            stored = client.responses.retrieve(rid)
        except openai.NotFoundError:
            stored = None
        if stored is not None and stored.status != "in_progress":
            break
        time.sleep(0.05)
    assert stored is not None and stored.status == "cancelled", stored
    assert types(stored) == ["mcp_list_tools", "mcp_call"]
    call = stored.output[1]
    assert call.name == "slow" and call.status == "incomplete" and call.output is None


def test_a_background_replay_shows_a_running_tool_call_and_a_cancel_ends_it(
        client: openai.OpenAI, servers: dict[str, Any]) -> None:
    """The events before a pause (here the 5 s of ``slow``) reach the replay while the call runs, not
    when the next events come; cancelling then stores the call ``incomplete``."""
    queued = client.responses.create(model=MODEL, input="wait [sim:call=mcp__calc__slow]", tools=[calc(servers)],
                                     background=True)
    started = time.monotonic()
    for event in client.responses.retrieve(queued.id, stream=True):
        if event.type == "response.mcp_call_arguments.done":
            break
    assert time.monotonic() - started < 4, "the call's events were held back until it had run"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and types(cancelled) == ["mcp_list_tools", "mcp_call"]
    assert cancelled.output[1].status == "incomplete"
    replayed = [e.type for e in client.responses.retrieve(queued.id, stream=True)]
    assert replayed[-1] == "response.cancelled" and "response.mcp_call.completed" not in replayed


def test_down_server_and_disallowed_url(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    response = client.responses.create(model=MODEL, input="hi", tools=[calc(servers, server_url=servers["dead"])])
    assert response.status == "completed" and types(response) == ["mcp_list_tools", "message"]
    assert response.output[0].error is not None
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", tools=[calc(servers, server_url="http://169.254.169.254/mcp")])
    assert err.value.body["param"] == "tools[0].server_url" and err.value.body["code"] == "mcp_server_not_allowed"
    with pytest.raises(openai.BadRequestError) as err:  # another port of an allowed host is another server
        client.responses.create(model=MODEL, input="hi", tools=[calc(servers, server_url=f"http://127.0.0.1:{free_port()}/mcp")])
    assert err.value.body["param"] == "tools[0].server_url"


def test_approval_round_trip(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    tools = [{"type": "mcp", "server_label": "named"}]  # a configured server, approvals by default
    asked = client.responses.create(model=MODEL, input="add [sim:call=mcp__named__add]", tools=tools)
    assert types(asked) == ["mcp_list_tools", "mcp_approval_request"]
    request = asked.output[1]
    yes = client.responses.create(model=MODEL, tools=tools, previous_response_id=asked.id,
                                  input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    assert types(yes) == ["mcp_call", "message"]
    assert yes.output[0].approval_request_id == request.id and yes.output[0].status == "completed"
    assert yes.output_text == f"tool said: {yes.output[0].output}"
    no = client.responses.create(model=MODEL, tools=tools, previous_response_id=asked.id,
                                 input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": False}])
    assert types(no) == ["message"] and "did not approve" in no.output_text
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, tools=tools, previous_response_id=asked.id,
                                input=[{"type": "mcp_approval_response", "approval_request_id": "mcpr_nope", "approve": True}])
    assert err.value.body["param"] == "input[0].approval_request_id"


def test_web_search(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    response = client.responses.create(model=MODEL, input="look up fish [sim:call=web_search]", tools=[{"type": "web_search"}])
    assert types(response) == ["web_search_call", "message"]
    call = response.output[0]
    assert call.status == "completed" and call.action.type == "search" and call.action.query
    assert response.output_text.startswith("tool said: [1] Page one\nhttp://127.0.0.1:")
    assert servers["search"].hits["/search"] >= 1
    citations = response.output[1].content[0].annotations
    assert citations and citations[0].type == "url_citation" and citations[0].title == "Page one"
    text = response.output_text
    assert text[citations[0].start_index:citations[0].end_index] == citations[0].url
    events = [e.model_dump() for e in client.responses.create(
        model=MODEL, input="look up fish [sim:call=web_search]", tools=[{"type": "web_search"}], stream=True)]
    check_stream(events)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.web_search_call.searching") < kinds.index("response.web_search_call.completed")
    assert kinds.index("response.output_text.annotation.added") < kinds.index("response.output_text.done")


def test_chat_model_searches_opens_and_finds(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    """A chat model gets web_search__open_page and web_search__find_in_page beside web_search.

    The sim fills arguments from the schema: open_page gets ``result: 1`` (the first result of the last
    search: [1] Page one) and a ``url`` that is no URL (ignored), find_in_page the pattern "small" (page
    one has "Small plates on Fridays.") and no URL (so the page opened last). Each step runs streamed and
    not, on the same previous response, and the two must agree.
    """
    base = servers["search"].base
    page = base + "/page/1"
    steps = ["look up fish [sim:call=web_search]", "open the first [sim:call=web_search__open_page]",
             "look for it [sim:call=web_search__find_in_page]"]
    responses = []
    opened_before = servers["search"].hits["/page/1"]
    for text in steps:
        kwargs: dict[str, Any] = dict(model=MODEL, input=text, tools=[{"type": "web_search"}])
        if responses:
            kwargs["previous_response_id"] = responses[-1].id
        plain = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            # warnings=False: the SDK's ParsedResponse (in response.completed) warns about its own output union
            # when dumped, whatever the output holds; the events are checked below.
            events = [e.model_dump(warnings=False) for e in stream]
            final = stream.get_final_response()
        check_stream(events)
        kinds = [e["type"] for e in events]
        assert kinds.index("response.web_search_call.in_progress") < kinds.index("response.web_search_call.searching") \
            < kinds.index("response.web_search_call.completed") < kinds.index("response.output_text.done")
        assert _plain(final.output) == _plain(plain.output) and final.output_text == plain.output_text
        assert types(plain) == ["web_search_call", "message"] and plain.output[0].status == "completed"
        responses.append(plain)
    searched, opened, found = responses
    assert searched.output[0].action.type == "search" and searched.output_text.startswith("tool said: [1] Page one\n" + page)

    action = opened.output[0].action
    assert action.type == "open_page" and action.url == page
    assert opened.output_text.startswith(f"tool said: {page}\n\nFish & chips\n")
    # The page was fetched four times (opened, then searched in; streamed and not), and the answer that
    # quotes its URL cites it, with the result's title, though the search was in an earlier response.
    assert servers["search"].hits["/page/1"] == opened_before + 4
    citations = opened.output[1].content[0].annotations
    assert [(c.type, c.url, c.title) for c in citations] == [("url_citation", page, "Page one")]
    assert opened.output_text[citations[0].start_index:citations[0].end_index] == page

    action = found.output[0].action
    assert action.type == "find_in_page" and action.pattern == "small" and action.url == page
    assert found.output_text == f"tool said: {page}\n\nSmall plates on Fridays."

    # The next turn's prompt gives the model its own three calls back, as the functions it called.
    echo = client.responses.create(model=MODEL, input="[sim:echo]", tools=[{"type": "web_search"}],
                                   previous_response_id=found.id)
    messages = json.loads(echo.output_text)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for m in messages for c in m.get("tool_calls") or ()]
    assert calls == [("web_search", {"query": searched.output[0].action.query}), ("web_search__open_page", {"url": page}),
                     ("web_search__find_in_page", {"pattern": "small", "url": page})]
    request = json.loads(client.responses.create(model=MODEL, input="[sim:echo=request]", tools=[{"type": "web_search"}]).output_text)
    assert [t["function"]["name"] for t in request["tools"]] == ["web_search", "web_search__open_page", "web_search__find_in_page"]


def test_code_interpreter(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="run it [sim:call=python]",
                                       tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
                                       include=["code_interpreter_call.outputs"])
    assert types(response) == ["code_interpreter_call", "message"]
    call = response.output[0]
    assert call.status == "completed" and call.code and call.container_id
    logs = "".join(o.logs for o in call.outputs if o.type == "logs")
    assert "NameError" in logs  # the sim writes a bare word: it really ran, and failed as Python would
    assert response.output_text.startswith("tool said:") and "NameError" in response.output_text


SHOW = ["code_interpreter_call.outputs", "web_search_call.action.sources"]


def shown_calls(output: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The code_interpreter_call and the web_search_call of an output, as dicts."""
    by_type = {item["type"]: item for item in output}
    return by_type["code_interpreter_call"], by_type["web_search_call"]


@pytest.mark.parametrize("model, prompt", [(MODEL, "both [sim:call=python,web_search]"),
                                           ("oss", "both fish [sim:builtin=python,browser.search]")])
def test_include_shows_tool_results_only_when_asked(client: openai.OpenAI, servers: dict[str, Any], model: str,
                                                    prompt: str) -> None:
    """code_interpreter_call.outputs and web_search_call.action.sources come back only when include names
    them (a create, its events, a retrieve), as OpenAI's; the stored response keeps them: a retrieve
    that asks sees them, and the next turn gives the model its tools' results."""
    tools = [{"type": "code_interpreter", "container": "auto"}, {"type": "web_search"}]
    for include in ([], SHOW, ["code_interpreter_call.outputs", "web_search_call.results"]):
        kwargs = dict(model=model, input=prompt, tools=tools, include=include)
        plain = client.responses.create(**kwargs)
        assert plain.status == "completed"
        events = [e.model_dump() for e in client.responses.create(stream=True, **kwargs)]
        final = check_stream(events)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        for output in (plain.model_dump()["output"], final["output"], done):
            code, search = shown_calls(output)
            assert code["code"] and search["action"]["type"] == "search"
            if include:
                assert "NameError" in code["outputs"][0]["logs"] or code["outputs"][0]["logs"].strip() == "2"
                assert search["action"]["sources"] and search["action"]["sources"][0]["url"].startswith(servers["search"].base)
            else:
                assert code["outputs"] is None and search["action"].get("sources") is None
    # Stored whole: the last create (no include) shows its results to a retrieve that asks for them.
    first = client.responses.create(model=model, input=prompt, tools=tools)
    code, search = shown_calls(client.responses.retrieve(first.id).model_dump()["output"])
    assert code["outputs"] is None and search["action"].get("sources") is None
    code, search = shown_calls(client.responses.retrieve(first.id, include=SHOW).model_dump()["output"])
    assert code["outputs"][0]["type"] == "logs" and search["action"]["sources"]
    if model == MODEL:  # the next turn's prompt has both results (the chat sim echoes its messages)
        echo = client.responses.create(model=model, input="[sim:echo]", tools=tools, previous_response_id=first.id)
        results = [m["content"] for m in json.loads(echo.output_text) if m["role"] == "tool"]
        assert "NameError" in results[0] and search["action"]["sources"][0]["url"] in results[1]


def test_include_values_for_tools_not_served_are_a_400(client: openai.OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="hi")
    for value in ("file_search_call.results", "computer_call_output.output.image_url"):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="hi", include=["reasoning.encrypted_content", value])
        assert err.value.body["param"] == "include[1]" and err.value.body["code"] == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.retrieve(made.id, include=[value])
        assert err.value.body["param"] == "include[0]"
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.input_items.list(made.id, include=[value])
        assert err.value.body["param"] == "include[0]"


def test_input_items_list_image_urls_only_when_included(client: openai.OpenAI) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}
    made = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "look"}, image]}])
    (item,) = client.responses.input_items.list(made.id).data
    assert item.content[1].type == "input_image" and item.content[1].image_url is None and item.content[1].detail == "low"
    (item,) = client.responses.input_items.list(made.id, include=["message.input_image.image_url"]).data
    assert item.content[1].image_url == image["image_url"]
    echo = client.responses.create(model=MODEL, input="[sim:echo]", previous_response_id=made.id)
    assert json.loads(echo.output_text)[0]["content"][1]["image_url"]["url"] == image["image_url"]  # stored whole


def test_conversation_items_show_what_include_names(client: openai.OpenAI) -> None:
    """A conversation's items (listed, one by one, as added) show tool results, an input image's URL
    and encrypted reasoning as a response's do: only when ``include`` names them; stored whole."""
    conversation = client.conversations.create()
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}
    look = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"}, image]}
    added = client.conversations.items.create(conversation.id, items=[look]).model_dump()["data"]
    assert added[0]["content"][1]["image_url"] is None
    tools: Any = [{"type": "code_interpreter", "container": "auto"}, {"type": "web_search"}]
    made = client.responses.create(model=MODEL, input="both [sim:call=python,web_search]", tools=tools,
                                   conversation=conversation.id)
    assert made.status == "completed"
    assert client.responses.create(model=MODEL, input="Think first [sim:reason=3] [sim:tokens=2]",
                                   conversation=conversation.id).status == "completed"
    everything = [*SHOW, "message.input_image.image_url", "reasoning.encrypted_content"]

    def listed(**kwargs: Any) -> list[dict[str, Any]]:
        return [i.model_dump() for i in client.conversations.items.list(conversation.id, order="asc", **kwargs).data]

    plain = listed()
    code, search = shown_calls(plain)
    assert code["outputs"] is None and search["action"].get("sources") is None
    assert plain[0]["content"][1]["image_url"] is None
    (reasoning,) = [i for i in plain if i["type"] == "reasoning"]
    assert not reasoning.get("encrypted_content")
    shown = listed(include=everything)
    code, search = shown_calls(shown)
    assert code["outputs"][0]["type"] == "logs" and search["action"]["sources"]
    assert shown[0]["content"][1]["image_url"] == image["image_url"]
    (reasoning,) = [i for i in shown if i["type"] == "reasoning"]
    assert reasoning["encrypted_content"]
    one = client.conversations.items.retrieve(code["id"], conversation_id=conversation.id).model_dump()
    assert one["outputs"] is None
    one = client.conversations.items.retrieve(code["id"], conversation_id=conversation.id, include=SHOW).model_dump()
    assert one["outputs"][0]["type"] == "logs"
    kept = client.conversations.items.create(conversation.id, items=[look], include=["message.input_image.image_url"])
    assert kept.model_dump()["data"][0]["content"][1]["image_url"] == image["image_url"]
    for refused in (["file_search_call.results"], ["no.such.thing"]):
        with pytest.raises(openai.BadRequestError) as err:
            client.conversations.items.list(conversation.id, include=refused)  # type: ignore[arg-type]
        assert err.value.body["param"] == "include[0]"  # type: ignore[index]


def test_caps_and_mixed_calls(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    capped = client.responses.create(model=MODEL, input="two [sim:call=mcp__calc__add,mcp__calc__echo]",
                                     tools=[calc(servers)], max_tool_calls=1)
    assert capped.status == "incomplete" and capped.incomplete_details.reason == "max_tool_calls"
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    mixed = client.responses.create(model=MODEL, input="both [sim:call=get_weather,mcp__calc__add]", tools=[weather, calc(servers)])
    assert types(mixed) == ["mcp_list_tools", "function_call", "mcp_call"]
    assert mixed.output[2].status == "completed"  # the router ran its call, the client gets the function call
    forced = client.responses.create(model=MODEL, input="anything", tools=[calc(servers)],
                                     tool_choice={"type": "mcp", "server_label": "calc", "name": "echo"})
    assert types(forced) == ["mcp_list_tools", "mcp_call", "message"] and forced.output[1].name == "echo"


def test_harmony_builtin_tools_run_on_the_router(client: openai.OpenAI) -> None:
    search = client.responses.create(model="oss", input="find [sim:builtin=browser.search]", tools=[{"type": "web_search"}])
    assert [t for t in types(search) if t != "reasoning"] == ["web_search_call", "message"]
    assert search.output_text.startswith("tool said: [1] Page one")
    opened = client.responses.create(model="oss", input="open it [sim:builtin=browser.open]", tools=[{"type": "web_search"}],
                                     previous_response_id=search.id)
    page = next(i for i in opened.output if i.type == "web_search_call")
    assert page.action.type == "open_page" and page.action.url.endswith("/page/1")
    assert opened.output_text.startswith(f"tool said: {page.action.url}")
    found = client.responses.create(model="oss", input="fish [sim:builtin=browser.find]", tools=[{"type": "web_search"}],
                                    previous_response_id=opened.id)
    hit = next(i for i in found.output if i.type == "web_search_call")
    assert hit.action.type == "find_in_page" and hit.action.pattern == "fish" and "fish" in found.output_text.lower()
    code = client.responses.create(model="oss", input="compute [sim:builtin=python]",
                                   tools=[{"type": "code_interpreter", "container": "auto"}], include=["code_interpreter_call.outputs"])
    call = next(i for i in code.output if i.type == "code_interpreter_call")
    assert call.code == "print(1 + 1)" and "".join(o.logs for o in call.outputs if o.type == "logs").strip() == "2"
    assert code.output_text == "tool said: 2"


def test_stream_and_non_stream_agree_on_a_loop(client: openai.OpenAI, servers: dict[str, Any]) -> None:
    kwargs = dict(model=MODEL, input="loop [sim:call=mcp__calc__echo]", tools=[calc(servers)])
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert _plain(final.output) == _plain(plain.output)
    assert final.usage == plain.usage


def test_no_backend_means_not_offered(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml(replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n')
    try:
        c = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        response = c.responses.create(model=MODEL, input="[sim:echo=request]",
                                      tools=[{"type": "web_search"}, {"type": "code_interpreter", "container": "auto"}])
        assert response.status == "completed" and "tools" not in json.loads(response.output_text)
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model=MODEL, input="x", tools=[{"type": "mcp", "server_label": "s", "server_url": "http://127.0.0.1:1/mcp"}])
        assert err.value.body["param"] == "tools[0].server_url"
    finally:
        assert router.stop() == 0


def _plain(value: Any) -> Any:
    """Output items for comparing two runs: no fresh ids, no unset fields, no SDK-only ``parsed``."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None and k not in ("id", "parsed", "approval_request_id")}
    return value
