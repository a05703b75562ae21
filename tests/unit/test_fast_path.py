"""The per-token fast paths against the general ones they skip, on random streams.

The runner reads a plain text chunk without parsing it or making deltas (the chat
dialect's ``ChunkDecoder`` -> ``Assembler.text``) and ``SSEStream`` decodes a read of one
whole frame without splitting it. Both must be invisible: the same events, byte for byte,
the same final response, the same errors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends.client import SSEStream
from router.dialects.chat import ChatOptions, ChatTurn
from router.dialects.chat_chunks import chunk_object
from router.dialects.deltas import Delta, TextDelta
from router.protocol.requests import CreateResponse
from router.protocol.shapes import response_object
from router.protocol.tools import build_toolset
from router.turns.assembler import Assembler
from router.turns.reader import reader
from tests.unit.test_assembler import deltas as assembler_deltas
from tests.unit.test_assembler import fix_call_fragments

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}, {"type": "custom", "name": "run_sql"}]

# -- random chat chunks: mostly plain text (the fast path), every other shape mixed in

text = st.text(max_size=4)
nonempty = st.one_of(text.filter(bool), text.filter(bool), text)
maybe_text = st.one_of(st.none(), text)
logprobs = st.one_of(
    st.none(), st.just({}), st.just({"content": None}),
    text.map(lambda t: {"content": [{"token": t, "logprob": -0.5, "bytes": None, "top_logprobs": []}]}),
)
tool_fragment = st.fixed_dictionaries({"index": st.integers(0, 2)}, optional={
    "id": st.just("engine-id"), "type": st.just("function"),
    "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["get_weather", "run_sql", "other"]),
                                                    "arguments": text}),
})
delta = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["assistant", None]),
    "content": st.one_of(text.filter(bool), maybe_text, st.integers(0, 1)),
    "reasoning_content": maybe_text,
    "reasoning": maybe_text,
    "refusal": maybe_text,
    "tool_calls": st.one_of(st.none(), st.lists(tool_fragment, max_size=2)),
})
finish_reason = st.sampled_from(["stop", "length", "tool_calls", "content_filter", "", "odd", "abort"])
choice = st.fixed_dictionaries({"index": st.just(0)}, optional={
    "delta": st.one_of(delta, st.none()),
    "logprobs": logprobs,
    "finish_reason": st.one_of(st.none(), finish_reason),
    "matched_stop": st.none(),
})
usage = st.fixed_dictionaries({"prompt_tokens": st.integers(0, 9), "completion_tokens": st.integers(0, 9)})
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
any_chunk = st.builds(lambda choices, extra: {**HEAD, "choices": choices, **extra},
                      st.one_of(st.lists(choice, min_size=1, max_size=1), st.lists(choice, max_size=2)),
                      st.fixed_dictionaries({}, optional={"usage": st.one_of(st.none(), usage)}))
plain_chunk = st.one_of(text.filter(bool), text).map(lambda t: {**HEAD, "choices": [{"index": 0, "delta": {"content": t}, "logprobs": None,
                                                        "finish_reason": None}]})


reasoning_chunk = st.builds(lambda t, key: {**HEAD, "choices": [{"index": 0, "delta": {key: t}, "logprobs": None,
                                                                  "finish_reason": None}]},
                            st.one_of(text.filter(bool), text), st.sampled_from(["reasoning", "reasoning_content"]))


def nudged_reasoning(thought: str, key: str, other: str, value: Any) -> dict[str, Any]:
    """A plain reasoning chunk with one field more: the reasoning fast path's edge."""
    chunk = {**HEAD, "choices": [{"index": 0, "delta": {key: thought}, "logprobs": None, "finish_reason": None}]}
    target = chunk if other == "usage" else chunk["choices"][0] if other in ("logprobs", "finish_reason") else chunk["choices"][0]["delta"]
    target[other] = value
    return chunk


reasoning_edge = st.builds(
    nudged_reasoning, nonempty, st.sampled_from(["reasoning", "reasoning_content"]),
    st.sampled_from(["content", "refusal", "reasoning", "reasoning_content", "role", "finish_reason", "logprobs", "usage"]),
    st.one_of(nonempty, st.none(), st.integers(0, 1), st.just(["x"]), logprobs, finish_reason))


