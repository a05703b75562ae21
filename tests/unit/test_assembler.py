"""The assembler on plain data: no processes, no I/O."""

from __future__ import annotations

import copy
import json

from hypothesis import given
from hypothesis import strategies as st

from router.dialects.deltas import Delta, Finish, ReasoningDelta, RefusalDelta, TextDelta, ToolCallDelta, Usage
from router.protocol.errors import UpstreamError
from router.protocol.requests import CreateResponse
from router.protocol.shapes import response_object
from router.protocol.tools import build_toolset
from router.turns.assembler import Assembler
from tests.support.streamrules import check_stream, text_of

TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"type": "custom", "name": "run_sql"},
    {"type": "namespace", "name": "crm", "description": "CRM", "tools": [{"type": "function", "name": "find"}]},
]


def fresh(summaries: bool = False) -> Assembler:
    req = CreateResponse(model="m", input="hi", tools=TOOLS)
    return Assembler(response_object(req, response_id="resp_test", created_at=1), tools=build_toolset(TOOLS, "auto"),
                     summaries=summaries)


def run(batches: list[list[Delta]], summaries: bool = False) -> tuple[list[dict], dict]:
    asm = fresh(summaries)
    events = asm.start()
    for batch in batches:
        events += asm.feed(batch)
    events += asm.finish()
    return events, asm.response


# Random interleavings of every delta kind; a turn's tool calls reuse a few indexes.
words = st.text(min_size=0, max_size=5)
call_index = st.integers(0, 2)
deltas = st.one_of(
    words.map(TextDelta),
    words.map(lambda t: TextDelta(t, phase="commentary")),
    words.map(ReasoningDelta),
    words.map(RefusalDelta),
    st.tuples(call_index, st.sampled_from(["get_weather", "run_sql", "crm__find", "unknown"]), words).map(
        lambda a: ToolCallDelta(a[0], f"call_{a[0]}", a[1], a[2])
    ),
)
batches_st = st.lists(st.lists(deltas, max_size=4), max_size=8)


def fix_call_fragments(batches: list[list[Delta]]) -> list[list[Delta]]:
    """Only the first fragment of a call carries its id and name, as engines send them."""
    seen: set[int] = set()
    out = []
    for batch in batches:
        fixed = []
        for d in batch:
            if isinstance(d, ToolCallDelta):
                if d.index in seen:
                    d = ToolCallDelta(d.index, None, None, d.arguments)
                seen.add(d.index)
            fixed.append(d)
        out.append(fixed)
    return out


@given(batches_st, st.sampled_from(["stop", "length", "tool_calls"]), st.integers(0, 99), st.integers(0, 99), st.booleans())
def test_any_interleaving_obeys_the_rules_and_matches_non_stream(batches, reason, n_in, n_out, summaries) -> None:
    batches = [*fix_call_fragments(batches), [Finish(reason), Usage(n_in, n_out, 1, 2)]]
    events, response = run(batches, summaries)
    final = check_stream(events)
    assert final == response  # the terminal event carries exactly the final response
    _, whole = run([[d for batch in batches for d in batch]], summaries)
    assert strip_ids(whole) == strip_ids(response)  # stream and non-stream give the same output
    status = "incomplete" if reason == "length" else "completed"
    assert response["status"] == status
    assert response["usage"] == {"input_tokens": n_in, "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 1}, "output_tokens": n_out,
                                 "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": n_in + n_out}
    # Each kind of delta text ends up in its item, in order.
    all_deltas = [d for b in batches for d in b]
    streamed_text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed_text == "".join(d.text for d in all_deltas if isinstance(d, TextDelta))
    assert streamed_text == text_of(response)
    reasoning = "".join(p["text"] for i in response["output"] if i["type"] == "reasoning" for p in i["content"])
    assert reasoning == "".join(d.text for d in all_deltas if isinstance(d, ReasoningDelta))
    calls = [i for i in response["output"] if i["type"] in ("function_call", "custom_tool_call")]
    assert len({c["call_id"] for c in calls}) == len(calls)
    for event in events:
        if event["type"] in ("response.output_text.delta", "response.reasoning_text.delta", "response.refusal.delta"):
            assert event["delta"], "empty delta event"


