"""Harmony prompts rendered from messages rendered before.

openai-harmony (0.0.8) rebuilds its whole special-token table each time it
renders a formatting token, so rendering one message costs ~0.1 ms here and
a conversation of N messages N times that, on every turn: measured, 10 ms of
CPU per request at 100 messages, 41 ms at 400. A conversation's messages do
not change from one turn to the next, so each is rendered once and its token
ids kept.

The key is the message as plain data (``MessageSpec``; the head's key is the
caller's), from which the openai-harmony ``Message`` is built only when it is
not kept. Building one and its JSON for a key cost ~55 us per request (pydantic
models, then ``json.dumps``); a tuple's hash costs well under one.

What is kept is what openai-harmony renders, checked by tests/unit/test_harmony_render.py
against ``render_conversation_for_completion`` on random conversations: the
system and developer messages are rendered together as a conversation (the
system message says more when the developer message has function tools),
every later message alone, then the ``<|start|>assistant`` that opens the
answer.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from openai_harmony import Author, Conversation, HarmonyEncoding, Message, RenderConversationConfig, Role

MAX_TOKENS = 1 << 20  # token ids kept (4 bytes each); past it the cache starts over
# openai-harmony drops no analysis message: router/dialects/harmony.py chooses which to send.
KEEP_ALL = RenderConversationConfig(auto_drop_analysis=False)


class MessageSpec(NamedTuple):
    """A prompt message after the head, as hashable data: all that its ``Message`` is built from."""

    role: Role
    text: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    author: str | None = None  # the tool's name, for a tool's answer

    def message(self) -> Message:
        if self.author is None:
            message = Message.from_role_and_content(self.role, self.text)
        else:
            message = Message.from_author_and_content(Author.new(self.role, self.author), self.text)
        if self.channel is not None:
            message = message.with_channel(self.channel)
        if self.recipient is not None:
            message = message.with_recipient(self.recipient)
        if self.content_type is not None:
            message = message.with_content_type(self.content_type)
        return message


class RenderedMessages:
    """Token ids of rendered messages, for one encoding (rendered with ``KEEP_ALL``)."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self._encoding = encoding
        self._kept: dict[Hashable, array[int]] = {}
        self._tokens = 0
        empty = Conversation.from_messages([])
        self._start = list(encoding.render_conversation_for_completion(empty, Role.ASSISTANT, KEEP_ALL))

    def prompt(self, head_key: Hashable, head: Callable[[], list[Message]], rest: Sequence[MessageSpec]) -> list[int]:
        """``render_conversation_for_completion(head() + rest's messages, assistant)``, from kept renderings.

        ``head``: builds the system and developer messages (rendered together), called only
        when ``head_key`` (all they are built from) is not kept; ``rest``: the others."""
        ids: list[int] = []
        ids += self._ids(("head", head_key), lambda: self._conversation(head()))
        for spec in rest:
            ids += self._ids(spec, lambda: self._encoding.render(spec.message()))  # noqa: B023 - called at once
        ids += self._start
        return ids

    def _conversation(self, messages: list[Message]) -> list[int]:
        return list(self._encoding.render_conversation(Conversation.from_messages(messages), KEEP_ALL))

    def _ids(self, key: Hashable, render: Callable[[], list[int]]) -> array[int]:
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
