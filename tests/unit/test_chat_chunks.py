"""ChunkDecoder against parsing: whatever bytes come, it reads what orjson, text_only and
reasoning_only read.

The decoder slices a plain text (or reasoning) chunk's text out of bytes it recognizes
instead of parsing them. These properties feed it streams of chunks written the ways engines
write them (compact, spaced, ASCII-escaped), and payloads made from a learned
head and tail with any bytes between them: quotes, backslashes, control
characters, invalid UTF-8.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.dialects.chat_chunks import NOT_AN_OBJECT, ChunkDecoder, chunk_object, reasoning_only, text_only
from router.dialects.deltas import ReasoningText
from tests.unit.test_fast_path import any_chunk, edge_chunk, plain_chunk, reasoning_chunk, reasoning_edge


def reference(payload: bytes) -> tuple[str, Any]:
    """What parsing gives: the text of a plain text chunk, else the chunk; or the error."""
    try:
        chunk = chunk_object(payload)
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    text = text_only(chunk)
    if text is not None:
        return "text", text
    reasoning = reasoning_only(chunk)
    return ("reasoning", reasoning) if reasoning is not None else ("chunk", chunk)


def decoded(decoder: ChunkDecoder, payload: bytes) -> tuple[str, Any]:
    try:
        out = decoder.decode(payload)
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    if type(out) is ReasoningText:
        return "reasoning", str(out)
    return ("text", out) if type(out) is str else ("chunk", out)


writers = st.sampled_from([
    orjson.dumps,
    lambda c: json.dumps(c).encode(),  # spaces after separators, non-ASCII escaped
    lambda c: json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode(),
    lambda c: json.dumps(c, separators=(",", ":")).encode() + b" ",
])
chunk = st.one_of(plain_chunk, plain_chunk, plain_chunk, edge_chunk, any_chunk, reasoning_chunk, reasoning_chunk,
                  reasoning_edge, st.sampled_from([[], "x", 5, None, {"choices": "a"}, {"content": "x"}]))
junk = st.sampled_from([b"", b"{", b'"text"', b"[1]", b"{\xff}", b'{"a": 1} }', b"nul"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.tuples(chunk, writers).map(lambda cw: cw[1](cw[0])), junk), min_size=1, max_size=12))
def test_a_stream_of_payloads_reads_as_parsed(payloads: list[bytes]) -> None:
    decoder = ChunkDecoder()
    assert [decoded(decoder, p) for p in payloads] == [reference(p) for p in payloads]


HEAD = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"'
TAIL = b'"},"logprobs":null,"finish_reason":null}]}'


RHEADS = [HEAD.replace(b'"content"', key) for key in (b'"reasoning"', b'"reasoning_content"')]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=6), st.text(max_size=4).map(str.encode),
                          st.sampled_from([b'"', b"\\", b'\\"', b"\\n", b"\\u0041", b"\n", b"\x00", b"\xe2\x82",
                                           b'","finish_reason":"stop', b'"},"x":{"content":"y',
                                           b'","content":"y', b'","reasoning_content":"y'])),
                min_size=1, max_size=8), st.sampled_from([HEAD, *RHEADS]))
@example([b"a", b'\\"'], HEAD)
@example([b"a", b'"},"logprobs":null,"finish_reason":"stop"}]}{"x":"'], HEAD)
@example([b"a", b'","content":"y'], RHEADS[0])
def test_any_bytes_between_a_learned_head_and_tail_read_as_parsed(contents: list[bytes], head: bytes) -> None:
    decoder = ChunkDecoder()
    first = decoder.decode(head + b"learned" + TAIL)
    assert first == "learned" and (type(first) is str) == (head == HEAD)
    assert (decoder.learned if head == HEAD else decoder.learned_reasoning) == (head, TAIL)
    for content in contents:
        payload = head + content + TAIL
        assert decoded(decoder, payload) == reference(payload)


def test_the_learned_head_and_tail_skip_the_parser() -> None:
    decoder = ChunkDecoder()
    first = HEAD.replace(b'"delta":{', b'"delta":{"role":"assistant",') + b"Hi" + TAIL
    assert decoder.decode(first) == "Hi"  # a stream's first chunk: its role makes other bytes
    assert decoder.decode(HEAD + b" there" + TAIL) == " there"  # parsed, and learned from
    assert decoder.learned == (HEAD, TAIL)
    with mock.patch("router.dialects.chat_chunks.chunk_object", wraps=chunk_object) as parse:
        assert decoder.decode(HEAD + "—ünïcode".encode() + TAIL) == "—ünïcode"
        assert parse.call_count == 0
        assert decoder.decode(HEAD + b'\\"' + TAIL) == '"'  # escaped: parsed
        assert parse.call_count == 1


def test_content_that_is_not_where_text_only_reads_is_not_learned() -> None:
    """The first "content" in the bytes is another object's: the probe finds out."""
    other = b'{"x":{"content":"same"},"choices":[{"index":0,"delta":{"content": "same"}}]}'
    decoder = ChunkDecoder()
    assert decoder.decode(other) == "same"
    assert decoder.learned == (b"", b"")
    changed = other.replace(b'{"content":"same"}', b'{"content":"other"}')
    assert decoder.decode(changed) == "same"


def test_a_payload_that_is_not_an_object_is_an_error_not_text() -> None:
    decoder = ChunkDecoder()
    for payload in (b'"text"', b"[]", b"5", b"null"):
        try:
            decoder.decode(payload)
        except ValueError as exc:
            assert str(exc) == NOT_AN_OBJECT
        else:
            raise AssertionError(f"{payload!r} was read")


def test_learned_reasoning_skips_the_parser_and_keeps_text_apart() -> None:
    decoder = ChunkDecoder()
    for head in RHEADS[:1] + [HEAD] + RHEADS[:1]:  # reasoning, then the answer, read the fast way once learned
        decoder.decode(head + b"x" + TAIL)
    assert decoder.learned_reasoning == (RHEADS[0], TAIL) and decoder.learned == (HEAD, TAIL)
    with mock.patch("router.dialects.chat_chunks.chunk_object", wraps=chunk_object) as parse:
        thought = decoder.decode(RHEADS[0] + "hmm—".encode() + TAIL)
        answer = decoder.decode(HEAD + b"yes" + TAIL)
        assert parse.call_count == 0
    assert (thought, type(thought), answer, type(answer)) == ("hmm—", ReasoningText, "yes", str)
