"""router/api/passthrough.py ``_usage``: the usage of a relayed answer, parsed alone, is the answer's own."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.api.passthrough import _usage

counts = st.one_of(st.none(), st.integers(0, 10**9))
usages = st.fixed_dictionaries({"prompt_tokens": counts, "completion_tokens": counts, "total_tokens": counts},
                               optional={"prompt_tokens_details": st.one_of(st.none(), st.fixed_dictionaries(
                                   {"cached_tokens": counts})),
                                   "completion_tokens_details": st.one_of(st.none(), st.fixed_dictionaries(
                                       {"reasoning_tokens": counts, "nested": st.dictionaries(st.text(), counts)})),
                                   "note": st.text(alphabet="{}\"\\:,ab ")})  # braces in a string: not counted


@settings(max_examples=500)
@given(st.text(), usages, st.booleans())
def test_the_usage_found_by_its_key_is_the_answers_own(text: str, usage: dict[str, Any], stream: bool) -> None:
    """Whatever the answer's text holds (quotes, braces, a ``"usage":{`` of its own), the usage read
    is the one a whole parse gives, in an answer and in a stream's ``data:`` line."""
    answer: dict[str, Any] = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                              "usage": usage, "kv_transfer_params": None}
    raw = orjson.dumps(answer)
    assert _usage(b"data: " + raw if stream else raw) == orjson.loads(raw)["usage"]


@given(st.text())
def test_an_answer_without_a_usage_object_has_none(text: str) -> None:
    for answer in ({"choices": [{"text": text}]}, {"choices": [], "usage": None}, {"text": text, "usage": 3}):
        assert _usage(orjson.dumps(answer)) is None
    assert _usage(b'{"usage":{"prompt_tokens":1') is None  # cut off
