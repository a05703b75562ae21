"""Normalized deltas: what every dialect produces and the assembler consumes.

A dialect turns an engine's answer (chat chunks, harmony tokens) into this
small vocabulary, so the assembler never knows which engine spoke.

Not frozen, though nothing changes a delta once made: one is made per streamed
token of reasoning, of harmony text and of tool-call arguments, and measured, a
frozen dataclass costs ~5.5k instructions to make against ~1.7k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


@dataclass(slots=True)
class TextDelta:
    """Visible answer text. A change of ``phase`` starts a new message item
    (harmony's commentary preambles are ``"commentary"``, the answer ``None``
    or ``"final_answer"``)."""

    text: str
    logprobs: list[dict[str, Any]] | None = None
    phase: str | None = None


@dataclass(slots=True)
class ReasoningDelta:
    """Chain-of-thought text (reasoning_content, <think>, harmony analysis)."""

    text: str


class ReasoningText(str):
    """A chunk that is nothing but a piece of reasoning, read as its text without a delta.

    A dialect's ``decode`` gives a plain ``str`` for a piece of the answer and this for
    a piece of reasoning: the runner's per-token fast paths (``Assembler.text`` and
    ``Assembler.reasoning``) tell them apart by type. Anywhere else it is the same as
    ``ReasoningDelta(text)``.
    """

    __slots__ = ()


@dataclass(slots=True)
class RefusalDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    """A fragment of one tool call. ``index`` tells parallel calls of a turn
    apart; ``call_id`` and ``name`` come with the first fragment of a call
    (None later), ``arguments`` is a piece of the JSON arguments text."""

    index: int
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Finish:
    """The engine stopped; ``length`` means the output token budget ran out."""

    reason: FinishReason


@dataclass(slots=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


Delta = TextDelta | ReasoningDelta | RefusalDelta | ToolCallDelta | Finish | Usage
