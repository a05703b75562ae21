"""SGLang's cumulative generate frames read as incremental ones (router/dialects/sglang_frames.py),
against parsing every frame whole: the same generate steps, on random streams."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engines import GenerateReader
from router.dialects.chat_chunks import chunk_object
from router.dialects.sglang_frames import CumulativeFrames

# Text pieces: plain words, and what JSON escapes or a multi-byte character.
piece = st.one_of(st.sampled_from([" the", " router", "\"", "\\", "\n", "\x01", "é", "日本", "\U0001f600", "}", "]", ","]),
                  st.text(max_size=4))
ids_step = st.lists(st.integers(0, 201_087), max_size=3)


@st.composite
def streams(draw: Any) -> list[bytes]:
    """The payloads of one stream, as SGLang variants write them."""
    cumulative_ids = draw(st.booleans()) or draw(st.booleans())  # late-2025 builds: incremental ids
    spaced = draw(st.booleans())  # json.dumps' separators instead of orjson's compact ones
    meta_first = draw(st.integers(0, 9)) == 0  # keys in another order
    steps = draw(st.lists(st.tuples(ids_step, piece, st.integers(0, 19)), min_size=1, max_size=25))
    ids: list[int] = []
    text = ""
    out = []
    for n, (new, words, odd) in enumerate(steps):
        ids += new
        text += words
        if odd == 0 and text:
            text = text[:-1] + "\ufffd"  # a detokenizer that revised the last character
        meta: dict[str, Any] = {"id": "r1", "finish_reason": None, "prompt_tokens": 12,
                                "completion_tokens": len(ids), "cached_tokens": 0}
        if n == len(steps) - 1:
            meta["finish_reason"] = {"type": "stop", "matched": 200_002}
        frame: dict[str, Any] = {"text": text, "output_ids": ids if cumulative_ids else new, "meta_info": meta}
        if meta_first:
            frame = {"meta_info": meta, **{k: v for k, v in frame.items() if k != "meta_info"}}
        if odd == 1:
            frame["index"] = 0
        out.append(json.dumps(frame).encode() if spaced else orjson.dumps(frame))
    if draw(st.integers(0, 9)) == 0:
        out.insert(draw(st.integers(0, len(out))), orjson.dumps({"error": {"message": "boom"}}))
    return out


def steps_of(payloads: list[bytes], read: Any) -> list[Any]:
    reader = GenerateReader("sglang")
    out = []
    for payload in payloads:
        frame = read(payload)
        if "error" in frame:
            out.append(("error", frame["error"]))
            continue
        out.append(reader.step(frame))
    return out


@settings(max_examples=400, deadline=None)
@given(streams())
def test_the_same_steps_as_whole_frames(payloads: list[bytes]) -> None:
    assert steps_of(payloads, CumulativeFrames().read) == steps_of(payloads, chunk_object)


def test_a_cumulative_stream_is_read_without_what_came_before() -> None:
    ids: list[int] = []
    text = ""
    frames = CumulativeFrames()
    for n in range(200):
        ids.append(1000 + n)
        text += f' word "{n}" é\\'
        meta = {"id": "r1", "finish_reason": None, "prompt_tokens": 12, "completion_tokens": len(ids)}
        frame = frames.read(orjson.dumps({"text": text, "output_ids": ids, "meta_info": meta, "index": 0}))
        if n == 0:
            assert frame["output_ids"] == [1000] and frame["text"] == text  # the first one is parsed whole
        else:
            assert frame == {"text": "", "output_ids": [1000 + n], "meta_info": meta, "index": 0}


def test_incremental_ids_with_the_text_so_far_are_read_without_the_text() -> None:
    """Late-2025 builds: each frame's new ids, but all the text so far."""
    frames = CumulativeFrames()
    text = ""
    for n in range(50):
        text += f" w{n}"
        meta = {"completion_tokens": 2 * (n + 1)}
        frame = frames.read(orjson.dumps({"text": text, "output_ids": [n, n], "meta_info": meta}))
        assert frame["output_ids"] == [n, n] and frame["meta_info"] == meta
        assert frame["text"] == (text if n == 0 else "")


def test_an_id_that_only_grew_is_not_taken_for_a_new_one() -> None:
    frames = CumulativeFrames()
    meta = {"completion_tokens": 1}
    assert frames.read(b'{"text":"a","output_ids":[12],"meta_info":%s}' % orjson.dumps(meta))["output_ids"] == [12]
    # Same count, the id's bytes extended: not a continuation, so parsed whole.
    frame = frames.read(b'{"text":"ab","output_ids":[123],"meta_info":%s}' % orjson.dumps(meta))
    assert frame["output_ids"] == [123] and frame["text"] == "ab"
