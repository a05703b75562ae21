"""Normalized deltas: what every dialect produces and the assembler consumes.

A dialect turns an engine's answer (chat chunks, harmony tokens) into this
small vocabulary, so the assembler never knows which engine spoke.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


@dataclass(slots=True, frozen=True)
class TextDelta:
    text: str


@dataclass(slots=True, frozen=True)
class Finish:
    """The engine stopped; ``length`` means the output token budget ran out."""

    reason: FinishReason


@dataclass(slots=True, frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


Delta = TextDelta | Finish | Usage
