"""MCP failures in the shapes the official SDK types: ``mcp_list_tools.error`` a string,
``mcp_call.error`` one of McpProtocolError / McpToolExecutionError / HTTPError; a listing error
stored as an object (as this router once wrote it) is still read as a failed listing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.responses.mcp_tool_call_error import HTTPError, McpProtocolError, McpToolExecutionError
from openai.types.responses.response_output_item import McpCall, McpListTools

from harness import RouterProcess, sim_pool_toml, start_router
from tests.support import mcp_servers

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"
# What this router wrote in a failed listing's ``error`` before it was a string.
OLD_ERROR = {"type": "http_error", "code": 502, "message": "could not list tools: http_error 503: MCP server answered HTTP 503"}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, mcp_servers.ServerProcess]]:
    up, going = mcp_servers.spawn("streamable-http"), mcp_servers.spawn("streamable-http")
    try:
        up.wait_ready()
        going.wait_ready()
        yield {"up": up, "going": going}  # going: stopped by the test that needs a server gone
    finally:
        up.stop()
        going.stop()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, servers: dict[str, mcp_servers.ServerProcess]) -> Iterator[openai.OpenAI]:
    body = sim_pool_toml(replicas=1) + f"""
[[models]]
name = "{MODEL}"
pool = "sim"

[tools]
private_networks = ["127.0.0.0/8"]
[tools.mcp]
allow = ["{servers["up"].base}/", "{servers["going"].base}/"]
timeout_s = 10
"""
    proc: RouterProcess = start_router(tmp_path_factory.mktemp("mcp-errors"), body)
    yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert proc.stop() == 0, proc.log()


def mcp(url: str, label: str = "calc") -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": url, "require_approval": "never"}


def listing_of(item: Any) -> McpListTools:
    """The SDK's item (an output or an input item), checked against its type: the SDK parses without validating."""
    assert item.type == "mcp_list_tools"
    return McpListTools.model_validate(item.model_dump())


def test_a_failed_listing_has_a_string_error(client: openai.OpenAI, servers: dict[str, mcp_servers.ServerProcess]) -> None:
    tools = [mcp(servers["up"].base + "/status/503/mcp")]
    response = client.responses.create(model=MODEL, input="hi", tools=tools)
    listing = listing_of(response.output[0])
    assert listing.tools == [] and isinstance(listing.error, str) and "503" in listing.error
    assert listing_of(client.responses.retrieve(response.id).output[0]).error == listing.error
    events = list(client.responses.create(model=MODEL, input="hi", tools=tools, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "mcp_list_tools"]
    assert len(done) == 1 and isinstance(listing_of(done[0]).error, str)
    final = events[-1]
    assert final.type == "response.completed" and isinstance(listing_of(final.response.output[0]).error, str)
    fine = client.responses.create(model=MODEL, input="hi", tools=[mcp(servers["up"].url)])
    assert listing_of(fine.output[0]).error is None and fine.output[0].tools


def test_call_errors_are_the_sdk_types(client: openai.OpenAI, servers: dict[str, mcp_servers.ServerProcess]) -> None:
    up = mcp(servers["up"].url)
    failed = client.responses.create(model=MODEL, input="[sim:call=mcp__calc__fail]", tools=[up])
    call = McpCall.model_validate(failed.output[1].model_dump())
    assert call.status == "failed" and isinstance(call.error, McpToolExecutionError)
    cut = client.responses.create(model=MODEL, input="[sim:call=mcp__calc__echo]", tools=[up], max_output_tokens=1)
    call = McpCall.model_validate(next(i for i in cut.output if i.type == "mcp_call").model_dump())
    assert isinstance(call.error, McpProtocolError) and call.error.code == -32602
    # Listed while up, called once gone: the router cannot reach it.
    going = mcp(servers["going"].url)
    listed = client.responses.create(model=MODEL, input="hi", tools=[going])
    assert listing_of(listed.output[0]).error is None
    servers["going"].stop()
    gone = client.responses.create(model=MODEL, input="[sim:call=mcp__calc__add]", tools=[going], previous_response_id=listed.id)
    call = McpCall.model_validate(gone.output[0].model_dump())
    assert call.status == "failed" and isinstance(call.error, HTTPError) and call.error.code == 502


def test_a_stored_listing_error_object_is_still_a_failed_listing(client: openai.OpenAI,
                                                                 servers: dict[str, mcp_servers.ServerProcess]) -> None:
    """A chain holding a failed listing with an object ``error``: the server is listed again, and the
    stored item reads back with the error as a string."""
    old = {"type": "mcp_list_tools", "id": "mcpl_old", "server_label": "calc", "tools": [], "error": OLD_ERROR}
    first = client.responses.create(model=MODEL, input=[old, {"role": "user", "content": "hi"}])
    (stored, _) = client.responses.input_items.list(first.id, order="asc").data
    assert listing_of(stored).error == OLD_ERROR["message"]
    then = client.responses.create(model=MODEL, input="[sim:call=mcp__calc__add]", tools=[mcp(servers["up"].url)],
                                   previous_response_id=first.id)
    assert [i.type for i in then.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert listing_of(then.output[0]).error is None and then.output[1].status == "completed"
