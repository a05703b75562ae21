"""Harmony streams' per-token fast path against the general way, on random generate streams.

``HarmonyTurn.decode`` does a frame's work when the stream decodes it: a plain vLLM frame is
read by its learned head and tail (no orjson), its one id through ``HarmonyParser.plain`` (no
delta), and the runner writes it with ``Assembler.text`` / ``reasoning``. The general way
parses every frame and feeds ``chunk``'s deltas. Both must give the same events, byte for
byte, the same final response and the same errors.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import HarmonyEncoding

from backends.client import SSEStream
from router.dialects.chat_chunks import chunk_object
from router.dialects.harmony_chunks import IdsTemplate
from router.dialects.harmony_turn import HarmonyTurn
from router.protocol.requests import CreateResponse
from router.protocol.shapes import response_object
from router.protocol.tools import build_toolset
from router.turns.assembler import Assembler
from router.turns.reader import reader
from tests.unit.test_fast_path import Timer, as_sent, counted_ids, outcome
from tests.unit.test_harmony_parse import stream as harmony_stream
from tests.unit.test_harmony_parse import token_ids

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}, {"type": "function", "name": "x"}]

# The modules that call new_id on a harmony stream (ids from a counter: two runs make the same ones).
HARMONY_ID_MAKERS = ("router.protocol.ids", "router.turns.assembler", "router.dialects.harmony_parse")


# -- frames as vLLM's /inference/v1/generate sends them (GenerateTokensStreamResponse), and others

def frame(ids: Any, finish: Any = None, **more: Any) -> bytes:
    choice = {"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": ids, "routed_experts": None}
    return orjson.dumps({"request_id": "gen-1", "choices": [choice], "usage": None, **more})


def usage_frame(cached: bool) -> bytes:
    usage: dict[str, Any] = {"prompt_tokens": 5, "total_tokens": 12, "completion_tokens": 7}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": 2}
    return orjson.dumps({"request_id": "gen-1", "choices": [], "usage": usage})


ODD = [
    b"[1]", b'"x"', b"5", b"{bad}", b'{"error": {"message": "boom"}}', b'{"error": "x", "choices": []}',
    frame([]), frame(None), frame([-1]), frame([2**40]), frame([1, 2]).replace(b",", b", ", 1),
    frame([1]).replace(b"[1]", b"[01]"), frame([1]).replace(b"[1]", b"[1e3]"), frame([1]).replace(b"[1]", b"[1,]"),
    frame([1]).replace(b"[1]", b"[ 1]"), frame([200002]), frame([200006]), frame([12], "abort"),
    frame([12], logprobs_extra=1), frame([12]).replace(b'"logprobs":null', b'"logprobs":{}'),
    orjson.dumps({"request_id": "gen-1", "choices": [{"index": 0, "token_ids": [12]}, {"index": 1, "token_ids": [13]}]}),
]


@st.composite
def generate_reads(draw: st.DrawFn, ids: list[int]) -> list[bytes]:
    """``ids`` in frames of mostly one id (the first maybe with the prompt's), a last frame
    with a finish reason, maybe a usage frame and [DONE]; odd frames mixed in; then cut
    into reads of one to three frames."""
    payloads: list[bytes] = []
    at = 0
    while at < len(ids):
        n = draw(st.sampled_from([1, 1, 1, 1, 2, 3]))
        more = {"prompt_token_ids": [1, 2, 3]} if not payloads and draw(st.booleans()) else {}
        payloads.append(frame(ids[at:at + n], **more))
        at += n
        if draw(st.sampled_from([False] * 12 + [True])):
            payloads.append(draw(st.sampled_from(ODD)))
    finish = draw(st.sampled_from([None, "stop", "stop", "length", "abort", "cut"]))
    if finish != "cut":
        payloads.append(frame(draw(st.sampled_from([[], [200002], [12]])), finish))
        if draw(st.booleans()):
            payloads.append(usage_frame(draw(st.booleans())))
        if draw(st.booleans()):
            payloads.append(b"[DONE]")
    wire = [b"data: " + p + b"\n\n" for p in payloads]
    reads: list[bytes] = []
    while wire:
        n = draw(st.sampled_from([1, 1, 1, 2, 3]))
        reads.append(b"".join(wire[:n]))
        del wire[:n]
    return reads


def play(enc: HarmonyEncoding, reads: list[bytes], fast: bool, engine: str = "vllm") -> list[Any]:
    """Every read's events (as sent), then the turn's end and the response, or the error.

    The fast way: the stream decodes frames with ``turn.decode``, the runner's ``reader``
    makes the events. The general way: every frame parsed and read by ``chunk``, one frame
    after the other as the stream holds them (so with two bad frames in one read, the first
    one's error is the stream's, as the fast way reports it), the deltas fed.
    """
    req = CreateResponse(model="m", input="hi", tools=TOOLS)
    tools = build_toolset(TOOLS, "auto")
    out: list[Any] = []
    with counted_ids(HARMONY_ID_MAKERS):
        asm = Assembler(response_object(req, response_id="resp_1", created_at=1), tools=tools)
        turn = HarmonyTurn(req, tools, enc, engine=engine, context_length=None, request_id="resp_1", model="m")
        sse = SSEStream(SimpleNamespace(gen=0))  # type: ignore[arg-type]
        def general(payload: bytes) -> Any:
            frame = chunk_object(payload)
            if isinstance(frame, dict) and "error" in frame and "choices" not in frame:
                return frame  # the worker's error frame: the stream reads it
            return turn.chunk(frame)

        sse._decode = turn.decode if fast else general
        timer = Timer()
        held: list[list[Any]] = []
        on_batch = reader(asm, turn, timer, None, held)

        def translate(data: bytes) -> tuple[list[Any], str | None]:
            batch = sse._frames(data)
            if fast:
                if batch:
                    on_batch(batch)
                events = held.pop() if held else []
            else:
                events = asm.feed([d for deltas in batch for d in deltas])
                if events:
                    timer.token(len(batch))
            return events, None if sse._error is None else sse._error.message

        out.append(asm.start())
        for data in reads:
            result = outcome(lambda: translate(data))  # noqa: B023 - called at once
            out.append((result[0], result[1][0]) if result[0] == "ok" else result)
            if result[0] != "ok" or result[1][1] is not None:
                out.append(("error frame", result[1][1]) if result[0] == "ok" else None)
                return as_sent(out)  # the runner ends the stream here
            if sse._done:
                break
        out.append(outcome(lambda: asm.feed(turn.end()) + asm.close_turn() + asm.finish()))
    response = dict(asm.response)
    response.pop("completed_at", None)
    out += [response, timer.calls, turn._usage()]
    return as_sent(out)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(harmony_stream(), st.data())
def test_fast_path_gives_what_the_general_way_gives(enc: HarmonyEncoding, byte_ids: dict[int, int],
                                                     pieces: list[Any], data: st.DataObject) -> None:
    reads = data.draw(generate_reads(token_ids(enc, byte_ids, pieces)))
    assert play(enc, reads, fast=True) == play(enc, reads, fast=False)


@st.composite
def sglang_reads(draw: st.DrawFn, ids: list[int]) -> list[bytes]:
    """SGLang's /generate frames (cumulative ``output_ids`` unless incremental), a finish
    in ``meta_info``, each its own read or a few together."""
    cumulative = draw(st.booleans())
    payloads: list[bytes] = []
    at = 0
    while at < len(ids):
        n = draw(st.sampled_from([1, 1, 2]))
        out = ids[:at + n] if cumulative else ids[at:at + n]
        at += n
        reason = draw(st.sampled_from([None, {"type": "stop", "matched": 200002}, {"type": "length", "length": 9}])) \
            if at >= len(ids) else None
        meta = {"id": "x", "finish_reason": reason, "prompt_tokens": 5, "completion_tokens": at, "cached_tokens": 1}
        payloads.append(orjson.dumps({"text": "", "output_ids": out, "meta_info": meta}))
        if draw(st.sampled_from([False] * 12 + [True])):
            payloads.append(draw(st.sampled_from(ODD)))
    wire = [b"data: " + p + b"\n\n" for p in [*payloads, b"[DONE]"]]
    size = draw(st.sampled_from([1, 1, 2, 3]))
    return [b"".join(wire[i:i + size]) for i in range(0, len(wire), size)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(harmony_stream(), st.data())
def test_sglang_frames_take_the_general_way_at_decode_time(enc: HarmonyEncoding, byte_ids: dict[int, int],
                                                           pieces: list[Any], data: st.DataObject) -> None:
    reads = data.draw(sglang_reads(token_ids(enc, byte_ids, pieces)))
    assert play(enc, reads, fast=True, engine="sglang") == play(enc, reads, fast=False, engine="sglang")


WELL_FORMED = st.sampled_from([
    "<|channel|>analysis<|message|>Let me think about ünïcode 🙂.<|end|><|start|>assistant<|channel|>final<|message|>Done: 日本語<|return|>",
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Zürich\"}<|call|>",
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 42.<|end|>",
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(WELL_FORMED, st.data())
def test_fast_path_on_well_formed_answers(enc: HarmonyEncoding, text: str, data: st.DataObject) -> None:
    ids = enc.encode(text, allowed_special="all")
    reads = data.draw(generate_reads(ids))
    assert play(enc, reads, fast=True) == play(enc, reads, fast=False)


def test_a_learned_plain_frame_skips_the_parser(enc: HarmonyEncoding) -> None:
    req = CreateResponse(model="m", input="hi")
    tools = build_toolset([], "auto")
    turn = HarmonyTurn(req, tools, enc, engine="vllm", context_length=None, request_id="resp_1", model="m")
    head = enc.encode("<|channel|>final<|message|>", allowed_special="all")
    words = enc.encode("Hello there, world", disallowed_special=())
    assert len(words) >= 3
    for token in head:
        turn.decode(frame([token], **({"prompt_token_ids": [1]} if token == head[0] else {})))
    assert turn.decode(frame([words[0]])) == enc.decode([words[0]])  # parsed, and learned from
    assert turn._template is not None and turn._template.learned[0].endswith(b'"token_ids":[')
    with (mock.patch("router.dialects.harmony_turn.chunk_object", side_effect=AssertionError("parsed")),
          mock.patch("orjson.loads", side_effect=AssertionError("parsed")),
          mock.patch.object(turn, "chunk", side_effect=AssertionError("decoded the general way"))):
        texts = [turn.decode(frame([token])) for token in words[1:]]
    assert texts == [enc.decode([token]) for token in words[1:]]
    assert all(type(t) is str for t in texts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), max_size=4), st.sampled_from([b"", b" ", b"-", b"0", b",", b"e1", b"]"]),
       st.booleans())
def test_template_reads_as_orjson_does(ids: list[int], noise: bytes, front: bool) -> None:
    """What ``read`` gives is what parsing gives; what it cannot be sure of it leaves."""
    template = IdsTemplate()
    template.learn(frame([5]), [5], lambda probe: probe["choices"][0]["token_ids"] == [7, 8])
    digits = b",".join(str(i).encode() for i in ids)
    digits = noise + digits if front else digits + noise
    payload = frame([0]).replace(b"[0]", b"[" + digits + b"]")
    got = template.read(payload)
    if got is not None:
        assert got == orjson.loads(payload)["choices"][0]["token_ids"]
    elif not noise and ids and max(ids) < 10**18:
        pytest.fail("a plain frame was not read")
