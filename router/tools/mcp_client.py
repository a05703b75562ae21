"""A client for remote MCP servers (Streamable HTTP or SSE), as the router's tool loop needs it.

One MCP session per operation: connect, initialize, list or call, close, all
under one deadline. Every HTTP request, redirect hops included, passes the URL
allowlist, and every connection the NetGuard (public addresses, plus the networks
the operator permits; a server named in config is trusted on its own origin,
since the operator chose it, not a request). Failures come back in the Responses API's shapes: ``mcp_call.error``
objects for a call; a listing raises MCPClientError (``mcp_list_tools.error`` is its text).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import httpx2
import mcp_types as types
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from router.tools.allowlist import (
    AllowlistTransport,
    UrlAllowlist,
    UrlNotAllowed,
    mcp_http_client_factory,
    normalize_url,
)
from router.tools.netguard import NetGuard

__all__ = ["MCPClientError", "MCPServer", "ToolCallResult", "UrlNotAllowed", "call_tool", "list_tools"]

MAX_LIST_PAGES = 100


@dataclass
class MCPServer:
    label: str
    url: str
    transport: Literal["streamable_http", "sse"] = "streamable_http"
    headers: dict[str, str] = field(default_factory=dict)
    # Named in the router's config: its origin may be on any address (the operator chose it).
    configured: bool = False


@dataclass
class ToolCallResult:
    output: str | None
    error: dict[str, Any] | None = None


class MCPClientError(Exception):
    """An MCP operation failed; ``error`` is the Responses API error object (http_error / mcp_protocol_error)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error['type']} {error.get('code')}: {error.get('message')}")
        self.error = error


class _SseTransport(AllowlistTransport):
    """An SSE server names its own message endpoint, which the SDK keeps on the stream's origin.

    So POSTs may go anywhere on the allowed stream URL's origin; everything else
    (the stream GET, any redirect) must pass the allowlist itself.
    """

    def __init__(self, allowlist: UrlAllowlist, url: str, guard: NetGuard) -> None:
        super().__init__(allowlist, guard=guard)
        u = normalize_url(url)
        self._origin = (u.scheme, u.host, u.port)

    def permits(self, request: Any) -> None:
        if request.method == "POST":
            u = normalize_url(str(request.url))
            if (u.scheme, u.host, u.port) == self._origin:
                return
        super().permits(request)


@asynccontextmanager
async def _session(server: MCPServer, transport: AllowlistTransport, timeout_s: float) -> AsyncIterator[ClientSession]:
    factory = mcp_http_client_factory(transport.allowlist, transport)
    # HTTP read timeouts a little past the deadline, so the deadline is what fires.
    read_s = timeout_s + 5
    if server.transport == "sse":
        streams = sse_client(
            server.url, headers=server.headers, timeout=read_s, sse_read_timeout=read_s, httpx_client_factory=factory
        )
        async with streams as (read, write), ClientSession(read, write, read_timeout_seconds=read_s) as session:
            await session.initialize()
            yield session
    else:
        client = factory(headers=server.headers, timeout=httpx2.Timeout(read_s))
        async with (
            client,
            streamable_http_client(server.url, http_client=client) as (read, write),
            ClientSession(read, write, read_timeout_seconds=read_s) as session,
        ):
            await session.initialize()
            yield session


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _classify(exc: BaseException, transport: AllowlistTransport, timeout_s: float) -> dict[str, Any]:
    """The Responses API error object for a failed MCP operation."""
    leaves = _leaves(exc)
    if transport.refused is not None:
        code = transport.redirect_status or 403
        what = "redirect to" if transport.redirect_status else "request to"
        return _http(code, f"{what} {transport.refused.url} refused: {transport.refused.reason}")
    for leaf in leaves:
        if isinstance(leaf, (TimeoutError, httpx2.TimeoutException)):
            return _http(504, f"MCP server timed out (no answer within {timeout_s:g}s)")
    for leaf in leaves:
        if isinstance(leaf, httpx2.HTTPStatusError):
            status = leaf.response.status_code
            if 300 <= status < 400:
                location = leaf.response.headers.get("location", "?")
                return _http(status, f"MCP server redirected to {location}; redirect not followed")
            return _http(status, f"MCP server answered HTTP {status}")
        if isinstance(leaf, httpx2.ConnectError):
            return _http(502, f"could not connect to MCP server: {leaf}")
        if isinstance(leaf, httpx2.HTTPError):
            return _http(502, f"HTTP error talking to MCP server: {type(leaf).__name__}: {leaf}")
    for leaf in leaves:
        if isinstance(leaf, MCPError):
            if leaf.code == types.REQUEST_TIMEOUT:
                return _http(504, f"MCP server timed out (no answer within {timeout_s:g}s)")
            if transport.statuses:
                # The SDK turns an HTTP failure of a POST into a JSON-RPC error; report the HTTP status.
                return _http(
                    transport.statuses[-1], f"MCP server answered HTTP {transport.statuses[-1]}: {leaf.message}"
                )
            return {"type": "mcp_protocol_error", "code": leaf.code, "message": leaf.message}
    leaf = leaves[0]
    return {"type": "mcp_protocol_error", "code": types.INTERNAL_ERROR, "message": f"{type(leaf).__name__}: {leaf}"}


