"""Harmony prompts rendered from messages rendered before.

openai-harmony (0.0.8) rebuilds its whole special-token table each time it
renders a formatting token, so rendering one message costs ~0.1 ms here and
a conversation of N messages N times that, on every turn: measured, 10 ms of
CPU per request at 100 messages, 41 ms at 400. A conversation's messages do
not change from one turn to the next, so each is rendered once and its token
ids kept (the key is the message's own JSON, what openai-harmony hands its
renderer, ~5 us to make).

What is kept is what openai-harmony renders, checked by tests/test_harmony_render.py
against ``render_conversation_for_completion`` on random conversations: the
system and developer messages are rendered together as a conversation (the
system message says more when the developer message has function tools),
every later message alone, then the ``<|start|>assistant`` that opens the
answer.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable

from openai_harmony import Conversation, HarmonyEncoding, Message, RenderConversationConfig, Role

MAX_TOKENS = 1 << 20  # token ids kept (4 bytes each); past it the cache starts over
# openai-harmony drops no analysis message: router/dialects/harmony.py chooses which to send.
KEEP_ALL = RenderConversationConfig(auto_drop_analysis=False)


class RenderedMessages:
    """Token ids of rendered messages, for one encoding (rendered with ``KEEP_ALL``)."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self._encoding = encoding
        self._kept: dict[str, array[int]] = {}
        self._tokens = 0
        empty = Conversation.from_messages([])
        self._start = list(encoding.render_conversation_for_completion(empty, Role.ASSISTANT, KEEP_ALL))

    def prompt(self, head: list[Message], rest: list[Message]) -> list[int]:
        """``render_conversation_for_completion(head + rest, assistant)``, from kept renderings.

        ``head``: the system and developer messages (rendered together); ``rest``: the others."""
        ids: list[int] = []
        ids += self._ids("\0".join(["head", *(m.to_json() for m in head)]), lambda: self._conversation(head))
        for message in rest:
            ids += self._ids(message.to_json(), lambda: self._encoding.render(message))  # noqa: B023 - called at once
        ids += self._start
        return ids

    def _conversation(self, messages: list[Message]) -> list[int]:
        return list(self._encoding.render_conversation(Conversation.from_messages(messages), KEEP_ALL))

    def _ids(self, key: str, render: Callable[[], list[int]]) -> array[int]:
        found = self._kept.get(key)
        if found is None:
            found = array("I", render())
            if self._tokens + len(found) > MAX_TOKENS:
                self._kept.clear()
                self._tokens = 0
            self._kept[key] = found
            self._tokens += len(found)
        return found


@functools.cache
def rendered_messages(encoding: HarmonyEncoding) -> RenderedMessages:
    """The one cache per encoding (a process loads one)."""
    return RenderedMessages(encoding)
