"""SGLang's cumulative generate frames, read as the incremental frames they amount to.

By default SGLang writes every id and all the text generated so far into each
frame of a ``/generate`` stream (REFERENCE.md; late-2025 builds: the text so
far, but only the new ids), so parsing every frame whole costs O(n) per frame
and O(n^2) per stream: measured on the sim, a 3,000-token harmony answer cost
173 us of router CPU per token this way, 70 us as vLLM's incremental frames.
gpt-oss answers often run to thousands of tokens.

Once a frame has been parsed whole, the next is read without what the previous
one held: its bytes up to the text's value, the text so far and the bytes
between the text and the ids must be the previous frame's. Only the rest is
parsed: the frame comes back with ``text`` empty (the harmony dialect reads
ids, never the text) and ``output_ids`` holding the new ids alone, which is
what an incremental frame says: the ids after the previous frame's when the
array begins with those (at an id's end), else the whole array. Either reading
is taken only when sure: the ids so far plus the new ones must make
``meta_info.completion_tokens``, which SGLang counts cumulatively. Anything
else is parsed whole (and taught from).

Pure; tests/unit/test_sglang_frames.py compares it with whole parses on random streams.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from router.dialects.chat_chunks import chunk_object

_TEXT_KEY = b'"text":'
_IDS_KEY = b'"output_ids":'
_WS = b" \t\r\n"
# The rest of a JSON string from a point between characters, through its closing quote.
_STRING_REST = re.compile(rb'(?:[^"\\]|\\.)*"', re.DOTALL)


class CumulativeFrames:
    """Reads one SGLang generate stream's ``data:`` payloads (see the module's docstring)."""

    __slots__ = ("_head", "_text", "_middle", "_ids", "_count")

    def __init__(self) -> None:
        self._head = b""  # the bytes before the text's opening quote; empty until a frame taught it
        self._text = b""  # the text so far: from its opening quote up to its closing one
        self._middle = b""  # the bytes from the text's closing quote to the id array's "["
        self._ids = b""  # the previous frame's id array: from "[" up to "]"
        self._count = 0  # how many ids came so far (its completion_tokens)

    def read(self, payload: bytes) -> Any:
        """The payload parsed (``chunk_object``), or as its incremental frame when it continues the last."""
        if self._head:
            frame = self._continued(payload)
            if frame is not None:
                return frame
        frame = chunk_object(payload)
        self._learn(payload, frame)
        return frame

    def _continued(self, payload: bytes) -> dict[str, Any] | None:
        head, middle = self._head, self._middle
        text_at = len(head)
        if not payload.startswith(head) or not payload.startswith(self._text, text_at):
            return None
        rest = _STRING_REST.match(payload, text_at + len(self._text))
        if rest is None:
            return None
        text_end = rest.end()
        ids_at = text_end + len(middle)
        if not payload.startswith(middle, text_end) or payload[ids_at : ids_at + 1] != b"[":
            return None
        ids_end = payload.find(b"]", ids_at)
        if ids_end < 0:
            return None
        before = b'%s""%s[' % (head, middle)
        new = self._after_ids_so_far(payload, ids_at, ids_end)
        frame = _counted(before + new + payload[ids_end:], self._count) if new is not None else None
        if frame is None:  # the ids are not cumulative (late-2025 builds): the array is all new
            frame = _counted(before + payload[ids_at + 1 :], self._count)
            if frame is None:
                return None
        self._text, self._ids = payload[text_at : text_end - 1], payload[ids_at:ids_end]
        self._count = frame["meta_info"]["completion_tokens"]
        return frame

    def _after_ids_so_far(self, payload: bytes, ids_at: int, ids_end: int) -> bytes | None:
        """The bytes of the ids after the previous frame's, if the array begins with those; else None."""
        if not payload.startswith(self._ids, ids_at) or ids_at + len(self._ids) > ids_end:
            return None
        new = payload[ids_at + len(self._ids) : ids_end]
        if self._ids == b"[":
            return new
        new = new.lstrip(_WS)  # after the ids so far: nothing, or a comma and more
        if not new:
            return new
        if new[0] != 44:  # ","
            return None  # the last id so far goes on (12 -> 123): not a continuation
        return new[1:]

    def _learn(self, payload: bytes, frame: dict[str, Any]) -> None:
        """Where a whole frame's text and ids are, if they are plainly there; else nothing is kept."""
        self._head = b""
        text, ids = frame.get("text"), frame.get("output_ids")
        if type(text) is not str or type(ids) is not list:
            return
        text_at, ids_at = _value(payload, _TEXT_KEY, b'"'), _value(payload, _IDS_KEY, b"[")
        if text_at < 0 or ids_at < text_at:
            return
        rest = _STRING_REST.match(payload, text_at + 1)
        ids_end = payload.find(b"]", ids_at)
        if rest is None or rest.end() > ids_at or ids_end < 0:
            return
        text_end = rest.end()
        try:  # checked, not assumed: these bytes are the frame's text and ids
            if orjson.loads(payload[text_at:text_end]) != text or orjson.loads(payload[ids_at : ids_end + 1]) != ids:
                return
        except orjson.JSONDecodeError:
            return
        self._head, self._middle = payload[:text_at], payload[text_end:ids_at]
        meta = frame.get("meta_info")
        done = meta.get("completion_tokens") if type(meta) is dict else None
        self._text, self._ids = payload[text_at : text_end - 1], payload[ids_at:ids_end]
        self._count = done if type(done) is int else len(ids)


def _counted(data: bytes, count: int) -> dict[str, Any] | None:
    """``data`` parsed, if it is a frame whose ids are new ones that, after ``count`` so far,
    make its ``completion_tokens``; else None."""
    try:
        frame = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(frame) is not dict:
        return None
    ids, meta = frame.get("output_ids"), frame.get("meta_info")
    done = meta.get("completion_tokens") if type(meta) is dict else None
    if type(ids) is not list or type(done) is not int or count + len(ids) != done:
        return None
    return frame


def _value(payload: bytes, key: bytes, opens: bytes) -> int:
    """Where the value of the first ``key`` starts, if it opens with ``opens``; else -1."""
    at = payload.find(key)
    if at < 0:
        return -1
    at += len(key)
    while at < len(payload) and payload[at] in _WS:
        at += 1
    return at if payload[at : at + 1] == opens else -1
