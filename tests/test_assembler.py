"""The assembler and the chat dialect on plain data: no processes, no I/O."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from router.dialects import chat
from router.dialects.deltas import Delta, Finish, TextDelta, Usage
from router.protocol.errors import UpstreamError
from router.protocol.requests import CreateResponse
from router.protocol.shapes import response_object
from router.turns.assembler import Assembler
from tests.streamrules import check_stream, text_of


def fresh() -> Assembler:
    return Assembler(response_object(CreateResponse(model="m", input="hi"), response_id="resp_test", created_at=1))


def run(batches: list[list[Delta]]) -> tuple[list[dict], dict]:
    asm = fresh()
    events = asm.start()
    for batch in batches:
        events += asm.feed(batch)
    events += asm.finish()
    return events, asm.response


texts = st.text(min_size=0, max_size=6)
text_batches = st.lists(st.lists(texts.map(TextDelta), max_size=4), max_size=8)
finish = st.sampled_from(["stop", "length"])


@given(text_batches, finish, st.integers(0, 1000), st.integers(0, 1000))
def test_streamed_events_rebuild_the_non_streamed_response(batches, reason, n_in, n_out) -> None:
    batches = [*batches, [Finish(reason), Usage(n_in, n_out)]]
    events, response = run(batches)
    final = check_stream(events)
    assert final == response  # the terminal event carries exactly the final response
    # Non-stream path: the same deltas all at once give the same response, apart from fresh ids.
    _, whole = run([[d for batch in batches for d in batch]])
    assert strip_ids(whole) == strip_ids(response)
    # The text deltas add up to the item's text.
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == text_of(response) == "".join(d.text for b in batches for d in b if isinstance(d, TextDelta))
    assert all(e["delta"] for e in events if e["type"] == "response.output_text.delta"), "empty delta events"
    expected_status = "incomplete" if reason == "length" else "completed"
    assert response["status"] == expected_status and response["output"][0]["status"] == expected_status
    assert response["usage"]["total_tokens"] == n_in + n_out


@given(text_batches)
def test_failure_keeps_partial_output(batches) -> None:
    asm = fresh()
    events = asm.start()
    for batch in batches:
        events += asm.feed(batch)
    events += asm.fail(UpstreamError("broke", code="upstream_stream_broken"))
    final = check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert final["status"] == "failed" and final["error"] == {"code": "upstream_stream_broken", "message": "broke"}
    text = "".join(d.text for b in batches for d in b)
    if text:
        assert final["output"][0]["status"] == "incomplete" and text_of(final) == text
    else:
        assert final["output"] == []


def test_event_sequence_of_a_text_response() -> None:
    events, _ = run([[TextDelta("Hel")], [TextDelta("lo")], [Finish("stop"), Usage(3, 2)]])
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2]["item"]
    assert added["status"] == "in_progress" and added["content"] == []
    assert events[3]["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def test_lifecycle_events_are_snapshots() -> None:
    asm = fresh()
    created = asm.start()[0]
    snapshot = copy.deepcopy(created)
    asm.feed([TextDelta("x"), Finish("stop")])
    asm.finish()
    assert created == snapshot
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []


def test_empty_answer_is_still_a_message() -> None:
    events, response = run([[Finish("stop")]])
    check_stream(events)
    assert response["output"][0]["type"] == "message" and text_of(response) == ""


# -- chat dialect ---------------------------------------------------------------


def test_items_to_messages() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "r", "annotations": []}]},
    ]
    assert chat.to_messages(items, "inst") == [
        {"role": "system", "content": "inst"},
        {"role": "system", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "r"},
    ]


def test_chunks_and_completions_give_the_same_deltas() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
    ]
    streamed = [d for c in chunks for d in chat.chunk_deltas(c)]
    assert streamed == [TextDelta("Hi"), TextDelta(" there"), Finish("length"), Usage(5, 2)]
    whole = chat.completion_deltas({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}},
    })
    assert whole == [TextDelta("Hi there"), Finish("length"), Usage(5, 2, cached_tokens=3)]


def test_chat_request_fields() -> None:
    body = chat.chat_request([{"role": "user", "content": "x"}], model="m", stream=True, max_tokens=7, temperature=0.5, top_p=None)
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 7,
        "temperature": 0.5,
    }


def strip_ids(response: dict) -> dict:
    out = copy.deepcopy(response)
    for item in out["output"]:
        item.pop("id", None)
    out.pop("completed_at", None)
    return out