@given(batches_st)
def test_failure_keeps_partial_output(batches) -> None:
    asm = fresh()
    events = asm.start()
    for batch in fix_call_fragments(batches):
        events += asm.feed(batch)
    events += asm.fail(UpstreamError("broke", code="upstream_stream_broken"))
    final = check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert final["status"] == "failed" and final["error"] == {"code": "server_error", "message": "broke"}
    assert events[-2]["code"] == "upstream_stream_broken"
    if final["output"]:
        assert final["output"][-1]["status"] == "incomplete"


def test_event_sequence_of_a_text_response() -> None:
    events, _ = run([[TextDelta("Hel")], [TextDelta("lo")], [Finish("stop"), Usage(3, 2)]])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    added = events[2]["item"]
    assert added["status"] == "in_progress" and added["content"] == []
    assert events[3]["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def test_reasoning_then_text_with_summary() -> None:
    events, response = run([[ReasoningDelta("think"), ReasoningDelta("ing")], [TextDelta("answer")], [Finish("stop")]], summaries=True)
    check_stream(events)
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "thinking"}]
    assert message["type"] == "message" and text_of(response) == "answer"
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_summary_text.done") < kinds.index("response.output_item.added", 4)
    assert "response.reasoning_text.done" in kinds


def test_parallel_function_calls_and_name_mapping() -> None:
    events, response = run([
        [ToolCallDelta(0, "call_a", "get_weather", '{"ci'), ToolCallDelta(0, None, None, 'ty": "Oslo"}')],
        [ToolCallDelta(1, "call_b", "crm__find", "{}"), ToolCallDelta(2, "call_c", "run_sql", '{"input": "select 1"}')],
        [Finish("tool_calls")],
    ])
    check_stream(events)
    a, b, c = response["output"]
    assert a == {"id": a["id"], "type": "function_call", "status": "completed", "call_id": "call_a", "name": "get_weather",
                 "arguments": '{"city": "Oslo"}'}
    assert a["id"].startswith("fc_") and json.loads(a["arguments"]) == {"city": "Oslo"}
    assert b["name"] == "find" and b["namespace"] == "crm"
    assert c["type"] == "custom_tool_call" and c["input"] == "select 1" and c["name"] == "run_sql"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"city": "Oslo"}', "{}"]
    assert [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"] == ["select 1"]
    assert response["status"] == "completed"


def test_refusal_and_logprobs() -> None:
    lp = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}]
    events, response = run([[TextDelta("Hi", lp)], [RefusalDelta("no")], [Finish("stop")]])
    check_stream(events)
    (message,) = response["output"]
    assert message["content"] == [
        {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": lp},
        {"type": "refusal", "refusal": "no"},
    ]
    assert [e["delta"] for e in events if e["type"] == "response.refusal.delta"] == ["no"]
    assert next(e for e in events if e["type"] == "response.output_text.delta")["logprobs"] == lp


def test_phase_change_starts_a_new_message() -> None:
    _, response = run([[TextDelta("working on it", phase="commentary")], [TextDelta("done")], [Finish("stop")]])
    first, second = response["output"]
    assert first["phase"] == "commentary" and "phase" not in second


def test_length_cut_marks_open_items_incomplete() -> None:
    _, response = run([[ToolCallDelta(0, "call_x", "get_weather", '{"ci')], [Finish("length")]])
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


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


def strip_ids(response: dict) -> dict:
    out = copy.deepcopy(response)
    for item in out["output"]:
        item.pop("id", None)
    out.pop("completed_at", None)
    return out


@given(batches_st)
def test_a_checkpoint_is_what_a_cancel_now_would_keep_and_changes_nothing(batches: list[list[Delta]]) -> None:
    """``checkpoint`` (a running stream's stored output) gives the output ``cancel`` would leave at
    that moment, and the run goes on exactly as without it."""
    batches = fix_call_fragments(batches)
    _events, response = run(batches)
    asm = fresh()
    asm.start()
    for batch in batches:
        asm.feed(batch)
    snapshot = copy.deepcopy(asm.checkpoint())
    twin = copy.deepcopy(asm)
    twin.cancel()
    assert snapshot == twin.response["output"]
    assert snapshot == [] or all(item["status"] in ("incomplete", "completed") for item in snapshot)
    asm.finish()
    def without_ids(output: list[dict]) -> list[dict]:  # item ids are new in every run
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]
    # The checkpoint changed nothing of the run.
    assert without_ids(asm.response["output"]) == without_ids(response["output"])
