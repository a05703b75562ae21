"""bench/token_path.py's path, run natively: what it counts is the real per-token work.

Worker reads in, client writes out: every read of one text (or reasoning) chunk leaves as one
HTTP chunk holding the SSE frame of its ``output_text.delta``, the first one
after the events that open the message and its text part.
"""

from __future__ import annotations

import orjson

from bench.token_path import WORDS, run


def sse_events(write: bytes) -> list[dict]:
    size, rest = write.split(b"\r\n", 1)
    assert int(size, 16) == len(rest) - 2 and rest.endswith(b"\r\n")
    events = []
    for frame in rest[:-2].split(b"\n\n")[:-1]:
        head, data = frame.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    return events


def test_every_read_leaves_as_one_write_of_its_delta() -> None:
    writes = run(50)
    assert len(writes) == 50
    batches = [sse_events(w) for w in writes]
    assert [e["type"] for e in batches[0]] == ["response.output_item.added", "response.content_part.added",
                                               "response.output_text.delta"]
    deltas = [batch[-1] for batch in batches]
    assert all(len(batch) == 1 for batch in batches[1:])
    assert [d["delta"] for d in deltas] == [WORDS[i % len(WORDS)].decode() for i in range(50)]
    seqs = [e["sequence_number"] for batch in batches for e in batch]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert len({d["item_id"] for d in deltas}) == 1


def test_every_read_of_reasoning_leaves_as_one_write_of_its_delta() -> None:
    writes = run(50, reasoning=True)
    assert len(writes) == 50
    batches = [sse_events(w) for w in writes]
    assert [e["type"] for e in batches[0]] == ["response.output_item.added", "response.content_part.added",
                                               "response.reasoning_text.delta"]
    assert batches[0][0]["item"]["type"] == "reasoning"
    assert all(len(batch) == 1 for batch in batches[1:])
    deltas = [batch[-1] for batch in batches]
    assert {d["type"] for d in deltas} == {"response.reasoning_text.delta"}
    assert [d["delta"] for d in deltas] == [WORDS[i % len(WORDS)].decode() for i in range(50)]
    seqs = [e["sequence_number"] for batch in batches for e in batch]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_every_read_of_a_harmony_stream_leaves_as_one_write_of_its_delta() -> None:
    """vLLM's generate frames of one token each: the header's make no write, then one per word."""
    writes = run(50, harmony=True)
    assert len(writes) == 50
    batches = [sse_events(w) for w in writes]
    assert [e["type"] for e in batches[0]] == ["response.output_item.added", "response.content_part.added",
                                               "response.output_text.delta"]
    assert all(len(batch) == 1 for batch in batches[1:])
    deltas = [batch[-1] for batch in batches]
    assert [d["delta"] for d in deltas] == [WORDS[i % len(WORDS)].decode() for i in range(50)]
    seqs = [e["sequence_number"] for batch in batches for e in batch]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
