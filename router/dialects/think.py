"""``<think>...</think>`` in streamed content -> reasoning and text deltas.

For models served without a reasoning parser. Tags may be split across
chunks, so a possible tag prefix at a chunk's end is held back until the
next chunk decides it.
"""

from __future__ import annotations

from router.dialects.deltas import Delta, ReasoningDelta, TextDelta

OPEN = "<think>"
CLOSE = "</think>"


class ThinkSplitter:
    def __init__(self) -> None:
        self._thinking = False
        self._held = ""

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        text = self._held + text
        self._held = ""
        while text:
            tag = CLOSE if self._thinking else OPEN
            at = text.find(tag)
            if at >= 0:
                self._emit(text[:at], out)
                self._thinking = not self._thinking
                text = text[at + len(tag):]
                continue
            keep = _partial_suffix(text, tag)
            self._emit(text[: len(text) - keep], out)
            self._held = text[len(text) - keep:]
            break
        return out

    def flush(self) -> list[Delta]:
        """The end of the answer: whatever was held back is plain content after all."""
        out: list[Delta] = []
        held, self._held = self._held, ""
        self._emit(held, out)
        return out

    def _emit(self, text: str, out: list[Delta]) -> None:
        if text:
            out.append(ReasoningDelta(text) if self._thinking else TextDelta(text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
