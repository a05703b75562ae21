"""Output items of tools the router runs itself: mcp_call, web_search_call, code_interpreter_call,
mcp_approval_request and mcp_list_tools, with the events each one streams.

The model's call arrives as deltas like any tool call; when its turn closes the
item waits (``calling`` / ``searching`` / ``interpreting``) until the runner
has run it and calls ``finish``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from router.turns.items import Event, OpenItem, Sink, copy_item

if TYPE_CHECKING:
    from router.protocol.tools import OfferedTool

_PREFIX = {"mcp": "mcp", "web_search": "ws", "code_interpreter": "ci"}


class RouterCallItem(OpenItem):
    tool: OfferedTool  # the tool it calls, set by the assembler as it makes the item

    def __init__(self, sink: Sink, index: int, kind: str, name: str, server_label: str | None, container: str | None) -> None:
        self.kind = kind
        self.item_name = name  # for web_search: search, open_page or find
        if kind == "mcp":
            item: dict[str, Any] = {"id": sink.ids("mcp"), "type": "mcp_call", "status": "in_progress", "server_label": server_label,
                                    "name": name, "arguments": "", "output": None, "error": None, "approval_request_id": None}
        elif kind == "web_search":
            item = {"id": sink.ids("ws"), "type": "web_search_call", "status": "in_progress", "action": {"type": "search", "query": ""}}
        else:
            item = {"id": sink.ids("ci"), "type": "code_interpreter_call", "status": "in_progress", "code": "",
                    "container_id": container, "outputs": None}
        super().__init__(sink, index, item)
        self._chunks: list[str] = []
        self.arguments: dict[str, Any] = {}
        self.pending = False  # closed by the model, not yet run

    @property
    def _event_prefix(self) -> str:
        return {"mcp": "response.mcp_call", "web_search": "response.web_search_call",
                "code_interpreter": "response.code_interpreter_call"}[self.kind]

    def announce(self, events: list[Event]) -> None:
        super().announce(events)
        events.append(self._event(".in_progress"))

    def add(self, arguments: str, events: list[Event]) -> None:
        self._chunks.append(arguments)
        if self.kind == "mcp":
            events.append(self.sink.event({"type": "response.mcp_call_arguments.delta", **self._ids(), "delta": arguments}))

    def close(self, events: list[Event], status: str) -> None:
        raw = "".join(self._chunks)
        try:
            parsed = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            # harmony's python tool takes the code itself, not JSON
            parsed = {"code": raw} if self.kind == "code_interpreter" else None
        self.arguments = parsed if isinstance(parsed, dict) else {}
        item = self.item
        if self.kind == "mcp":
            item["arguments"] = raw
            events.append(self.sink.event({"type": "response.mcp_call_arguments.done", **self._ids(), "arguments": raw}))
        elif self.kind == "web_search":
            item["action"] = _search_action(self.item_name, self.arguments)
        else:
            item["code"] = code = str(self.arguments.get("code", ""))
            events.append(self.sink.event({"type": "response.code_interpreter_call_code.delta", **self._ids(), "delta": code}))
            events.append(self.sink.event({"type": "response.code_interpreter_call_code.done", **self._ids(), "code": code}))
        if status != "completed" or parsed is None:
            # Cut off or not JSON: it cannot run. Say so and end the item.
            if self.kind == "mcp":
                item["error"] = {"type": "mcp_protocol_error", "code": -32602, "message": "the model's arguments are not a JSON object"}
            self._done(events, "incomplete" if status != "completed" else "failed")
            return
        self.pending = True
        if self.kind == "web_search":
            events.append(self._event(".searching"))
        elif self.kind == "code_interpreter":
            events.append(self._event(".interpreting"))

    def finish(self, events: list[Event], *, output: str | None = None, error: dict[str, Any] | None = None,
               outputs: list[dict[str, Any]] | None = None, sources: list[dict[str, Any]] | None = None) -> None:
        """The runner ran the call: record what came back and end the item."""
        self.pending = False
        item = self.item
        if self.kind == "mcp":
            item["output"], item["error"] = output, error
        elif self.kind == "code_interpreter":
            item["outputs"] = outputs
        elif item["action"]["type"] == "search":
            if sources is not None:
                item["action"]["sources"] = sources
        elif output is not None:
            item["action"]["url"] = output  # open_page / find: the page it read (its sources are only for citations)
        failed = error is not None
        events.append(self._event(".failed" if failed and self.kind == "mcp" else ".completed"))
        self._done(events, "failed" if failed else "completed")

    def abandon(self) -> None:
        self.pending = False
        super().abandon()

    def _ids(self) -> Event:
        return {"item_id": self.item["id"], "output_index": self.index}

    def _event(self, suffix: str) -> Event:
        return self.sink.event({"type": self._event_prefix + suffix, **self._ids()})


def _search_action(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The web_search_call ``action`` for what the model asked: search, open_page or find.

    A page the model named by URL (chat: ``url``; gpt-oss: a URL ``id``) is in it at once; one named by
    number, or the page opened last, once the call ran.
    """
    if name == "open_page":
        url = next((v for v in (arguments.get("url"), arguments.get("id")) if _is_url(v)), None)
        return {"type": "open_page", "url": url}
    if name == "find":
        url = arguments.get("url")
        return {"type": "find_in_page", "pattern": str(arguments.get("pattern", "")), "url": url if _is_url(url) else ""}  # the SDK types url as a string
    return {"type": "search", "query": str(arguments.get("query", ""))}


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


