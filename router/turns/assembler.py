"""Normalized deltas -> output items and stream events: ONE machine.

The streaming path sends the events; the non-streaming path drops them and
returns ``response``. Both run exactly this code, so they cannot disagree.
Events are plain dicts (a pydantic event per token costs ~4x more).

Ordering rules kept here (as OpenAI streams them): ``response.created``
first; an item's ``output_item.added`` before its parts and deltas;
``content_part.added`` before text deltas; dense ``output_index`` in arrival
order; stable item ids; the full ``output`` in the terminal event.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection
from typing import Any

from router.dialects.deltas import Delta, Finish, ReasoningDelta, RefusalDelta, TextDelta, ToolCallDelta, Usage
from router.protocol.errors import APIError
from router.protocol.ids import ItemIds, new_id
from router.protocol.shapes import response_error, usage_object
from router.protocol.tools import ROUTER_KINDS, ToolSet
from router.turns.items import CallItem, MessageItem, ReasoningItem, copy_item
from router.turns.tool_items import ApprovalRequestItem, ListToolsItem, RouterCallItem

Event = dict[str, Any]

# The reasoning text events' names (delta, done): OpenAI's, which the openai SDK types, and the Open
# Responses specification's (its schema/events.tsp: ResponseReasoningDeltaStreamingEvent and
# ResponseReasoningDoneStreamingEvent, the same fields). docs/api.md "Reasoning event names".
OPENAI_REASONING = ("response.reasoning_text.delta", "response.reasoning_text.done")
OPEN_RESPONSES_REASONING = ("response.reasoning.delta", "response.reasoning.done")
REASONING_EVENTS = {"openai": OPENAI_REASONING, "open-responses": OPEN_RESPONSES_REASONING}


class Assembler:
    """Builds one response from deltas; holds per-request state only."""

    # The names of reasoning text events: set before the first event for another vocabulary
    # (REASONING_EVENTS); a reasoning item takes them when it opens, so no streamed token pays for it.
    reasoning_events: tuple[str, str] = OPENAI_REASONING
    # stream_options.include_obfuscation: delta events carry an ``obfuscation`` field (``obfuscate``).
    obfuscating = False
    _pad = ""

    def __init__(self, response: dict[str, Any], *, tools: ToolSet | None = None, summaries: bool = False,
                 encrypt_reasoning: Callable[[str], str] | None = None, ids: ItemIds | None = None, include: Collection[str] = ()) -> None:
        self.response = response
        self.include = frozenset(include)  # the request's: what its events show of the items (the items keep all)
        self.ids = ids or ItemIds(response["id"])  # shared with whatever named the response's input items
        self.output: list[dict[str, Any]] = response["output"]
        self._tools = tools or ToolSet()
        self._summaries = summaries  # reasoning.summary was asked for
        self._encrypt_reasoning = encrypt_reasoning  # reasoning text -> encrypted_content, for clients that keep no state here
        self._seq = 0
        self._open: MessageItem | ReasoningItem | None = None  # the open text-like item
        self._calls: dict[int, Any] = {}  # open tool calls of this turn, by delta index
        self.last_turn_calls: list[Any] = []
        self.sources: dict[str, str] = {}  # url -> title, from this response's web searches (for citations)
        self._container: str | None = None  # the calls of the last closed turn (client and router ones)
        self._cut = False  # the engine stopped on the token budget
        self._turn_usage: Usage | None = None
        self._usage: list[int] | None = None  # input, output, cached, reasoning: summed over turns

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> list[Event]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def queued(self) -> list[Event]:
        """A background response's first events: created and queued, status ``queued``."""
        self.response["status"] = "queued"
        return [self._lifecycle("response.created"), self._lifecycle("response.queued")]

    def begin(self) -> list[Event]:
        """A queued response starts running."""
        self.response["status"] = "in_progress"
        return [self._lifecycle("response.in_progress")]

    def feed(self, deltas: list[Delta]) -> list[Event]:
        """Events for one upstream read (they leave the router in one write)."""
        events: list[Event] = []
        for delta in deltas:
            kind = type(delta)
            if kind is TextDelta:
                if delta.text:  # type: ignore[union-attr]
                    self._message(delta.phase, events).add_text(delta.text, delta.logprobs, events)  # type: ignore[union-attr]
            elif kind is ReasoningDelta:
                if delta.text:  # type: ignore[union-attr]
                    self._reasoning(events).add(delta.text, events)  # type: ignore[union-attr]
            elif kind is ToolCallDelta:
                self._tool_call(delta, events)  # type: ignore[arg-type]
            elif kind is RefusalDelta:
                if delta.text:  # type: ignore[union-attr]
                    self._message(None, events).add_refusal(delta.text, events)  # type: ignore[union-attr]
            elif kind is Finish:
                self._cut = delta.reason == "length"  # type: ignore[union-attr]
            elif kind is Usage:
                self._turn_usage = delta  # type: ignore[assignment]
        return events

    def text(self, text: str) -> list[Event] | None:
        """``feed([TextDelta(text)])`` for non-empty ``text`` when an answer message's output_text
        part is open (every streamed token but the first), else None: then ``feed`` it.

        The runner's per-token fast path: no delta object, no dispatch, no part check, and the
        event a copy of the part's ``text_delta`` with two fields set, numbered here (measured:
        ~0.5k instructions less than a call into the item for it)."""
        item = self._open
        if type(item) is not MessageItem or item.phase is not None or item.part != "output_text":
            return None
        item.chunks.append(text)
        event = (item.text_delta or item.text_delta_of_part()).copy()
        event["delta"] = text
        event["sequence_number"] = self._seq
        self._seq += 1
        return [event]

    def reasoning(self, text: str) -> list[Event] | None:
        """``feed([ReasoningDelta(text)])`` for non-empty ``text`` when a reasoning item is open
        (every piece of a streamed chain of thought but the first), else None: then ``feed`` it.
        The per-token fast path for reasoning, as ``text`` is for the answer."""
        item = self._open
        if type(item) is not ReasoningItem:
            return None
        item.chunks.append(text)
        event = item.delta_event.copy()
        event["delta"] = text
        event["sequence_number"] = self._seq
        self._seq += 1
        return [event]

    def close_turn(self) -> list[Event]:
        """End one model turn: close every open item; returns the closing events."""
        events: list[Event] = []
        status = "incomplete" if self._cut else "completed"
        self._close_open(events, status)
        for call in self._calls.values():
            call.close(events, status)
        self.last_turn_calls = list(self._calls.values())
        self._calls = {}
        u = self._turn_usage
        if u is not None:
            total = self._usage or [0, 0, 0, 0]
            self._usage = [a + b for a, b in zip(total, (u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens))]
            self._turn_usage = None
        return events

    @property
    def turn_calls(self) -> list[dict[str, Any]]:
        """Tool-call items of the last closed turn (the runner decides who runs them)."""
        return [item for item in self.output if item["type"] in ("function_call", "custom_tool_call")]

    def finish(self, incomplete_reason: str | None = None) -> list[Event]:
        """Close open items and end the response as completed or incomplete."""
        events: list[Event] = []
        if not self.output and self._open is None and not self._calls:
            self._message(None, events).ensure_part(events)  # an empty answer is still an answer
        if self._cut and incomplete_reason is None:
            incomplete_reason = "max_output_tokens"
        events += self.close_turn()
        response = self.response
        response["status"] = "incomplete" if incomplete_reason else "completed"
        if incomplete_reason:
            response["incomplete_details"] = {"reason": incomplete_reason}
        response["completed_at"] = int(time.time())
        self._set_usage()
        events.append(self._lifecycle("response." + response["status"]))
        return events

    def cancel(self) -> list[Event]:
        """Stopped on request: what was produced stays, marked incomplete; status ``cancelled``."""
        self._abandon_open()
        self.response["status"] = "cancelled"
        self._set_usage()
        return [self._lifecycle("response.cancelled")]

    def _abandon_open(self) -> None:
        if self._open is not None:
            self._open.abandon()
            self._open = None
        for call in self._calls.values():
            call.abandon()
        self._calls = {}
        for call in self.last_turn_calls:  # router-run calls of a closed turn, stopped while they ran
            if isinstance(call, RouterCallItem) and call.pending:
                call.abandon()

    @property
    def sequence(self) -> int:
        """The next event's sequence number: it moves with every event."""
        return self._seq

    def checkpoint(self) -> list[dict[str, Any]]:
        """The output so far as a response that ended now would have it (open items ``incomplete``,
        their text so far), the live state unchanged: a running stream's checkpoint."""
        open_items = {id(call.item): call for call in self._calls.values()}
        if self._open is not None:
            open_items[id(self._open.item)] = self._open
        return [open_items[id(item)].snapshot() if id(item) in open_items else item for item in self.response["output"]]

    def fail(self, error: APIError) -> list[Event]:
        """An ``error`` event, then ``response.failed`` with what was produced so far."""
        self._abandon_open()
        response = self.response
        response["status"] = "failed"
        response["error"] = response_error(error.code or error.type, error.message)
        if self._turn_usage is not None:
            self.close_turn()
        self._set_usage()
        events = [self.event({"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param})]
        events.append(self._lifecycle("response.failed"))
        return events

    # -- items -------------------------------------------------------------

    def _message(self, phase: str | None, events: list[Event]) -> MessageItem:
        current = self._open
        if type(current) is MessageItem and current.phase == phase:
            return current
        self._close_open(events, "completed")
        item = MessageItem(self, len(self.output), phase)
        self._open = item
        item.announce(events)
        return item

    def _reasoning(self, events: list[Event]) -> ReasoningItem:
        current = self._open
        if type(current) is ReasoningItem:
            return current
        self._close_open(events, "completed")
        item = ReasoningItem(self, len(self.output), self._summaries, self._encrypt_reasoning)
        self._open = item
        item.announce(events)
        return item

    def _tool_call(self, delta: ToolCallDelta, events: list[Event]) -> None:
        call = self._calls.get(delta.index)
        if call is None:
            self._close_open(events, "completed")
            tool = self._tools.lookup(delta.name or "")
            index = len(self.output)
            if tool is not None and tool.kind in ROUTER_KINDS:
                if tool.kind == "mcp" and tool.approval:
                    call = ApprovalRequestItem(self, index, tool.name, tool.server_label)
                else:
                    container = None
                    if tool.kind == "code_interpreter":  # one container per response unless the request names one
                        container = self._container = self._container or _container_id(tool.config)
                    call = RouterCallItem(self, index, tool.kind, tool.name, tool.server_label, container)
                call.tool = tool
            else:
                kind = tool.kind if tool else "function"
                name = tool.name if tool else (delta.name or "")
                call = CallItem(self, index, kind, delta.call_id or "", name, tool.namespace if tool else None)
            self._calls[delta.index] = call
            call.announce(events)
        if delta.arguments:
            call.add(delta.arguments, events)

    def _close_open(self, events: list[Event], status: str) -> None:
        if self._open is not None:
            self._open.close(events, status)
            self._open = None

    def router_call(self, kind: str, name: str, server_label: str | None, arguments: str) -> tuple[RouterCallItem, list[Event]]:
        """A router-run call that did not come from the model (an approved MCP call): announced, pending."""
        events: list[Event] = []
        item = RouterCallItem(self, len(self.output), kind, name, server_label, None)
        item.announce(events)
        item.add(arguments, events)
        item.close(events, "completed")
        return item, events

    def add_done(self, item: dict[str, Any]) -> list[Event]:
        """An item made whole elsewhere (a compaction): added and done at once."""
        index = len(self.output)
        self.output.append(item)
        return [self.event({"type": "response.output_item.added", "output_index": index, "item": copy_item(item)}),
                self.event({"type": "response.output_item.done", "output_index": index, "item": copy_item(item)})]

    def add_usage(self, usage: Usage) -> None:
        """Tokens spent outside the model turns (a compaction's summary), counted in the response's usage."""
        total = self._usage or [0, 0, 0, 0]
        self._usage = [a + b for a, b in zip(total, (usage.input_tokens, usage.output_tokens, usage.cached_tokens,
                                                      usage.reasoning_tokens))]

    def list_tools(self, server_label: str) -> tuple[ListToolsItem, list[Event]]:
        """Announce an MCP server's listing; the runner finishes it once the server answered."""
        events: list[Event] = []
        item = ListToolsItem(self, len(self.output), server_label)
        item.announce(events)
        return item, events

    # -- helpers -----------------------------------------------------------

    def _set_usage(self) -> None:
        if self._usage is not None:
            self.response["usage"] = usage_object(*self._usage)

    def _lifecycle(self, kind: str) -> Event:
        # A snapshot: later changes to the live response must not leak into sent events.
        snapshot = dict(self.response)
        snapshot["output"] = [copy_item(item, self.include) for item in self.output]
        return self.event({"type": kind, "response": snapshot})

    def event(self, event: Event) -> Event:
        event["sequence_number"] = self._seq
        self._seq += 1
        return event

    def obfuscate(self) -> None:
        """``stream_options.include_obfuscation``, as OpenAI's: from now on every event with a text
        ``delta`` carries ``obfuscation``, random URL-safe characters (a slice of 4,096 drawn per
        response, moving with each event) that pad the delta to a multiple of 16 characters (1 to 16
        of them), so a stream's frame sizes do not show its tokens' lengths. Its events take ``event``
        below; the per-token fast paths (``text``, ``reasoning``) are not used then (turns/reader.py),
        so a stream without it pays nothing."""
        self.obfuscating = True
        self._pad = secrets.token_urlsafe(3072)  # 4,096 characters
        self.event = self._padded  # type: ignore[method-assign]

    def _padded(self, event: Event) -> Event:
        delta = event.get("delta")
        if type(delta) is str:
            start = self._seq * 17 % 4080
            event["obfuscation"] = self._pad[start:start + 16 - len(delta) % 16]
        event["sequence_number"] = self._seq
        self._seq += 1
        return event


def _container_id(config: dict[str, Any] | None) -> str:
    """The container a code_interpreter call runs in: the request's id, or a fresh one for "auto"."""
    container = (config or {}).get("container")
    if isinstance(container, str) and container not in ("", "auto"):
        return container
    if isinstance(container, dict) and isinstance(container.get("id"), str):
        return container["id"]
    return new_id("cntr")
