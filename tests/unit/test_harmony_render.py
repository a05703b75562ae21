"""Prompts from kept renderings (router/dialects/harmony_render.py) against openai-harmony rendering
the whole conversation, on random conversations: the same token ids, first time and every time after.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import Conversation, HarmonyEncoding, Role

from router.dialects import harmony_render
from router.dialects.harmony import prompt_messages, prompt_specs, render_prompt

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"type": "function", "name": "lookup"}]


def _turn(kind: str, words: str, n: int) -> list[dict[str, Any]]:
    """One piece of a conversation as Responses items."""
    if kind == "user":
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}]
    if kind in ("final", "commentary"):
        item: dict[str, Any] = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": words}]}
        if kind == "commentary":
            item["phase"] = "commentary"
        return [item]
    if kind == "reasoning":
        return [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": words or "r"}]}]
    if kind == "developer":
        return [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": words}]}]
    if kind == "call":
        call_id = f"call_{n}"
        return [{"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": '{"city":"%s"}' % n},  # noqa: UP031 - JSON's braces
                {"type": "function_call_output", "call_id": call_id, "output": words}]
    if kind == "search":
        return [{"type": "web_search_call", "id": f"ws_{n}", "status": "completed",
                 "action": {"type": "search", "query": words}, "_output": "results"}]
    return [{"type": "code_interpreter_call", "id": f"ci_{n}", "status": "completed", "code": words, "outputs": [],
             "_output": "out"}]


turns = st.lists(st.tuples(st.sampled_from(["user", "user", "final", "commentary", "reasoning", "developer", "call",
                                            "search", "python"]), text), min_size=1, max_size=10)
options = st.fixed_dictionaries({
    "instructions": st.one_of(st.none(), text),
    "tools": st.sampled_from([None, [], TOOLS, TOOLS[:1]]),
    "reasoning_effort": st.sampled_from([None, "low", "medium", "high"]),
    "current_date": st.sampled_from(["2026-11-29", "2025-01-01"]),
    "builtin_tools": st.sampled_from([(), ("browser",), ("python",), ("browser", "python")]),
})


def whole(enc: HarmonyEncoding, items: list[dict[str, Any]], opts: dict[str, Any]) -> list[int]:
    """What openai-harmony renders for the whole conversation at once."""
    head, rest = prompt_messages(items, **opts)
    conversation = Conversation.from_messages(head + rest)
    return list(enc.render_conversation_for_completion(conversation, Role.ASSISTANT, harmony_render.KEEP_ALL))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(turns, options), min_size=1, max_size=3))
def test_kept_renderings_give_what_the_whole_conversation_renders(enc: HarmonyEncoding,
                                                                   conversations: list[tuple[list[Any], Any]]) -> None:
    for growing in (False, True):
        for plan, opts in conversations:
            items = [item for n, (kind, words) in enumerate(plan) for item in _turn(kind, words, n)]
            if growing:  # turn by turn, as a chain does: each prompt extends the one before
                for end in range(1, len(items) + 1):
                    assert render_prompt(items[:end], encoding=enc, **opts) == whole(enc, items[:end], opts)
            else:
                assert render_prompt(items, encoding=enc, **opts) == whole(enc, items, opts)


def test_a_full_cache_starts_over(enc: HarmonyEncoding, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = harmony_render.RenderedMessages(enc)
    monkeypatch.setattr(harmony_render, "MAX_TOKENS", 40)
    opts = {"instructions": None, "tools": None, "reasoning_effort": None, "current_date": "2026-11-29"}
    for n in range(6):
        items = _turn("user", f"message number {n} " * 3, n)
        assert cache.prompt(*prompt_specs(items, **opts)) == whole(enc, items, opts)
        assert cache._tokens <= 40 or len(cache._kept) == 1


def test_a_message_rendered_once_is_not_rendered_again(enc: HarmonyEncoding) -> None:
    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(enc, name)

        def render(self, message: Any) -> list[int]:
            self.calls += 1
            return enc.render(message)

        def render_conversation(self, conversation: Any, config: Any) -> list[int]:
            self.calls += 1
            return enc.render_conversation(conversation, config)

    counting = Counting()
    cache = harmony_render.RenderedMessages(counting)  # type: ignore[arg-type]
    opts = {"instructions": "be brief", "tools": TOOLS, "reasoning_effort": None, "current_date": "2026-11-29"}
    items = [item for n, kind in enumerate(["user", "call", "final", "user"]) for item in _turn(kind, f"words {n}", n)]
    first = cache.prompt(*prompt_specs(items, **opts))
    assert counting.calls == 1 + 5  # the head together, then user, call, tool output, answer, user
    items += _turn("final", "more", 9) + _turn("user", "next", 10)
    assert cache.prompt(*prompt_specs(items, **opts))[:len(first) - 2] == first[:-2]  # the same prefix
    assert counting.calls == 6 + 2  # only the two new messages


def test_kept_messages_are_not_built_again(enc: HarmonyEncoding, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept rendering is found by the message's data: no openai-harmony message is built for it."""
    opts = {"instructions": "be brief", "tools": TOOLS, "reasoning_effort": "high", "current_date": "2026-11-29"}
    items = [item for n, kind in enumerate(["user", "call", "final", "user"]) for item in _turn(kind, f"words {n}", n)]
    expected = {effort: whole(enc, items, {**opts, "reasoning_effort": effort}) for effort in ("high", "low")}
    built: list[Any] = []
    build = harmony_render.MessageSpec.message
    monkeypatch.setattr(harmony_render.MessageSpec, "message", lambda spec: built.append(spec) or build(spec))
    cache = harmony_render.RenderedMessages(enc)
    heads: list[int] = []

    def prompt(effort: str) -> list[int]:
        key, head, rest = prompt_specs(items, **{**opts, "reasoning_effort": effort})
        return cache.prompt(key, lambda: heads.append(1) or head(), rest)

    assert prompt("high") == expected["high"]
    assert len(heads) == 1 and len(built) == 5  # the head, then user, call, tool output, answer, user
    assert prompt("high") == expected["high"]
    assert len(heads) == 1 and len(built) == 5  # nothing built the second time
    assert prompt("low") == expected["low"]  # another head: built and rendered; the rest still kept
    assert len(heads) == 2 and len(built) == 5


def test_schemas_that_render_apart_are_kept_apart(enc: HarmonyEncoding) -> None:
    """NaN, infinity and null (which JSON serializers make one), 1 and 1.0: each its own head
    (openai-harmony refuses NaN and infinity: so must the kept renderings, every time)."""
    def outcome(render: Any) -> Any:
        try:
            return render()
        except ValueError as exc:
            return type(exc)

    cache = harmony_render.RenderedMessages(enc)
    items = _turn("user", "hi", 0)
    for default in (None, float("nan"), float("inf"), 1, 1.0, True, "1", None, float("nan")):
        tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "number", "default": default}}}}]
        opts = {"instructions": None, "tools": tools, "reasoning_effort": None, "current_date": "2026-11-29"}
        kept = outcome(lambda: cache.prompt(*prompt_specs(items, **opts)))  # noqa: B023 - called at once
        assert kept == outcome(lambda: whole(enc, items, opts)), default  # noqa: B023
