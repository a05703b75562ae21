"""Reading a chat stream's chunks: a plain text chunk becomes its text without being parsed.

Nearly every read of a chat stream is one ``chat.completion.chunk`` that carries
a piece of the answer and nothing else. Parsing it costs ~9k instructions
(orjson builds five dicts and a list to hand back one string), about a fifth
of what the router spends on a streamed token. An engine writes every such
chunk of one stream with the same bytes around the content: the same id,
``created``, model and closing fields. So once one of them has been parsed,
the next ones are recognized by those bytes and the content is sliced out.

Pure: bytes in, a str or the parsed JSON out; tested against orjson on
random chunks (tests/test_chat_chunks.py).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

NOT_AN_OBJECT = "the worker sent a chunk that is not a JSON object"
_CONTENT = b'"content":"'
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


class ChunkDecoder:
    """Decodes the ``data:`` payloads of one chat stream: ``text_only``'s text for a plain
    text chunk, else what ``chunk_object`` gives.

    A plain text chunk that had to be parsed, its content written without escapes,
    teaches it the stream's ``head`` (the bytes up to the content's opening quote)
    and ``tail`` (from its closing quote to the end). A later payload that is
    ``head``, bytes that stand for themselves in a JSON string, then ``tail``,
    parses to the same JSON but for the content's value, so it is that chunk's
    text. Anything else, escaped content included, is parsed. A stream's first
    text chunk may differ from the rest (a ``role``), so a few later ones may
    teach it again. One decoder per stream: the head holds the stream's id.
    """

    __slots__ = ("_head", "_tail", "_start", "_end", "_cut", "_lessons")

    def __init__(self) -> None:
        self._head = b""
        self._tail = b""
        self._start = self._end = 0  # where the content starts (len(head)) and ends (-len(tail))
        self._cut = 0  # len(head) + len(tail); 0 until learned
        self._lessons = 3  # how many more times a parsed text chunk may be learned from

    @property
    def learned(self) -> tuple[bytes, bytes]:
        """The head and tail it recognizes plain text chunks by (empty until learned)."""
        return self._head, self._tail

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
        chunk = chunk_object(payload)
        text = text_only(chunk)
        if text is None:
            return chunk
        if self._lessons:
            self._lessons -= 1
            self._learn(payload, text)
        return text

    def _learn(self, payload: bytes, text: str) -> None:
        """Keep ``payload``'s bytes around ``text`` if they are plainly where ``text_only`` read it.

        Checked, not assumed: the bytes after the first ``"content":"`` must be ``text``
        unescaped, and the same payload with other bytes there must read as those bytes.
        """
        start = payload.find(_CONTENT)
        if start < 0:
            return
        start += len(_CONTENT)
        end = payload.find(b'"', start)
        content = payload[start:end]
        if end < 0 or content != text.encode() or _NOT_PLAIN.search(content) is not None:
            return  # escaped, or not the content text_only read
        head, tail = payload[:start], payload[end:]
        probe = content + b"!"
        try:
            if text_only(orjson.loads(head + probe + tail)) != probe.decode():
                return  # another "content" than the one text_only read
        except orjson.JSONDecodeError:
            return
        self._head, self._tail = head, tail
        self._start, self._end, self._cut = len(head), -len(tail), len(head) + len(tail)