def nudged(content: str, where: str, key: str, value: Any) -> dict[str, Any]:
    """A plain text chunk with one thing more: the shapes right at the fast path's edge."""
    chunk = {**HEAD, "choices": [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]}
    {"chunk": chunk, "choice": chunk["choices"][0], "delta": chunk["choices"][0]["delta"]}[where][key] = value
    return chunk


edge_chunk = st.one_of(
    st.builds(nudged, nonempty, st.just("choice"), st.just("finish_reason"), finish_reason),
    st.builds(nudged, nonempty, st.just("choice"), st.just("logprobs"), logprobs),
    st.builds(nudged, nonempty, st.just("chunk"), st.just("usage"), usage),
    st.builds(nudged, nonempty, st.just("chunk"), st.just("choices"), st.lists(choice, max_size=2)),
    *(st.builds(nudged, nonempty, st.just("delta"), st.just(key), st.one_of(nonempty, st.none()))
      for key in ("role", "reasoning_content", "reasoning", "refusal")),
    st.builds(nudged, nonempty, st.just("delta"), st.just("tool_calls"), st.one_of(st.none(), st.lists(tool_fragment, max_size=2))),
)
junk = st.sampled_from([[], "x", 5, {"choices": "a"}, {"choices": [5]}, {"choices": [{"delta": "a"}]}])
chunk = st.one_of(*[plain_chunk] * 3, *[edge_chunk] * 4, *[any_chunk] * 2, *[reasoning_chunk] * 2, reasoning_edge,
                  junk)  # weights: one_of picks evenly
batches = st.lists(st.lists(chunk, min_size=1, max_size=3), min_size=2, max_size=12)


ID_MAKERS = ("router.protocol.ids", "router.turns.assembler", "router.dialects.chat")  # the modules that call new_id (ItemIds in ids)


@contextmanager
def counted_ids(modules: tuple[str, ...] = ID_MAKERS) -> Iterator[None]:
    """Ids from a counter in ``modules``, so that two runs of one stream make the same ones."""
    counter = itertools.count()

    def new_id(prefix: str) -> str:
        return f"{prefix}_{next(counter)}"

    with ExitStack() as patches:
        for module in modules:
            patches.enter_context(mock.patch(f"{module}.new_id", new_id))
        yield


class Timer:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def token(self, n: int = 1) -> None:
        self.calls.append(n)


def outcome(step: Any) -> tuple[str, Any]:
    """What a step gave, or the error it raised (both paths must fail alike)."""
    try:
        return "ok", step()
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return type(exc).__name__, str(exc)


def play(stream: list[list[Any]], think_tags: bool, fast: bool) -> list[Any]:
    """Every batch's events (as sent: JSON bytes), then the turn's end and the response's.

    Each chunk goes over the wire as JSON: the fast way reads it with the dialect's own
    decoder, the general way parses it (``chunk_object``) and makes deltas of every frame.
    """
    req = CreateResponse(model="m", input="hi", tools=TOOLS)
    tools = build_toolset(TOOLS, "auto")
    out: list[Any] = []
    with counted_ids():
        asm = Assembler(response_object(req, response_id="resp_1", created_at=1), tools=tools)
        turn = ChatTurn(req, tools, ChatOptions(think_tags=think_tags), model="m", path="/v1/chat/completions")
        timer = Timer()
        if fast:
            held: list[list[Any]] = []
            on_batch = reader(asm, turn, timer, None, held)

            def translate(batch: list[Any]) -> list[Any]:
                on_batch([turn.decode(orjson.dumps(frame)) for frame in batch])
                return held.pop() if held else []
        else:  # the general way: every frame parsed, then through deltas and feed
            def translate(batch: list[Any]) -> list[Any]:
                frames = [chunk_object(orjson.dumps(frame)) for frame in batch]
                events = asm.feed([d for frame in frames for d in turn.chunk(frame)])
                if events:
                    timer.token(len(batch))
                return events
        out.append(asm.start())
        for batch in stream:
            result = outcome(lambda: translate(batch))  # noqa: B023 - called at once
            out.append(result)
            if result[0] != "ok":
                return as_sent(out)  # the runner ends the stream here
        out.append(outcome(lambda: asm.feed(turn.end()) + asm.close_turn() + asm.finish()))
    response = dict(asm.response)
    response.pop("completed_at", None)
    out.append(response)
    out.append(timer.calls)
    return as_sent(out)


