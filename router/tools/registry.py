"""The tools this router runs itself, built from ``[tools]`` in config.

Every address a tool may reach comes from config: MCP servers named there or
matching ``[tools.mcp] allow``, one search backend, a local sandbox. A
request can choose among them, never add to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from router.config import ToolsConfig
from router.protocol.errors import InvalidRequest
from router.tools.allowlist import UrlAllowlist, UrlNotAllowed
from router.tools.mcp_client import MCPServer, call_tool, list_tools
from router.tools.netguard import NetGuard

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
    guard: NetGuard = field(default_factory=NetGuard)  # where pages and request-named MCP servers may be

    @classmethod
    def from_config(cls, config: ToolsConfig, base_dir: Path) -> RouterTools:
        named = {s.label: MCPServer(s.label, s.url, s.transport, dict(s.headers), configured=True)
                 for s in config.mcp.servers}
        allowlist = UrlAllowlist([*config.mcp.allow, *(s.url for s in config.mcp.servers)])
        tools = cls(allowlist=allowlist, named=named, mcp_timeout_s=config.mcp.timeout_s, max_turns=config.max_turns,
                    guard=NetGuard.permitting(config.private_networks))
        if config.web_search is not None:
            from router.tools.web_search import HttpJsonSearch

            tools.search = HttpJsonSearch(config.web_search.url, timeout_s=config.web_search.timeout_s,
                                          allowlist=UrlAllowlist([config.web_search.url]),
                                          guard=tools.guard)
            tools.max_results = config.web_search.max_results
        if config.code_interpreter is not None:
            from router.tools.code_interpreter import CodeInterpreter, SandboxLimits

            ci = config.code_interpreter
            limits = SandboxLimits(timeout_s=ci.timeout_s, memory_mb=ci.memory_mb, cpu_s=ci.cpu_s, tmp_mb=ci.tmp_mb)
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
            return MCPServer(label, named.url, named.transport, {**named.headers, **headers}, configured=True)
        try:
            self.allowlist.check(url)
        except UrlNotAllowed:
            raise InvalidRequest(f"mcp server_url {url!r} is not allowed by this router's configuration",
                                 param=f"{where}.server_url", code="mcp_server_not_allowed") from None
        transport: Literal["streamable_http", "sse"] = "sse" if url.rstrip("/").endswith("/sse") else "streamable_http"
        return MCPServer(label, url, transport, headers)

    async def list_mcp(self, server: MCPServer) -> tuple[list[dict[str, Any]], str | None]:
        """The server's tools, and the ``mcp_list_tools.error`` text (a string, as the API types it) when listing failed."""
        try:
            return await list_tools(server, self.allowlist, timeout_s=self.mcp_timeout_s, guard=self.guard), None
        except Exception as exc:  # noqa: BLE001 - a server that fails to list is reported in the item
            log.warning("mcp %s: listing failed: %s", server.label, exc)
            return [], f"could not list tools: {exc}"

    async def run(self, kind: str, name: str, arguments: dict[str, Any], *, server: MCPServer | None = None,
                  container: str | None = None, browser: Browsing | None = None, owner: str | None = None) -> CallOutcome:
        """Run one call; failures become the item's error and the model reads them, the response goes on."""
        if kind == "mcp":
            assert server is not None
            result = await call_tool(server, self.allowlist, name, arguments, timeout_s=self.mcp_timeout_s,
                                     guard=self.guard)
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
        assert owner is not None, "a code_interpreter call runs in its owner's container"
        result = await self.interpreter.run(code, container or "default", owner)
        logs = "\n".join(o.get("logs", "") for o in result.outputs if o.get("type") == "logs")
        if result.timed_out:
            logs += "\n[timed out]"
        if result.error:
            logs += f"\n[error: {result.error}]"
        return CallOutcome(logs.strip() or "(no output)", outputs=result.outputs)


    async def _browse(self, name: str, arguments: dict[str, Any], browser: Browsing) -> CallOutcome:
        """Open a page a search named, or find text in one: gpt-oss's browser.open/find and the chat
        models' web_search__open_page/find_in_page, on the search backend (which opens only pages its
        results named, or the allowlist passes)."""
        url = _page_url(name, arguments, browser)
        if url is None:
            return CallOutcome("error: no such page (search first, then open a result by its number or URL)",
                               error={"message": "no page to open"})
        try:
            text = await self.search.open_page(url)
        except Exception as exc:  # noqa: BLE001 - the model reads the failure
            return CallOutcome(f"error: could not open {url}: {exc}", output=url, error={"message": str(exc)})
        browser.last_page = url
        title = getattr(self.search, "title", lambda _url: None)(url) or url
        sources = [{"type": "url", "url": url, "title": title}]  # what the answer may cite
        if name == "open_page":
            return CallOutcome(f"{url}\n\n{text[:PAGE_PROMPT_CHARS]}", output=url, sources=sources)
        pattern = str(arguments.get("pattern", ""))
        lines = [line for line in text.splitlines() if pattern and pattern.lower() in line.lower()]
        if not lines:
            return CallOutcome(f"{pattern!r} not found in {url}", output=url, sources=sources)
        return CallOutcome(f"{url}\n\n" + "\n".join(lines[:FIND_LINES]), output=url, sources=sources)


