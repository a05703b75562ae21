"""The MCP client against real MCP servers (the SDK's server side, in subprocesses), and the URL allowlist."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any, Literal

import httpx2
import mcp_types as types
import pytest

from harness import free_port
from router.tools.allowlist import AllowlistTransport, UrlAllowlist, UrlNotAllowed, mcp_http_client_factory
from router.tools.mcp_client import MCPClientError, MCPServer, call_tool, list_tools, result_output
from router.tools.netguard import NetGuard
from tests.support import mcp_servers
from tests.support.mcp_servers import ServerProcess

TRANSPORTS = {"streamable_http": "streamable-http", "sse": "sse"}
# The test servers listen on 127.0.0.1, which the router reaches only where the operator permits it.
LOOPBACK = NetGuard.permitting(["127.0.0.0/8"])


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[ServerProcess, dict[str, ServerProcess]]]:
    """One server per transport, and a target their /redirect-away/ points at; started in parallel."""
    target = mcp_servers.spawn("streamable-http")
    servers = {name: mcp_servers.spawn(flag, redirect_to=target.url) for name, flag in TRANSPORTS.items()}
    everyone = [target, *servers.values()]
    try:
        for server in everyone:
            server.wait_ready()
        yield target, servers
    finally:
        for server in everyone:
            server.stop()


@pytest.fixture(scope="module")
def target(cluster: tuple[ServerProcess, dict[str, ServerProcess]]) -> ServerProcess:
    """Where the redirecting servers point: it must never see a request."""
    return cluster[0]


@pytest.fixture(scope="module")
def servers(cluster: tuple[ServerProcess, dict[str, ServerProcess]]) -> dict[str, ServerProcess]:
    return cluster[1]


def allow(*servers: ServerProcess) -> UrlAllowlist:
    return UrlAllowlist([s.base + "/" for s in servers])


def mcp(server: ServerProcess, path: str | None = None) -> MCPServer:
    transport: Literal["streamable_http", "sse"] = "sse" if server.transport == "sse" else "streamable_http"
    return MCPServer(label="test", url=server.base + path if path else server.url, transport=transport)


@pytest.fixture(params=list(TRANSPORTS))
def server(request: pytest.FixtureRequest, servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers[request.param]


def test_list_tools(server: ServerProcess) -> None:
    tools = asyncio.run(list_tools(mcp(server), allow(server), timeout_s=10, guard=LOOPBACK))
    by_name = {t["name"]: t for t in tools}
    assert set(by_name) == {"add", "echo", "slow", "fail"}
    add = by_name["add"]
    assert set(add) == {"name", "description", "input_schema", "annotations"}
    assert add["description"] == "Add two integers."
    assert add["input_schema"]["type"] == "object"
    assert set(add["input_schema"]["properties"]) == {"a", "b"}
    assert add["annotations"] is None


def test_call_tool(server: ServerProcess) -> None:
    result = asyncio.run(call_tool(mcp(server), allow(server), "add", {"a": 2, "b": 40}, timeout_s=10, guard=LOOPBACK))
    assert result.error is None and result.output == "42"
    result = asyncio.run(call_tool(mcp(server), allow(server), "echo", {"text": "héllo\nworld"},
                                   timeout_s=10, guard=LOOPBACK))
    assert result.output == "héllo\nworld"


def test_concurrent_calls(server: ServerProcess) -> None:
    async def main() -> list[Any]:
        return await asyncio.gather(
            *(call_tool(mcp(server), allow(server), "add", {"a": i, "b": 100}, timeout_s=10, guard=LOOPBACK)
              for i in range(5))
        )

    results = asyncio.run(main())
    assert [r.output for r in results] == [str(100 + i) for i in range(5)]
    assert all(r.error is None for r in results)


def test_tool_raises(server: ServerProcess) -> None:
    result = asyncio.run(call_tool(mcp(server), allow(server), "fail", {"message": "kaboom"},
                                   timeout_s=10, guard=LOOPBACK))
    assert result.output is None
    assert result.error is not None and result.error["type"] == "mcp_tool_execution_error"
    assert result.error["content"][0]["type"] == "text" and "kaboom" in result.error["content"][0]["text"]


def test_unknown_tool_and_bad_arguments(server: ServerProcess) -> None:
    for name, args in (("nosuch", {}), ("add", {"a": "x"})):
        result = asyncio.run(call_tool(mcp(server), allow(server), name, args, timeout_s=10, guard=LOOPBACK))
        assert result.error is not None and result.error["type"] in ("mcp_tool_execution_error", "mcp_protocol_error")


def test_timeout(server: ServerProcess) -> None:
    result = asyncio.run(call_tool(mcp(server), allow(server), "slow", {"seconds": 5}, timeout_s=0.7, guard=LOOPBACK))
    assert result.error is not None and result.error["type"] == "http_error"
    assert "timed out" in result.error["message"] and result.error["code"] == 504
    with pytest.raises(MCPClientError) as info:
        asyncio.run(
            list_tools(
                MCPServer("x", server.url, "sse" if server.transport == "sse" else "streamable_http"),
                allow(server),
                timeout_s=0.0001,
                guard=LOOPBACK,
            )
        )
    assert info.value.error["type"] == "http_error" and "timed out" in info.value.error["message"]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_server_down(transport: str) -> None:
    port = free_port()
    server = MCPServer("down", f"http://127.0.0.1:{port}/mcp", transport)  # type: ignore[arg-type]
    allowlist = UrlAllowlist([f"127.0.0.1:{port}"])
    result = asyncio.run(call_tool(server, allowlist, "add", {"a": 1, "b": 2}, timeout_s=5, guard=LOOPBACK))
    assert result.output is None and result.error is not None
    assert result.error["type"] == "http_error" and result.error["code"] == 502
    assert "connect" in result.error["message"]
    with pytest.raises(MCPClientError) as info:
        asyncio.run(list_tools(server, allowlist, timeout_s=5, guard=LOOPBACK))
    assert info.value.error["type"] == "http_error"


def test_http_error_status(server: ServerProcess) -> None:
    endpoint = "/status/503/" + ("sse" if server.transport == "sse" else "mcp")
    result = asyncio.run(call_tool(mcp(server, endpoint), allow(server), "add", {"a": 1, "b": 2},
                                   timeout_s=5, guard=LOOPBACK))
    assert result.error == {"type": "http_error", "code": 503, "message": result.error["message"]}  # type: ignore[index]


def test_url_outside_allowlist_refused_before_connecting(server: ServerProcess, target: ServerProcess) -> None:
    before = server.requests_seen()
    allowlist = allow(target)
    with pytest.raises(UrlNotAllowed):
        asyncio.run(call_tool(mcp(server), allowlist, "add", {"a": 1, "b": 2}, timeout_s=5, guard=LOOPBACK))
    with pytest.raises(UrlNotAllowed):
        asyncio.run(list_tools(mcp(server), allowlist, timeout_s=5, guard=LOOPBACK))
    # Userinfo and path tricks pointing at the server are refused the same way.
    s, t = server.base[len("http://") :], target.base[len("http://") :]
    tricks = [f"http://{t}@{s}/mcp", f"http://{s}\\@{t}/mcp", f"http://{s}#@{t}/mcp", f"http://{s}?@{t}/mcp"]
    for url in tricks:
        with pytest.raises(UrlNotAllowed):
            asyncio.run(call_tool(MCPServer("x", url), allowlist, "add", {}, timeout_s=5, guard=LOOPBACK))
    assert server.requests_seen() == before


def test_allowed_url_whose_host_resolves_to_loopback_refused(server: ServerProcess) -> None:
    """The allowlist admits http://vm:PORT/ by prefix; "vm" resolves to 127.0.0.1 (here by an injected lookup), which
    no permitted network covers: nothing connects. As a server named in config, the same origin is reached."""
    async def lookup(host: str, port: int, family: int) -> list[tuple[int, str]]:
        assert host == "vm"
        return [(socket.AF_INET, "127.0.0.1")]

    guard = NetGuard.permitting(["127.0.0.2/32"], lookup=lookup)
    url = f"http://vm:{server.port}" + ("/sse" if server.transport == "sse" else "/mcp")
    target = MCPServer("x", url, "sse" if server.transport == "sse" else "streamable_http")
    allowlist = UrlAllowlist([f"http://vm:{server.port}/"])
    before = server.requests_seen()
    result = asyncio.run(call_tool(target, allowlist, "add", {"a": 1, "b": 2}, timeout_s=5, guard=guard))
    assert result.error is not None and result.error["type"] == "http_error" and result.error["code"] == 403
    assert result.error["message"] == f"request to {url} refused: vm resolves to 127.0.0.1, a loopback address; " \
        "only public addresses may be fetched"
    with pytest.raises(MCPClientError) as info:
        asyncio.run(list_tools(target, allowlist, timeout_s=5, guard=guard))
    assert "vm resolves to 127.0.0.1" in info.value.error["message"]
    assert server.requests_seen() == before
    named = MCPServer("x", server.url, target.transport, configured=True)
    result = asyncio.run(call_tool(named, allow(server), "add", {"a": 1, "b": 2}, timeout_s=5, guard=guard))
    assert result.output == "3"


def test_redirect_to_other_origin_refused(server: ServerProcess, target: ServerProcess) -> None:
    before = target.requests_seen()
    endpoint = "/redirect-away/" + ("sse" if server.transport == "sse" else "mcp")
    # Even with the target itself allowed, an MCP server may not send the client there.
    result = asyncio.run(call_tool(mcp(server, endpoint), allow(server, target), "add", {"a": 1, "b": 2},
                                   timeout_s=5, guard=LOOPBACK))
    assert result.error is not None and result.error["type"] == "http_error" and result.error["code"] == 307
    assert "not followed" in result.error["message"] or "refused" in result.error["message"]
    assert target.requests_seen() == before


def test_redirect_outside_allowed_prefix_refused(server: ServerProcess) -> None:
    """A same-origin redirect (which the SDK itself would follow) to a path the allowlist does not cover."""
    endpoint = "/redirect-local/" + ("sse" if server.transport == "sse" else "mcp")
    narrow = UrlAllowlist([server.base + "/redirect-local/"])
    before = server.requests_seen()
    result = asyncio.run(call_tool(mcp(server, endpoint), narrow, "add", {"a": 1, "b": 2}, timeout_s=5, guard=LOOPBACK))
    assert result.error is not None and result.error["type"] == "http_error"
    assert "refused" in result.error["message"] and server.url in result.error["message"]
    assert server.requests_seen() == before + 1  # only the redirecting request itself
    # With the whole server allowed, the same redirect is followed and the call works.
    result = asyncio.run(call_tool(mcp(server, endpoint), allow(server), "add", {"a": 1, "b": 2},
                                   timeout_s=5, guard=LOOPBACK))
    assert result.output == "3"


def test_transport_rechecks_every_request(servers: dict[str, ServerProcess], target: ServerProcess) -> None:
    """The httpx2 factory given to the SDK refuses redirect hops on its own, whatever follows them."""
    server = servers["streamable_http"]
    before = target.requests_seen()

    async def main() -> None:
        transport = AllowlistTransport(allow(server), guard=LOOPBACK)
        client = mcp_http_client_factory(transport.allowlist, transport)()
        async with client:
            response = await client.get(server.base + "/redirect-away/x", follow_redirects=True)
            raise AssertionError(f"followed to {response.url}")

    with pytest.raises(UrlNotAllowed):
        asyncio.run(main())
    assert target.requests_seen() == before

    async def direct() -> int:
        async with mcp_http_client_factory(allow(server), guard=LOOPBACK)() as client:
            return (await client.get(server.base + "/_stats")).status_code

    assert asyncio.run(direct()) == 200


def test_result_output() -> None:
    def out(content: list[Any], structured: Any = None) -> str:
        return result_output(types.CallToolResult(content=content, structured_content=structured))

    text = types.TextContent(type="text", text="hi")
    image = types.ImageContent(type="image", data="aGVsbG8h", mime_type="image/png")
    assert out([text, types.TextContent(type="text", text="there")]) == "hi\nthere"
    assert out([text, image]) == "hi\n[image: image/png, 6 bytes]"
    assert out([], {"result": 3}) == '{"result": 3}'
    assert out([image], {"x": 1}) == '{"x": 1}'
    assert out([text], {"x": 1}) == "hi"
    assert out([]) == ""


# ---- the allowlist itself ----

ALLOW = UrlAllowlist(["https://mcp.example.com/mcp/", "127.0.0.1:8931", "tools.example.org", "http://[::1]:9000/x"])


@pytest.mark.parametrize(
    "url",
    [
        "https://mcp.example.com/mcp/",
        "https://mcp.example.com/mcp/sub/path?q=1#f",
        "https://MCP.Example.COM:443/mcp/x",
        "https://mcp.example.com./mcp/x",
        "https://mcp.example.com/mcp/a/../b",
        "http://127.0.0.1:8931/mcp",
        "https://127.0.0.1:8931/",
        "http://tools.example.org/anything",
        "https://tools.example.org:443/anything",
        "http://[0:0:0::1]:9000/x/y",
        "http://[::1]:9000/x",
    ],
)
def test_allowlist_allows(url: str) -> None:
    ALLOW.check(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://mcp.example.com/mcp/",  # scheme
        "https://mcp.example.com:8443/mcp/",  # port
        "https://mcp.example.com/mcpx",  # prefix on a segment boundary only
        "https://mcp.example.com/",
        "https://mcp.example.com/mcp/../admin",  # dot segments
        "https://mcp.example.com/mcp/%2e%2e/admin",  # encoded dot segments
        "https://mcp.example.com/mcp/%2E%2E/%2E%2E/admin",
        "https://mcp.example.com/mcp%2f..%2fadmin",  # encoded slash
        "https://mcp.example.com/mcp/%252e%252e/admin",  # double encoding
        "https://mcp.example.com/mcp\\..\\admin",  # backslashes
        "https://mcp.example.com@evil.com/mcp/",  # userinfo
        "https://evil.com@mcp.example.com/mcp/",  # userinfo, even in front of the allowed host
        "https://mcp.example.com:@evil.com/mcp/",
        "https://evil.com\\@mcp.example.com/mcp/",
        "https://evil.com#@mcp.example.com/mcp/",
        "https://mcp.example.com.evil.com/mcp/",  # suffix tricks
        "https://evilmcp.example.com/mcp/",
        "https://%6dcp.example.com/mcp/",  # percent-encoded host
        "https://mcp.exаmple.com/mcp/",  # noqa: RUF001 - Cyrillic a: a different (punycode) host
        "http://127.0.0.1:80/",  # default port is not the allowed one
        "http://127.0.0.1/",
        "http://127.1:8931/",  # numeric spellings of 127.0.0.1
        "http://2130706433:8931/",
        "http://0x7f.0.0.1:8931/",
        "http://0177.0.0.1:8931/",
        "http://127.0.0.01:8931/",
        "http://localhost:8931/",
        "http://[::ffff:127.0.0.1]:8931/",
        "http://127.0.0.1:8932/",
        "http://tools.example.org:8080/",  # bare host without a port: default ports only
        "http://[::1]:9000/xy",
        "ftp://tools.example.org/",
        "file:///etc/passwd",
        "//tools.example.org/",
        "tools.example.org",
        "http://tools.example.org /",
        "http://tools.example.org\t/",
        "",
    ],
)
def test_allowlist_refuses(url: str) -> None:
    with pytest.raises(UrlNotAllowed):
        ALLOW.check(url)
    assert not ALLOW.allows(url)


def test_allowlist_idna_and_entries() -> None:
    idn = UrlAllowlist(["https://bücher.example/"])
    idn.check("https://xn--bcher-kva.example/x")
    idn.check("https://BÜCHER.example/x")
    with pytest.raises(UrlNotAllowed):
        idn.check("https://bucher.example/x")
    assert not UrlAllowlist([]).allows("https://mcp.example.com/")
    with pytest.raises(ValueError):
        UrlAllowlist(["https://user@mcp.example.com/"])
    with pytest.raises(ValueError):
        UrlAllowlist(["mcp.example.com/path"])
    # An entry without a trailing slash covers that path and below, on a segment boundary.
    exact = UrlAllowlist(["https://h.example/mcp"])
    exact.check("https://h.example/mcp")
    exact.check("https://h.example/mcp/x")
    with pytest.raises(UrlNotAllowed):
        exact.check("https://h.example/mcpx")


def test_allowlist_accepts_httpx_urls() -> None:
    ALLOW.check(httpx2.URL("https://mcp.example.com/mcp/x"))
    with pytest.raises(UrlNotAllowed):
        ALLOW.check(httpx2.URL("https://mcp.example.com/other"))