def as_sent(out: list[Any]) -> list[Any]:
    """Events as bytes, as they leave: key order and JSON types count, not Python's."""
    for i, step in enumerate(out):
        if isinstance(step, tuple) and step[0] == "ok":
            for event in step[1]:
                event.get("response", {}).pop("completed_at", None)
            out[i] = ("ok", orjson.dumps(step[1]))
    return out


def plain(content: Any, **choice: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "delta": {"content": content}, **choice}]}


OPEN = [plain("a")]  # the message and its output_text part are open after this read


@settings(max_examples=500, deadline=None)
@given(batches, st.booleans())
@example([OPEN, [plain("b", finish_reason="length")]], False)
@example([OPEN, [plain("b", finish_reason="abort")]], False)
@example([OPEN, [plain("b", logprobs={"content": [{"token": "b", "logprob": -1.0}]})]], False)
@example([OPEN, [{**plain("b"), "usage": {"prompt_tokens": 1, "completion_tokens": 2}}]], False)
@example([OPEN, [{**HEAD, "choices": [{"index": 0, "delta": {"content": "b", "reasoning_content": "r"}}]}]], False)
@example([OPEN, [{**HEAD, "choices": [{"index": 0, "delta": {"content": "b", "reasoning": "r"}}]}]], False)
@example([OPEN, [{**HEAD, "choices": [{"index": 0, "delta": {"content": "b", "refusal": "no"}}]}]], False)
@example([OPEN, [{**HEAD, "choices": [{"index": 0, "delta": {"content": "b", "tool_calls": [
    {"index": 0, "function": {"name": "get_weather", "arguments": "{}"}}]}}]}]], False)
@example([OPEN, [{**HEAD, "choices": [plain("b")["choices"][0], plain("c")["choices"][0]]}]], False)
@example([OPEN, [plain(7)], [plain("")]], False)
@example([OPEN, [plain("<think>b")], [plain("c</think>d")]], True)
def test_plain_text_fast_path_gives_what_deltas_give(stream: list[list[Any]], think_tags: bool) -> None:
    assert play(stream, think_tags, fast=True) == play(stream, think_tags, fast=False)


@settings(max_examples=500, deadline=None)
@given(edge_chunk, st.lists(plain_chunk, max_size=2))
def test_chunks_at_the_edge_of_the_fast_path_after_open_text(edge: Any, more: list[Any]) -> None:
    """Plain text with one thing more, read alone while the answer's text part is open."""
    stream = [OPEN, [edge], *([chunk] for chunk in more)]
    assert play(stream, False, fast=True) == play(stream, False, fast=False)


def test_the_fast_path_is_taken_for_plain_text() -> None:
    req = CreateResponse(model="m", input="hi")
    tools = build_toolset([], "auto")
    asm = Assembler(response_object(req, response_id="resp_1", created_at=1), tools=tools)
    turn = ChatTurn(req, tools, ChatOptions(), model="m", path="/v1/chat/completions")
    written: list[list[Any]] = []
    translate = reader(asm, turn, None, lambda events: written.append(events) is None, [])
    first = {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "logprobs": None,
                                  "finish_reason": None}]}
    translate([turn.decode(orjson.dumps(first))])  # opens the message and its part: the general way
    for text in ("b", "c"):  # the first plain text chunk teaches the decoder; the next is not parsed
        plain = {**HEAD, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}
        with mock.patch.object(turn, "chunk", side_effect=AssertionError("decoded the general way")):
            translate([turn.decode(orjson.dumps(plain))])
    with (mock.patch("router.dialects.chat_chunks.chunk_object", side_effect=AssertionError("parsed")),
          mock.patch.object(turn, "chunk", side_effect=AssertionError("decoded the general way"))):
        translate([turn.decode(orjson.dumps(plain))])
    assert [e["type"] for e in written[-1]] == ["response.output_text.delta"]
    assert [batch[0]["delta"] for batch in written[-3:]] == ["b", "c", "c"]


# -- the assembler's text fast path from any state the deltas can leave it in