PAGE_PROMPT_CHARS = 4000  # of an opened page, what the model reads
FIND_LINES = 20  # of a find, the matching lines the model reads


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def _page_url(name: str, arguments: dict[str, Any], browser: Browsing) -> str | None:
    """The page a call means.

    open_page: ``url`` (chat) or a URL ``id`` (gpt-oss); else ``result``, numbered from 1 as the search
    listing shows (chat); else ``id``, a link numbered from 0 (gpt-oss; no id: the first). find: ``url``
    (chat) if it is one, else the page opened last. A ``url`` that is not an http(s) URL counts as not given.
    """
    if name == "find":
        return arguments["url"] if _is_url(arguments.get("url")) else browser.last_page
    for key in ("url", "id"):
        if _is_url(arguments.get(key)):
            return arguments[key]
    result = arguments.get("result")
    if isinstance(result, str) and result.strip().isdigit():
        result = int(result)
    if isinstance(result, int) and not isinstance(result, bool):
        return browser.links[result - 1] if 1 <= result <= len(browser.links) else None
    if "url" in arguments or "result" in arguments:
        return None  # a chat model's page that is neither a URL nor a listed result: not the first one instead
    target = arguments.get("id")
    if isinstance(target, int) and not isinstance(target, bool):
        return browser.links[target] if 0 <= target < len(browser.links) else None
    return browser.links[0] if browser.links and target is None else None


@dataclass(slots=True)
class Browsing:
    """A conversation's browser: the links its newest search returned, in order, and the page it read last.

    Nothing of it lives between requests: ``from_items`` rebuilds it from the conversation's items
    (history, then this response's calls so far), so it is the same after ``previous_response_id``, with
    a full history sent back, and from one turn of the loop to the next. What may be opened is not
    decided here: the search backend opens only pages its own results named.
    """

    links: list[str] = field(default_factory=list)
    last_page: str | None = None

    @classmethod
    def from_items(cls, items: list[dict[str, Any]]) -> Browsing:
        browser = cls()
        found_links = False
        for item in reversed(items):
            if item.get("type") != "web_search_call" or item.get("status", "completed") != "completed":
                continue
            action = item.get("action") or {}
            if action.get("type") == "search" and isinstance(action.get("sources"), list) and not found_links:
                browser.links = [s["url"] for s in action["sources"] if isinstance(s, dict) and isinstance(s.get("url"), str)]
                found_links = True  # the newest search that answered; one with no results leaves no links
            elif action.get("type") in ("open_page", "find", "find_in_page") and browser.last_page is None and _is_url(action.get("url")):
                browser.last_page = action["url"]
            if found_links and browser.last_page is not None:
                break
        return browser


async def gather_outcomes(calls: list[Any], tools: RouterTools, servers: dict[str, MCPServer],
                          browser: Browsing | None = None, *, owner: str,
                          timed: Callable[[str, float, bool], None] | None = None,
                          around: Callable[[str], AbstractContextManager[Any]] | None = None) -> list[CallOutcome]:
    """Run independent calls of one turn concurrently; results come back in call order. ``timed``
    hears of each: its tool type, seconds, and whether it ended in an error; ``around(kind)`` is
    entered around each (a trace span)."""

    async def one(call: Any) -> CallOutcome:
        tool = call.tool
        server = servers.get(tool.server_label) if tool.kind == "mcp" else None
        start = time.perf_counter()
        with around(tool.kind) if around is not None else contextlib.nullcontext():
            outcome = await tools.run(tool.kind, tool.name, call.arguments, server=server,
                                      container=call.item.get("container_id"), browser=browser, owner=owner)
        if timed is not None:
            timed(tool.kind, time.perf_counter() - start, outcome.error is not None)
        return outcome

    return list(await asyncio.gather(*(one(c) for c in calls)))
