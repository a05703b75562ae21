"""Normalized deltas -> output items and stream events: ONE machine.

The streaming path sends the events; the non-streaming path drops them and
returns ``response``. Both run exactly this code, so they cannot disagree.
Events are plain dicts (a pydantic event per token costs ~4x more).

Ordering rules kept here (DESIGN.md, "Invariants"): ``response.created``
first; an item's ``output_item.added`` before its parts and deltas;
``content_part.added`` before text deltas; dense ``output_index`` in arrival
order; stable item ids; the full ``output`` in the terminal event.
"""

from __future__ import annotations

import time
from typing import Any

from router.dialects.deltas import Delta, Finish, TextDelta, Usage
from router.protocol.errors import APIError
from router.protocol.ids import message_id
from router.protocol.shapes import usage_object

Event = dict[str, Any]


class Assembler:
    """Builds one response from deltas; holds per-request state only."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = response["output"]
        self._seq = 0
        self._message: dict[str, Any] | None = None  # the open message item
        self._chunks: list[str] = []  # text of the open message, joined once at the end
        self._finish: str | None = None
        self._usage: Usage | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> list[Event]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def feed(self, deltas: list[Delta]) -> list[Event]:
        """Events for one upstream read (they leave the router in one write)."""
        events: list[Event] = []
        for delta in deltas:
            if type(delta) is TextDelta:
                if delta.text:
                    self._text(delta.text, events)
            elif type(delta) is Finish:
                self._finish = delta.reason
            elif type(delta) is Usage:
                self._usage = delta
        return events

    def finish(self) -> list[Event]:
        """Close open items and end the response as completed or incomplete."""
        events: list[Event] = []
        cut = self._finish == "length"
        if self._message is None and not self.output:
            self._open_message(events)  # an empty answer is still an answer
        self._close_message(events, "incomplete" if cut else "completed")
        response = self.response
        response["status"] = "incomplete" if cut else "completed"
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["completed_at"] = int(time.time())
        self._set_usage()
        events.append(self._lifecycle("response." + response["status"]))
        return events

    def fail(self, error: APIError) -> list[Event]:
        """An ``error`` event, then ``response.failed`` with what was produced so far."""
        if self._message is not None:
            self._message["status"] = "incomplete"
            self._message["content"][0]["text"] = "".join(self._chunks)
            self._message = None
        response = self.response
        response["status"] = "failed"
        response["error"] = {"code": error.code or error.type, "message": error.message}
        self._set_usage()
        events = [self._event({"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param})]
        events.append(self._lifecycle("response.failed"))
        return events

    # -- items -------------------------------------------------------------

    def _text(self, text: str, events: list[Event]) -> None:
        if self._message is None:
            self._open_message(events)
        self._chunks.append(text)
        message = self._message
        events.append(
            self._event({
                "type": "response.output_text.delta",
                "item_id": message["id"],
                "output_index": self._index,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            })
        )

    def _open_message(self, events: list[Event]) -> None:
        item = {"id": message_id(), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self._index = len(self.output)
        self.output.append(item)
        self._message = item
        self._chunks = []
        events.append(self._event({"type": "response.output_item.added", "output_index": self._index, "item": _copy_item(item)}))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        events.append(
            self._event({
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": self._index,
                "content_index": 0,
                "part": dict(part),
            })
        )

    def _close_message(self, events: list[Event], status: str) -> None:
        item = self._message
        if item is None:
            return
        self._message = None
        part = item["content"][0]
        part["text"] = text = "".join(self._chunks)
        item["status"] = status
        base = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        events.append(self._event({"type": "response.output_text.done", **base, "text": text, "logprobs": []}))
        events.append(self._event({"type": "response.content_part.done", **base, "part": dict(part)}))
        events.append(self._event({"type": "response.output_item.done", "output_index": self._index, "item": _copy_item(item)}))

    # -- helpers -----------------------------------------------------------

    def _set_usage(self) -> None:
        u = self._usage
        if u is not None:
            self.response["usage"] = usage_object(u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens)

    def _lifecycle(self, kind: str) -> Event:
        # A snapshot: later changes to the live response must not leak into sent events.
        snapshot = dict(self.response)
        snapshot["output"] = [_copy_item(item) for item in self.output]
        return self._event({"type": kind, "response": snapshot})

    def _event(self, event: Event) -> Event:
        event["sequence_number"] = self._seq
        self._seq += 1
        return event


def _copy_item(item: dict[str, Any]) -> dict[str, Any]:
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(part) for part in copy["content"]]
    return copy