def assemble(stream: list[list[Delta]], fast: bool) -> list[Any]:
    out: list[Any] = []
    with counted_ids():
        asm = Assembler(response_object(CreateResponse(model="m", input="hi", tools=TOOLS), response_id="resp_1",
                                        created_at=1), tools=build_toolset(TOOLS, "auto"))
        for batch in stream:
            one = batch[0] if len(batch) == 1 else None
            plain = type(one) is TextDelta and one.text and one.logprobs is None and one.phase is None
            events = asm.text(one.text) if fast and plain else None  # type: ignore[union-attr]
            out.append(orjson.dumps(asm.feed(batch) if events is None else events))
        end = asm.finish()
        end[-1]["response"].pop("completed_at")  # the clock, not the path
        out.append(orjson.dumps(end))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.lists(assembler_deltas, max_size=3), text.map(lambda t: [TextDelta(t)])), max_size=12))
def test_assembler_text_is_feed_of_one_text_delta(stream: list[list[Delta]]) -> None:
    stream = fix_call_fragments(stream)
    assert assemble(stream, fast=True) == assemble(stream, fast=False)


# -- SSE reads: one whole frame (the fast decode) against the same bytes split in two (the general one)

payload = st.one_of(
    any_chunk.map(orjson.dumps), plain_chunk.map(orjson.dumps),
    st.sampled_from([b"[DONE]", b'{"error": {"message": "boom"}}', b'{"error": "x", "choices": []}', b"{bad}",
                     b'{"a":\n1}', b"{}", b"[1]", b'{"a": 1}\r', b"{\xff}", b'{"a": 1} }', b'{"a": 1}  ']),
)
frame = st.one_of(
    payload.map(lambda p: b"data: " + p + b"\n\n"),
    payload.map(lambda p: b"data:" + p + b"\r\n\r\n"),
    st.just(b": keep-alive\n\n"), st.just(b"event: x\ndata: {}\n\n"),
)
reads = st.lists(frame, min_size=1, max_size=3).map(b"".join)


def frames(pieces: list[bytes]) -> list[Any]:
    stream = SSEStream(SimpleNamespace(gen=0))  # type: ignore[arg-type]
    out: list[Any] = []
    for piece in pieces:
        result = outcome(lambda: stream._frames(piece))  # noqa: B023 - called at once
        if result[0] != "ok":
            out.append(result)
            break
        out += result[1]
    error = stream._error
    return [out, stream._done, None if error is None else error.message]


@settings(max_examples=400, deadline=None)
@given(reads)
def test_one_frame_read_decodes_as_a_split_one(data: bytes) -> None:
    assert frames([data]) == frames([data[:1], data[1:]])


def test_reader_holds_what_the_writer_refuses_and_keeps_the_order() -> None:
    """A backed-up client: the refused batch and every one after it wait in ``held``, in order."""
    req = CreateResponse(model="m", input="hi")
    tools = build_toolset([], "auto")
    asm = Assembler(response_object(req, response_id="resp_1", created_at=1), tools=tools)
    turn = ChatTurn(req, tools, ChatOptions(), model="m", path="/v1/chat/completions")
    takes = [True, False, True]
    written: list[list[Any]] = []
    held: list[list[Any]] = []

    def direct(events: list[Any]) -> bool:
        if takes.pop(0):
            written.append(events)
            return True
        return False

    on_batch = reader(asm, turn, None, direct, held)
    assert on_batch([plain("a")]) is True
    assert on_batch([plain("b")]) is False  # refused: held, reading stops
    assert on_batch([plain("c")]) is False  # the writer would take it, but "b" is still waiting
    assert [e["delta"] for e in written[0] if "delta" in e] == ["a"]
    assert [[e["delta"] for e in batch] for batch in held] == [["b"], ["c"]]


OPEN_REASONING = [{**HEAD, "choices": [{"index": 0, "delta": {"reasoning": "a"}}]}]  # a reasoning item is open after this


@settings(max_examples=300, deadline=None)
@given(reasoning_edge, st.lists(st.one_of(reasoning_chunk, plain_chunk), max_size=3))
def test_chunks_at_the_edge_of_the_reasoning_fast_path(edge: Any, more: list[Any]) -> None:
    """Plain reasoning with one thing more, read alone while a reasoning item is open."""
    stream = [OPEN_REASONING, [edge], *([chunk] for chunk in more)]
    assert play(stream, False, fast=True) == play(stream, False, fast=False)
