"""The output items the assembler builds, each with its own event vocabulary.

An item is appended to ``output`` when announced (``output_item.added``),
grows with deltas, and is closed (``*.done`` events, ``output_item.done``)
or abandoned (a failed response keeps it as ``incomplete``, without done events).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

import orjson

from router.protocol.shapes import VIEWED, item_view

Event = dict[str, Any]


class Sink(Protocol):
    output: list[dict[str, Any]]
    sources: dict[str, str]  # url -> title of pages a web search returned in this response
    include: frozenset[str]  # the request's ``include``: what the items its events carry show
    reasoning_events: tuple[str, str]  # the names of reasoning text events: delta, done (turns/assembler.py)

    def ids(self, prefix: str) -> str: ...  # a new item's id (the response's ItemIds)

    def event(self, event: Event) -> Event: ...


def copy_item(item: dict[str, Any], include: Collection[str] = frozenset()) -> dict[str, Any]:
    """An item as an event carries it: a snapshot (later changes to the item stay out of it), showing
    what ``include`` asks for (router/protocol/shapes.py ``item_view``; the item keeps all of it)."""
    copy = dict(item)
    for key in ("content", "summary"):
        if key in copy:
            copy[key] = [dict(part) for part in copy[key]]
    return item_view(copy, include) if copy.get("type") in VIEWED else copy


class OpenItem:
    def __init__(self, sink: Sink, index: int, item: dict[str, Any]) -> None:
        self.sink = sink
        self.index = index
        self.item = item

    def announce(self, events: list[Event]) -> None:
        self.sink.output.append(self.item)
        events.append(self.sink.event({"type": "response.output_item.added", "output_index": self.index,
                                       "item": copy_item(self.item, self.sink.include)}))

    def _done(self, events: list[Event], status: str) -> None:
        self.item["status"] = status
        events.append(self.sink.event({"type": "response.output_item.done", "output_index": self.index,
                                       "item": copy_item(self.item, self.sink.include)}))

    def _base(self, content_index: int) -> Event:
        return {"item_id": self.item["id"], "output_index": self.index, "content_index": content_index}

    def close(self, events: list[Event], status: str) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        self.item["status"] = "incomplete"

    def snapshot(self) -> dict[str, Any]:
        """A copy of the item as ``abandon`` would leave it now, the item itself unchanged: what a
        checkpoint of a running response stores (router/turns/runner.py ``checkpoint``)."""
        return {**self.item, "status": "incomplete"}


class MessageItem(OpenItem):
    """An assistant message: output_text and refusal parts."""

    def __init__(self, sink: Sink, index: int, phase: str | None) -> None:
        item: dict[str, Any] = {"id": sink.ids("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        if phase is not None:
            item["phase"] = phase
        super().__init__(sink, index, item)
        self.phase = phase
        self.part: str | None = None  # the open part's type, None between parts
        self.chunks: list[str] = []  # the open part's text so far
        # The open output_text part's delta event, its delta and number still to set: Assembler.text
        # copies it per streamed token (measured: ~1.5k instructions less than a literal like add_text's).
        # Made on first use, so that a non-streamed answer does not pay for it.
        self.text_delta: Event | None = None

    def ensure_part(self, events: list[Event], kind: str = "output_text") -> None:
        if self.part == kind:
            return
        self._close_part(events)
        part: dict[str, Any] = (
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "output_text" else {"type": "refusal", "refusal": ""}
        )
        self.item["content"].append(part)
        self.part = kind
        self.text_delta = None
        events.append(self.sink.event({"type": "response.content_part.added", **self._base(self._part_index), "part": dict(part)}))

    def text_delta_of_part(self) -> Event:
        """``text_delta`` for the open output_text part, made now.

        Its ``logprobs`` is ``()``, which orjson writes as ``[]`` like a list: a dict holding
        only atoms is not tracked by the garbage collector, which halves the cost of each
        copy, and no list is made per token (measured with bench/token_path.py: ~0.4k
        instructions less per streamed token)."""
        self.text_delta = {"type": "response.output_text.delta", "item_id": self.item["id"], "output_index": self.index,
                           "content_index": self._part_index, "delta": "", "logprobs": (), "sequence_number": 0}
        return self.text_delta

    @property
    def _part_index(self) -> int:
        return len(self.item["content"]) - 1

    def add_text(self, text: str, logprobs: list[dict[str, Any]] | None, events: list[Event]) -> None:
        self.ensure_part(events, "output_text")
        self.chunks.append(text)
        if logprobs:
            self.item["content"][-1]["logprobs"].extend(logprobs)
        # Built in one literal (no _base merge); a plain streamed token's takes Assembler.text instead.
        events.append(self.sink.event({"type": "response.output_text.delta", "item_id": self.item["id"],
                                       "output_index": self.index, "content_index": len(self.item["content"]) - 1,
                                       "delta": text, "logprobs": logprobs or []}))

    def add_refusal(self, text: str, events: list[Event]) -> None:
        self.ensure_part(events, "refusal")
        self.chunks.append(text)
        events.append(self.sink.event({"type": "response.refusal.delta", **self._base(self._part_index), "delta": text}))

    def _close_part(self, events: list[Event]) -> None:
        if self.part is None:
            return
        part = self.item["content"][-1]
        text = "".join(self.chunks)
        base = self._base(self._part_index)
        if self.part == "output_text":
            part["text"] = text
            for annotation in _citations(text, self.sink.sources):
                part["annotations"].append(annotation)
                events.append(self.sink.event({"type": "response.output_text.annotation.added", **base,
                                               "annotation_index": len(part["annotations"]) - 1, "annotation": annotation}))
            events.append(self.sink.event({"type": "response.output_text.done", **base, "text": text, "logprobs": part["logprobs"]}))
        else:
            part["refusal"] = text
            events.append(self.sink.event({"type": "response.refusal.done", **base, "refusal": text}))
        events.append(self.sink.event({"type": "response.content_part.done", **base, "part": dict(part)}))
        self.part = None
        self.chunks = []

    def close(self, events: list[Event], status: str) -> None:
        if not self.item["content"]:
            self.ensure_part(events)  # a message always has a part, even an empty one
        self._close_part(events)
        self._done(events, status)

    def abandon(self) -> None:
        if self.part is not None:
            self.item["content"][-1]["text" if self.part == "output_text" else "refusal"] = "".join(self.chunks)
        super().abandon()

    def snapshot(self) -> dict[str, Any]:
        copy = super().snapshot()
        copy["content"] = [dict(part) for part in self.item["content"]]
        if self.part is not None and copy["content"]:
            copy["content"][-1]["text" if self.part == "output_text" else "refusal"] = "".join(self.chunks)
        return copy


class ReasoningItem(OpenItem):
    """Chain-of-thought as ``reasoning_text`` content, plus a summary part when asked for."""

    def __init__(self, sink: Sink, index: int, summaries: bool, encrypt: Callable[[str], str] | None = None) -> None:
        super().__init__(sink, index, {"id": sink.ids("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"})
        self._summaries = summaries
        self._encrypt = encrypt  # reasoning text -> encrypted_content
        self.chunks: list[str] = []
        # The delta event, its delta and number still to set: copied per piece of reasoning, here and
        # in Assembler.reasoning (the runner's per-token fast path).
        self.delta_event: Event = {"type": sink.reasoning_events[0], **self._base(0), "delta": "", "sequence_number": 0}

    def announce(self, events: list[Event]) -> None:
        super().announce(events)
        part = {"type": "reasoning_text", "text": ""}
        self.item["content"].append(part)
        events.append(self.sink.event({"type": "response.content_part.added", **self._base(0), "part": dict(part)}))

    def add(self, text: str, events: list[Event]) -> None:
        self.chunks.append(text)
        event = self.delta_event.copy()
        event["delta"] = text
        events.append(self.sink.event(event))

    def close(self, events: list[Event], status: str) -> None:
        text = "".join(self.chunks)
        part = self.item["content"][0]
        part["text"] = text
        base = self._base(0)
        events.append(self.sink.event({"type": self.sink.reasoning_events[1], **base, "text": text}))
        events.append(self.sink.event({"type": "response.content_part.done", **base, "part": dict(part)}))
        if self._summaries:
            self._summary(text, events)
        if self._encrypt is not None:
            self.item["encrypted_content"] = self._encrypt(text)
        self._done(events, status)

    def _summary(self, text: str, events: list[Event]) -> None:
        # No summarizer model: the summary is the reasoning itself, streamed as one piece.
        base = {"item_id": self.item["id"], "output_index": self.index, "summary_index": 0}
        events.append(self.sink.event({"type": "response.reasoning_summary_part.added", **base, "part": {"type": "summary_text", "text": ""}}))
        events.append(self.sink.event({"type": "response.reasoning_summary_text.delta", **base, "delta": text}))
        events.append(self.sink.event({"type": "response.reasoning_summary_text.done", **base, "text": text}))
        summary = {"type": "summary_text", "text": text}
        self.item["summary"].append(summary)
        events.append(self.sink.event({"type": "response.reasoning_summary_part.done", **base, "part": dict(summary)}))

    def abandon(self) -> None:
        self.item["content"][0]["text"] = "".join(self.chunks)
        super().abandon()

    def snapshot(self) -> dict[str, Any]:
        copy = super().snapshot()
        copy["content"] = [dict(part) for part in self.item["content"]]
        if copy["content"]:
            copy["content"][0]["text"] = "".join(self.chunks)
        return copy


class CallItem(OpenItem):
    """A ``function_call`` (arguments streamed) or a ``custom_tool_call`` (input sent when complete)."""

    def __init__(self, sink: Sink, index: int, kind: str, call_id: str, name: str, namespace: str | None) -> None:
        if kind == "custom":
            item: dict[str, Any] = {"id": sink.ids("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": call_id,
                                    "name": name, "input": ""}
        else:
            item = {"id": sink.ids("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id, "name": name,
                    "arguments": ""}
        if namespace is not None:
            item["namespace"] = namespace
        super().__init__(sink, index, item)
        self._custom = kind == "custom"
        self._chunks: list[str] = []

    def add(self, arguments: str, events: list[Event]) -> None:
        self._chunks.append(arguments)
        if not self._custom:
            events.append(self.sink.event({"type": "response.function_call_arguments.delta", "item_id": self.item["id"],
                                           "output_index": self.index, "delta": arguments}))

    def close(self, events: list[Event], status: str) -> None:
        arguments = "".join(self._chunks)
        base = {"item_id": self.item["id"], "output_index": self.index}
        if self._custom:
            self.item["input"] = text = _custom_input(arguments)
            if text:
                events.append(self.sink.event({"type": "response.custom_tool_call_input.delta", **base, "delta": text}))
            events.append(self.sink.event({"type": "response.custom_tool_call_input.done", **base, "input": text}))
        else:
            self.item["arguments"] = arguments
            events.append(self.sink.event({"type": "response.function_call_arguments.done", **base, "arguments": arguments,
                                           "name": self.item["name"]}))
        self._done(events, status)

    def abandon(self) -> None:
        # A custom call's input streams only once it is whole (it is unwrapped from the function's
        # {"input": ...}): cut off, it keeps none, as its events (and a replay of them) show it.
        if not self._custom:
            self.item["arguments"] = "".join(self._chunks)
        super().abandon()

    def snapshot(self) -> dict[str, Any]:
        copy = super().snapshot()
        if not self._custom:
            copy["arguments"] = "".join(self._chunks)
        return copy


def _custom_input(arguments: str) -> str:
    """Custom tools are offered as functions taking {"input": str}; unwrap it (raw text if the model broke the JSON)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def _citations(text: str, sources: dict[str, str]) -> list[dict[str, Any]]:
    """``url_citation`` annotations where the answer quotes a URL a web search of this response returned."""
    found = []
    for url, title in sources.items():
        start = text.find(url)
        while start >= 0:
            found.append({"type": "url_citation", "url": url, "title": title, "start_index": start, "end_index": start + len(url)})
            start = text.find(url, start + len(url))
    return sorted(found, key=lambda a: a["start_index"])