def _http(code: int, message: str) -> dict[str, Any]:
    return {"type": "http_error", "code": code, "message": message}


def _block_text(block: Any) -> tuple[str, bool]:
    """A content block as text, and whether it was text to begin with."""
    if isinstance(block, types.TextContent):
        return block.text, True
    if isinstance(block, (types.ImageContent, types.AudioContent)):
        return f"[{block.type}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]", False
    if isinstance(block, types.ResourceLink):
        return f"[resource link: {block.uri}]", False
    if isinstance(block, types.EmbeddedResource):
        res = block.resource
        if isinstance(res, types.TextResourceContents):
            return res.text, True
        return f"[resource: {res.uri} ({res.mime_type or 'binary'})]", False
    return f"[{getattr(block, 'type', 'content')}]", False


def result_output(result: types.CallToolResult) -> str:
    """The text of a tool result's content blocks, or its structured content as JSON when there is no text."""
    parts = [_block_text(block) for block in result.content]
    if not any(is_text for _, is_text in parts) and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(text for text, _ in parts)


def _tool_dict(tool: types.Tool) -> dict[str, Any]:
    annotations = (
        tool.annotations.model_dump(mode="json", by_alias=True, exclude_none=True) if tool.annotations else None
    )
    return {
        "name": tool.name,
        "description": tool.description,
        "input_schema": tool.input_schema,
        "annotations": annotations,
    }


def _transport_for(server: MCPServer, allowlist: UrlAllowlist, guard: NetGuard | None) -> AllowlistTransport:
    allowlist.check(server.url)  # before anything connects
    guard = guard if guard is not None else NetGuard()
    if server.configured:
        u = normalize_url(server.url)
        guard = guard.trusting(u.host, u.port)
    if server.transport == "sse":
        return _SseTransport(allowlist, server.url, guard)
    if server.transport != "streamable_http":
        raise ValueError(f"unknown MCP transport {server.transport!r}")
    return AllowlistTransport(allowlist, guard=guard)


async def list_tools(
    server: MCPServer, allowlist: UrlAllowlist, *, timeout_s: float, guard: NetGuard | None = None
) -> list[dict[str, Any]]:
    """The server's tools as ``mcp_list_tools.tools`` entries; raises UrlNotAllowed or MCPClientError.

    ``guard``: which addresses may be connected to (default: public ones only)."""
    transport = _transport_for(server, allowlist, guard)
    tools: list[dict[str, Any]] = []
    try:
        with anyio.fail_after(timeout_s):
            async with _session(server, transport, timeout_s) as session:
                cursor: str | None = None
                for _ in range(MAX_LIST_PAGES):
                    params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    page = await session.list_tools(params=params)
                    tools.extend(_tool_dict(tool) for tool in page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
    except Exception as exc:
        raise MCPClientError(_classify(exc, transport, timeout_s)) from exc
    return tools


async def call_tool(
    server: MCPServer,
    allowlist: UrlAllowlist,
    name: str,
    arguments: dict[str, Any],
    *,
    timeout_s: float,
    guard: NetGuard | None = None,
) -> ToolCallResult:
    """Call one tool; failures come back as ``error`` (an ``mcp_call.error`` object). Raises UrlNotAllowed."""
    transport = _transport_for(server, allowlist, guard)
    try:
        with anyio.fail_after(timeout_s):
            async with _session(server, transport, timeout_s) as session:
                result = await session.call_tool(name, arguments)
    except Exception as exc:  # noqa: BLE001 - any failure of the call becomes its error object
        return ToolCallResult(output=None, error=_classify(exc, transport, timeout_s))
    if result.is_error:
        content = [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content]
        return ToolCallResult(output=None, error={"type": "mcp_tool_execution_error", "content": content})
    return ToolCallResult(output=result_output(result))
