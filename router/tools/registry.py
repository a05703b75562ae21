"""The tools this router runs itself, built from ``[tools]`` in config.

Every address a tool may reach comes from config: MCP servers named there or
matching ``[tools.mcp] allow``, one search backend, a local sandbox. A
request can choose among them, never add to them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.config import ToolsConfig
from router.protocol.errors import InvalidRequest
from router.tools.allowlist import UrlAllowlist, UrlNotAllowed
from router.tools.mcp_client import MCPServer, call_tool, list_tools

log = logging.getLogger("router.tools")


@dataclass(slots=True)
class CallOutcome:
    """What running one call gave: fields for the output item, and the text the model reads next."""

    prompt_text: str
    output: str | None = None
    error: dict[str, Any] | None = None
    outputs: list[dict[str, Any]] | None = None
    sources: list[dict[str, Any]] | None = None


@dataclass(eq=False)
class RouterTools:
    allowlist: UrlAllowlist
    named: dict[str, MCPServer] = field(default_factory=dict)
    mcp_timeout_s: float = 30.0
    search: Any = None  # a web_search.SearchBackend
    max_results: int = 5
    interpreter: Any = None  # a code_interpreter.CodeInterpreter
    max_turns: int = 8

    @classmethod
    def from_config(cls, config: ToolsConfig, base_dir: Path) -> RouterTools:
        named = {s.label: MCPServer(s.label, s.url, s.transport, dict(s.headers)) for s in config.mcp.servers}
        allowlist = UrlAllowlist([*config.mcp.allow, *(s.url for s in config.mcp.servers)])
        tools = cls(allowlist=allowlist, named=named, mcp_timeout_s=config.mcp.timeout_s, max_turns=config.max_turns)
        if config.web_search is not None:
            from router.tools.web_search import HttpJsonSearch

            tools.search = HttpJsonSearch(config.web_search.url, timeout_s=config.web_search.timeout_s,
                                          allowlist=UrlAllowlist([config.web_search.url]),
                                          allow_private_results=config.web_search.allow_private_results)
            tools.max_results = config.web_search.max_results
        if config.code_interpreter is not None:
            from router.tools.code_interpreter import CodeInterpreter, SandboxLimits

            ci = config.code_interpreter
            limits = SandboxLimits(timeout_s=ci.timeout_s, memory_mb=ci.memory_mb, cpu_s=ci.cpu_s)
            tools.interpreter = CodeInterpreter((base_dir / ci.root).resolve(), limits)
        return tools

    @property
    def runnable(self) -> frozenset[str]:
        kinds = set()
        if self.search is not None:
            kinds.add("web_search")
        if self.interpreter is not None:
            kinds.add("code_interpreter")
        return frozenset(kinds)

    def mcp_server(self, spec: dict[str, Any], where: str) -> MCPServer:
        """The server a request's mcp tool names: its own URL (if allowed) or a configured label."""
        label = spec["server_label"]
        url = spec.get("server_url")
        headers = {str(k): str(v) for k, v in (spec.get("headers") or {}).items()}
        if spec.get("authorization"):
            headers["Authorization"] = f"Bearer {spec['authorization']}"
        if url is None:
            named = self.named.get(label)
            if named is None:
                raise InvalidRequest(f"mcp tool {label!r} has no server_url and no server of that label is configured",
                                     param=f"{where}.server_url")
            return MCPServer(label, named.url, named.transport, {**named.headers, **headers})
        try:
            self.allowlist.check(url)
        except UrlNotAllowed:
            raise InvalidRequest(f"mcp server_url {url!r} is not allowed by this router's configuration",
                                 param=f"{where}.server_url", code="mcp_server_not_allowed") from None
        transport = "sse" if url.rstrip("/").endswith("/sse") else "streamable_http"
        return MCPServer(label, url, transport, headers)

    async def list_mcp(self, server: MCPServer) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        try:
            return await list_tools(server, self.allowlist, timeout_s=self.mcp_timeout_s), None
        except Exception as exc:  # noqa: BLE001 - a server that fails to list is reported in the item
            log.warning("mcp %s: listing failed: %s", server.label, exc)
            return [], {"type": "http_error", "code": 502, "message": f"could not list tools: {exc}"}

    async def run(self, kind: str, name: str, arguments: dict[str, Any], *, server: MCPServer | None = None,
                  container: str | None = None, browser: Browsing | None = None) -> CallOutcome:
        """Run one call; failures become the item's error and the model reads them, the response goes on."""
        if kind == "mcp":
            assert server is not None
            result = await call_tool(server, self.allowlist, name, arguments, timeout_s=self.mcp_timeout_s)
            text = result.output if result.error is None else f"error: {result.error.get('message') or result.error}"
            return CallOutcome(text or "", output=result.output, error=result.error)
        if kind == "web_search" and name in ("open_page", "find"):
            return await self._browse(name, arguments, browser or Browsing())
        if kind == "web_search":
            query = str(arguments.get("query", ""))
            try:
                results = await self.search.search(query, max_results=self.max_results)
            except Exception as exc:  # noqa: BLE001
                return CallOutcome(f"search failed: {exc}", error={"message": str(exc)})
            text = "\n\n".join(f"[{i + 1}] {r.title}\n{r.url}\n{r.snippet}" for i, r in enumerate(results)) or "no results"
            return CallOutcome(text, sources=[{"type": "url", "url": r.url, "title": r.title} for r in results])
        code = str(arguments.get("code", ""))
        result = await self.interpreter.run(code, container or "default")
        logs = "\n".join(o.get("logs", "") for o in result.outputs if o.get("type") == "logs")
        if result.timed_out:
            logs += "\n[timed out]"
        if result.error:
            logs += f"\n[error: {result.error}]"
        return CallOutcome(logs.strip() or "(no output)", outputs=result.outputs)


    async def _browse(self, name: str, arguments: dict[str, Any], browser: Browsing) -> CallOutcome:
        """gpt-oss's browser.open / browser.find on the search backend (only pages its results named)."""
        target = arguments.get("id")
        if name == "find":
            url = browser.last_page
        elif isinstance(target, str) and target.startswith(("http://", "https://")):
            url = target
        elif isinstance(target, int) and 0 <= target < len(browser.links):
            url = browser.links[target]
        else:
            url = browser.links[0] if browser.links and target is None else None
        if url is None:
            return CallOutcome("error: no such page (search first, then open a result by its number)",
                               error={"message": "no page to open"})
        try:
            text = await self.search.open_page(url)
        except Exception as exc:  # noqa: BLE001 - the model reads the failure
            return CallOutcome(f"error: could not open {url}: {exc}", output=url, error={"message": str(exc)})
        browser.last_page = url
        if name == "open_page":
            return CallOutcome(f"{url}\n\n{text[:4000]}", output=url)
        pattern = str(arguments.get("pattern", ""))
        lines = [line for line in text.splitlines() if pattern and pattern.lower() in line.lower()]
        return CallOutcome("\n".join(lines[:20]) or f"{pattern!r} not found in {url}", output=url)


@dataclass(slots=True)
class Browsing:
    """One response's browser: the links its searches returned, in order, and the page it opened last."""

    links: list[str] = field(default_factory=list)
    last_page: str | None = None


async def gather_outcomes(calls: list[Any], tools: RouterTools, servers: dict[str, MCPServer],
                          browser: Browsing | None = None) -> list[CallOutcome]:
    """Run independent calls of one turn concurrently; results come back in call order."""

    async def one(call: Any) -> CallOutcome:
        tool = call.tool
        server = servers.get(tool.server_label) if tool.kind == "mcp" else None
        return await tools.run(tool.kind, tool.name, call.arguments, server=server, container=call.item.get("container_id"),
                               browser=browser)

    return list(await asyncio.gather(*(one(c) for c in calls)))
