"""The ordering rules a Responses event stream must obey (DESIGN.md, "Invariants").

Used on plain-data assembler output and on real SSE streams alike.
"""

from __future__ import annotations

from typing import Any

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
PART_EVENTS = {
    "response.output_text.delta", "response.output_text.done", "response.refusal.delta", "response.refusal.done",
    "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
}


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Assert every rule; return the terminal event's response."""
    assert events, "empty stream"
    assert events[0]["type"] == "response.created", events[0]["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), "sequence numbers not 0, 1, 2, ..."
    response_id = events[0]["response"]["id"]
    added: dict[int, dict[str, Any]] = {}
    done: set[int] = set()
    parts: set[tuple[int, int]] = set()
    call_ids: set[str] = set()
    terminal = None
    for ev in events:
        kind = ev["type"]
        assert terminal is None, f"{kind} after the terminal event"
        if "response" in ev:
            assert ev["response"]["id"] == response_id, "response id changed between lifecycle events"
        if kind in TERMINAL:
            terminal = ev
        elif kind == "response.output_item.added":
            index = ev["output_index"]
            assert index == len(added), f"output_index {index} not dense (expected {len(added)})"
            added[index] = ev["item"]
            call_id = ev["item"].get("call_id")
            if call_id:
                assert call_id not in call_ids, f"duplicate call_id {call_id}"
                call_ids.add(call_id)
        elif kind == "response.output_item.done":
            index = ev["output_index"]
            assert index in added, f"output_item.done before added at {index}"
            assert ev["item"]["id"] == added[index]["id"] and ev["item"]["type"] == added[index]["type"]
            done.add(index)
        elif kind == "response.content_part.added":
            assert ev["output_index"] in added and ev["output_index"] not in done
            assert ev["item_id"] == added[ev["output_index"]]["id"]
            parts.add((ev["output_index"], ev["content_index"]))
        elif kind in PART_EVENTS:
            key = (ev["output_index"], ev["content_index"])
            assert key in parts, f"{kind} before content_part.added at {key}"
            assert ev["item_id"] == added[ev["output_index"]]["id"]
            assert ev["output_index"] not in done, f"{kind} after output_item.done"
        elif "output_index" in ev:
            index = ev["output_index"]
            assert index in added, f"{kind} before output_item.added at {index}"
            assert index not in done, f"{kind} after output_item.done"
            assert ev["item_id"] == added[index]["id"]
    assert terminal is not None, "no terminal event"
    response = terminal["response"]
    output = response["output"]
    assert output is not None
    if terminal["type"] != "response.failed":
        assert set(added) == done, f"items added but never done: {set(added) - done}"
        assert [item["id"] for item in output] == [added[i]["id"] for i in sorted(added)]
    return response


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