class ApprovalRequestItem(OpenItem):
    """An MCP call the client must approve: it ends the response; the next request answers it."""

    tool: OfferedTool  # the tool it would call, set by the assembler as it makes the item

    def __init__(self, sink: Sink, index: int, name: str, server_label: str | None) -> None:
        super().__init__(sink, index, {"id": sink.ids("mcpr"), "type": "mcp_approval_request", "server_label": server_label,
                                       "name": name, "arguments": ""})
        self._chunks: list[str] = []

    def add(self, arguments: str, events: list[Event]) -> None:
        self._chunks.append(arguments)

    def close(self, events: list[Event], status: str) -> None:
        self.item["arguments"] = "".join(self._chunks)
        self.item.pop("status", None)
        events.append(self.sink.event({"type": "response.output_item.done", "output_index": self.index,
                                       "item": copy_item(self.item, self.sink.include)}))

    def abandon(self) -> None:
        self.item["arguments"] = "".join(self._chunks)


class ListToolsItem(OpenItem):
    """``mcp_list_tools``: what a server offers, listed once per conversation."""

    def __init__(self, sink: Sink, index: int, server_label: str) -> None:
        super().__init__(sink, index, {"id": sink.ids("mcpl"), "type": "mcp_list_tools", "server_label": server_label, "tools": []})

    def announce(self, events: list[Event]) -> None:
        super().announce(events)
        events.append(self.sink.event({"type": "response.mcp_list_tools.in_progress", "item_id": self.item["id"],
                                       "output_index": self.index}))

    def finish(self, events: list[Event], tools: list[dict[str, Any]], error: str | None) -> None:
        """``error``: why listing failed, a string (the API's type for ``mcp_list_tools.error``; an
        ``mcp_call.error`` is an object)."""
        self.item["tools"] = tools
        if error is not None:
            self.item["error"] = error
        kind = "failed" if error is not None else "completed"
        events.append(self.sink.event({"type": f"response.mcp_list_tools.{kind}", "item_id": self.item["id"], "output_index": self.index}))
        events.append(self.sink.event({"type": "response.output_item.done", "output_index": self.index,
                                       "item": copy_item(self.item, self.sink.include)}))

    def close(self, events: list[Event], status: str) -> None:
        self.finish(events, [], "listing did not finish")
