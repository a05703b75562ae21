"""Before a response's first model turn: MCP servers listed, approved MCP calls run.

Listings found in the conversation are reused (a server is listed once per
conversation). The I/O happens before the client sees a byte; the items and
their events are emitted right after ``response.created``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from router.protocol.errors import InvalidRequest
from router.protocol.ids import new_id
from router.protocol.items import Item
from router.protocol.tools import ToolSet
from router.tools.mcp_client import MCPServer
from router.tools.registry import CallOutcome, RouterTools
from router.turns.assembler import Assembler, Event


@dataclass(eq=False)
class Prelude:
    tools: RouterTools
    servers: dict[str, MCPServer]  # by server label
    approvals: list[tuple[Item, bool]] = field(default_factory=list)  # (the request item, approved?)
    _listings: list[tuple[str, list[dict[str, Any]], str | None]] = field(default_factory=list)
    _ran: list[tuple[Item, CallOutcome]] = field(default_factory=list)

    async def run(self, toolset: ToolSet, prompt: list[Item]) -> list[Item]:
        """List what is not listed yet, run approved calls; returns the prompt with their results."""
        # A failed listing (its error a string, or an object as stored by earlier versions) is listed again.
        known = {item["server_label"]: item for item in prompt
                 if item["type"] == "mcp_list_tools" and not item.get("error")}
        for label, server in self.servers.items():
            if label in known:
                tools = known[label].get("tools") or []
            else:
                tools, error = await self.tools.list_mcp(server)
                self._listings.append((label, tools, error))
            toolset.add_mcp(label, tools)
        prompt = list(prompt)
        for request, approved in self.approvals:
            if approved:
                approved_server = self.servers.get(request["server_label"])
                if approved_server is None:
                    raise InvalidRequest(f"the approved call's server {request['server_label']!r} is not in tools",
                                         param="tools", code="mcp_server_missing")
                arguments = _arguments(request["arguments"])
                outcome = await self.tools.run("mcp", request["name"], arguments, server=approved_server)
                self._ran.append((request, outcome))
                text = outcome.prompt_text
            else:
                text = "The user did not approve this call."
            prompt.append({"type": "mcp_call", "id": new_id("mcp"), "server_label": request["server_label"],
                           "name": request["name"], "arguments": request["arguments"], "_output": text})
        return prompt

    def emit(self, asm: Assembler) -> list[Event]:
        events: list[Event] = []
        for label, tools, error in self._listings:
            item, added = asm.list_tools(label)
            events += added
            item.finish(events, tools, error)
        for request, outcome in self._ran:
            call, added = asm.router_call("mcp", request["name"], request["server_label"], request["arguments"])
            call.item["approval_request_id"] = request["id"]
            events += added
            call.finish(events, output=outcome.output, error=outcome.error)
        return events


def build_prelude(toolset: ToolSet, tools: RouterTools | None, history: list[Item], input_items: list[Item]) -> Prelude | None:
    """The prelude a request needs, or None; every refusal is a 400 naming its param."""
    answers = [(i, item) for i, item in enumerate(input_items) if item["type"] == "mcp_approval_response"]
    if not toolset.mcp and not answers:
        return None
    if tools is None:
        raise InvalidRequest("this router runs no tools", param="tools")
    servers = {}
    for label, spec in toolset.mcp.items():
        servers[label] = tools.mcp_server(spec, toolset.mcp_where[label])  # its index among all the request's tools
    requests = {item["id"]: item for item in history + input_items if item["type"] == "mcp_approval_request"}
    approvals = []
    for i, answer in answers:
        request = requests.get(answer["approval_request_id"])
        if request is None:
            raise InvalidRequest(f"No approval request with id '{answer['approval_request_id']}'.",
                                 param=f"input[{i}].approval_request_id", code="approval_request_not_found")
        approvals.append((request, bool(answer.get("approve"))))
    return Prelude(tools, servers, approvals)


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
