"""router/protocol/replay.py on plain data: the output a stream's events build is the assembler's own."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from router.dialects.deltas import Finish, Usage
from router.protocol.errors import UpstreamError
from router.protocol.replay import growth, output_of
from tests.unit.test_assembler import batches_st, fix_call_fragments, fresh, run


@given(batches_st, st.sampled_from(["stop", "length", "tool_calls"]), st.booleans())
def test_the_events_of_a_whole_response_rebuild_its_output(batches, reason, summaries) -> None:
    events, response = run([*fix_call_fragments(batches), [Finish(reason), Usage(3, 4)]], summaries)
    assert output_of(events) == response["output"]


@given(batches_st, st.data())
def test_a_log_cut_anywhere_gives_what_was_produced_with_open_items_incomplete(batches, data) -> None:
    """A router that died after logging some events: the items done are as they were; one still
    open has what its deltas gave and is incomplete, as the assembler leaves an item cut off."""
    asm = fresh()
    events = asm.start()
    for batch in fix_call_fragments(batches):
        events += asm.feed(batch)
    cut = data.draw(st.integers(0, len(events)))
    logged = events[:cut]
    failed = asm.fail(UpstreamError("gone"))[-1]["response"]  # the same run, cut there by a failure
    rebuilt = output_of(logged)
    done = {e["output_index"] for e in logged if e["type"] == "response.output_item.done"}
    assert len(rebuilt) == len({e["output_index"] for e in logged if e["type"] == "response.output_item.added"})
    for index, item in enumerate(rebuilt):
        if index in done:
            assert item == failed["output"][index]
        else:
            assert item["status"] == "incomplete"
    if cut == len(events):  # nothing lost: the failure's own output, open items cut off alike
        assert [{k: v for k, v in i.items() if k != "status"} for i in rebuilt] == \
            [{k: v for k, v in i.items() if k != "status"} for i in failed["output"]]


def test_events_of_unknown_items_or_kinds_are_skipped() -> None:
    events = [
        {"type": "response.output_text.delta", "output_index": 3, "content_index": 0, "delta": "x"},  # no such item
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"type": "message", "id": "m", "status": "in_progress", "role": "assistant", "content": []}},
        {"type": "response.content_part.added", "output_index": 0, "content_index": 0,
         "part": {"type": "output_text", "text": "", "annotations": []}},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "he"},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 5, "delta": "??"},  # no such part
        {"type": "response.web_search_call.searching", "output_index": 0},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "llo"},
    ]
    assert output_of(events) == [{"type": "message", "id": "m", "status": "incomplete", "role": "assistant",
                                  "content": [{"type": "output_text", "text": "hello", "annotations": []}]}]


@given(batches_st, st.data())
def test_checkpoints_that_log_only_growth_rebuild_each_snapshot(batches, data) -> None:
    """A running stream's checkpoints (router/turns/record.py) log ``growth`` from the last one:
    at every checkpoint the log rebuilds that checkpoint's output exactly, and a plain text answer's
    later checkpoints log one delta each, not its text again."""
    asm = fresh()
    asm.start()
    logged: list[dict] = []
    last: list[dict] = []
    for batch in fix_call_fragments(batches):
        asm.feed(batch)
        if data.draw(st.booleans()):
            now = asm.checkpoint()
            logged += growth(last, now)
            assert output_of(logged) == now
            last = copy.deepcopy(now)


def test_a_growing_answer_logs_only_what_is_new() -> None:
    message = {"type": "message", "id": "m", "status": "incomplete", "role": "assistant",
               "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]}
    grown = copy.deepcopy(message)
    grown["content"][0]["text"] = "Hello, world"
    assert growth([message], [grown]) == [{"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
                                           "item_id": "m", "delta": ", world"}]
    done = {**grown, "status": "completed"}
    assert growth([grown], [done]) == [{"type": "response.output_item.done", "output_index": 0, "item": done}]
    assert growth([done], [done]) == []
    assert output_of([{"type": "response.output_item.added", "output_index": 0, "item": message},
                      *growth([message], [grown])]) == [grown]
