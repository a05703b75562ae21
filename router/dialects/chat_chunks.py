"""Reading a chat stream's chunks: a plain text or reasoning chunk becomes its text without being parsed.

Nearly every read of a chat stream is one ``chat.completion.chunk`` that carries
a piece of the answer, or of the reasoning, and nothing else. Parsing it costs
~9k instructions (orjson builds five dicts and a list to hand back one string),
about a fifth of what the router spends on a streamed token. An engine writes
every such chunk of one stream with the same bytes around the text: the same
id, ``created``, model and closing fields. So once one of them has been
parsed, the next ones are recognized by those bytes and the text is sliced out.

Pure: bytes in, a str (``ReasoningText`` for reasoning) or the parsed JSON out;
tested against orjson on random chunks (tests/unit/test_chat_chunks.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from router.dialects.deltas import ReasoningText

NOT_AN_OBJECT = "the worker sent a chunk that is not a JSON object"
_CONTENT = b'"content":"'
_REASONING_KEYS = (b'"reasoning_content":"', b'"reasoning":"')  # SGLang's name, vLLM 0.32's
# Bytes that cannot stand for themselves inside a JSON string: a quote, a backslash, a control character.
_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]')


def chunk_object(payload: bytes) -> dict[str, Any]:
    """A payload parsed, which must be a JSON object (so that a str can only mean text)."""
    chunk = orjson.loads(payload)
    if type(chunk) is not dict:
        raise ValueError(NOT_AN_OBJECT)
    return chunk


def text_only(chunk: Any) -> str | None:
    """The text of a chunk that is nothing but a piece of the answer, else None.

    Nothing but: one choice whose delta has non-empty string ``content`` and no
    reasoning, refusal or tool calls; no logprobs, finish reason or usage. For such a
    chunk ``ChatTurn.chunk`` gives exactly ``[TextDelta(text)]`` and changes no state,
    so a caller may skip it and the delta object. Any other chunk: None (read it with
    ``chunk``). Subscripts under one try, not ``.get`` and type checks: a chunk of
    another shape fails one of them.
    """
    try:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        content = delta["content"]
        if (not content or type(content) is not str or choice.get("finish_reason") or choice.get("logprobs")
                or chunk.get("usage")):
            return None
    except (KeyError, TypeError, ValueError):
        return None
    if len(delta) > 1 and (delta.get("reasoning_content") or delta.get("reasoning") or delta.get("refusal")
                           or delta.get("tool_calls")):
        return None
    return content


def reasoning_only(chunk: Any) -> str | None:
    """The reasoning of a chunk that is nothing but a piece of reasoning, else None.

    Nothing but: one choice whose delta has non-empty string reasoning (``reasoning_content``,
    else ``reasoning``, as ``ChatTurn`` reads it) and no content, refusal or tool calls; no
    logprobs, finish reason or usage. For such a chunk ``ChatTurn.chunk`` gives exactly
    ``[ReasoningDelta(text)]`` and changes no state.
    """
    try:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        reasoning = delta.get("reasoning_content") or delta["reasoning"]
        if (not reasoning or type(reasoning) is not str or choice.get("finish_reason") or choice.get("logprobs")
                or chunk.get("usage") or delta.get("content") or delta.get("refusal") or delta.get("tool_calls")):
            return None
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return reasoning


class ChunkDecoder:
    """Decodes the ``data:`` payloads of one chat stream: ``text_only``'s text for a plain
    text chunk, ``reasoning_only``'s as a ``ReasoningText`` for a plain reasoning chunk,
    else what ``chunk_object`` gives.

    A plain chunk that had to be parsed, its text written without escapes, teaches it
    the stream's ``head`` (the bytes up to the text's opening quote) and ``tail`` (from
    its closing quote to the end), one pair for text and one for reasoning. A later
    payload that is ``head``, bytes that stand for themselves in a JSON string, then
    ``tail``, parses to the same JSON but for the text's value, so it is that chunk's
    text. Anything else, escaped text included, is parsed. A stream's first chunk of
    each kind may differ from the rest (a ``role``), so a few later ones may teach it
    again. One decoder per stream: the head holds the stream's id.
    """

    __slots__ = ("_head", "_tail", "_start", "_end", "_cut", "_lessons",
                 "_rhead", "_rtail", "_rstart", "_rend", "_rcut", "_rlessons")

    def __init__(self) -> None:
        # Answer text: where it starts (len(head)) and ends (-len(tail)); _cut = len(head) + len(tail), 0 until learned.
        self._head = self._tail = b""
        self._start = self._end = self._cut = 0
        self._lessons = 3  # how many more times a parsed text chunk may be learned from
        # Reasoning: the same, flat rather than in an object (attribute loads on every token).
        self._rhead = self._rtail = b""
        self._rstart = self._rend = self._rcut = 0
        self._rlessons = 3

    @property
    def learned(self) -> tuple[bytes, bytes]:
        """The head and tail it recognizes plain text chunks by (empty until learned)."""
        return self._head, self._tail

    @property
    def learned_reasoning(self) -> tuple[bytes, bytes]:
        """The head and tail it recognizes plain reasoning chunks by (empty until learned)."""
        return self._rhead, self._rtail

    def decode(self, payload: bytes) -> Any:
        # Slices compared, not startswith/endswith, and one regex search that finds nothing:
        # measured, the cheapest way here (~4k instructions, against ~9k to parse).
        if self._cut and len(payload) > self._cut:
            start, end = self._start, self._end
            if payload[:start] == self._head and payload[end:] == self._tail:
                content = payload[start:end]
                if _NOT_PLAIN.search(content) is None:
                    try:
                        return content.decode()
                    except UnicodeDecodeError:
                        pass  # not UTF-8: parsing says how the stream is broken
        if self._rcut and len(payload) > self._rcut:
            start, end = self._rstart, self._rend
            if payload[:start] == self._rhead and payload[end:] == self._rtail:
                content = payload[start:end]
                if _NOT_PLAIN.search(content) is None:
                    try:
                        return ReasoningText(content.decode())
                    except UnicodeDecodeError:
                        pass
        return self._parse(payload)

    def _parse(self, payload: bytes) -> Any:
        chunk = chunk_object(payload)
        text = text_only(chunk)
        if text is not None:
            if self._lessons:
                self._lessons -= 1
                learned = _learn(payload, text, (_CONTENT,), text_only)
                if learned is not None:
                    self._head, self._tail = learned
                    self._start, self._end, self._cut = len(learned[0]), -len(learned[1]), sum(map(len, learned))
            return text
        reasoning = reasoning_only(chunk)
        if reasoning is None:
            return chunk
        if self._rlessons:
            self._rlessons -= 1
            learned = _learn(payload, reasoning, _REASONING_KEYS, reasoning_only)
            if learned is not None:
                self._rhead, self._rtail = learned
                self._rstart, self._rend, self._rcut = len(learned[0]), -len(learned[1]), sum(map(len, learned))
        return ReasoningText(reasoning)


def _learn(payload: bytes, text: str, keys: tuple[bytes, ...],
           read: Callable[[Any], str | None]) -> tuple[bytes, bytes] | None:
    """``payload``'s bytes around ``text``, if they are plainly where ``read`` read it.

    Checked, not assumed: the bytes after the first of ``keys`` found must be ``text``
    unescaped, and the same payload with other bytes there must read as those bytes.
    """
    for key in keys:
        start = payload.find(key)
        if start >= 0:
            break
    else:
        return None
    start += len(key)
    end = payload.find(b'"', start)
    content = payload[start:end]
    if end < 0 or content != text.encode() or _NOT_PLAIN.search(content) is not None:
        return None  # escaped, or not the text ``read`` gave
    head, tail = payload[:start], payload[end:]
    probe = content + b"!"
    try:
        if read(orjson.loads(head + probe + tail)) != probe.decode():
            return None  # another key than the one ``read`` reads
    except orjson.JSONDecodeError:
        return None
    return head, tail
