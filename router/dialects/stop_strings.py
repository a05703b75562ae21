"""A request's ``stop`` strings on a harmony pool: the text cut where the engine stopped.

vLLM and SGLang check stop strings on their own detokenized text and, on the token-level wire,
return the ids up to and including the token that completes one (vLLM 0.32
v1/engine/detokenizer.py drops only the tokens after it; SGLang never trims output_ids), then
finish "stop" with no harmony end token. The router reads those ids itself, so it cuts the text
as the engine's own text would be cut: before the first stop string (through it, with
``include_stop_str_in_output``), and holds back, while streaming, any end of the text that may
still become one. Each message's text is matched apart (the engine's text has harmony's headers
between them); a match the router cannot see (inside a header or a tool call's arguments) still
ends the turn, with what was read.
"""

from __future__ import annotations

from router.dialects.deltas import Delta, Finish, ReasoningDelta, TextDelta, Usage


class StopStrings:
    """Filters one turn's deltas: text and reasoning cut at the first stop string, nothing after it."""

    __slots__ = ("_stops", "_keep", "_longest", "_key", "_text", "_sent", "stopped")

    def __init__(self, stops: str | list[str], keep: bool) -> None:
        self._stops = [s for s in ([stops] if isinstance(stops, str) else stops) if s]
        self._keep = keep
        self._longest = max((len(s) for s in self._stops), default=0)
        self._key: tuple[type, str | None] | None = None  # the message being read: its delta kind and phase
        self._text = ""  # that message's text so far
        self._sent = 0  # how much of it went out
        self.stopped = False  # a stop string was found: nothing more is text

    def filter(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for delta in deltas:
            kind = type(delta)
            if kind is TextDelta or kind is ReasoningDelta:
                if self.stopped:
                    continue
                key = (kind, delta.phase if kind is TextDelta else None)  # type: ignore[union-attr]
                if key != self._key:
                    self._flush(out)
                    self._key = key
                self._add(delta.text, out)  # type: ignore[union-attr]
            elif kind is Finish or kind is Usage:
                self._flush(out)
                out.append(delta)
            elif not self.stopped:  # a tool call's fragment or a refusal: another message
                self._flush(out)
                self._key = None
                out.append(delta)
        return out

    def _add(self, text: str, out: list[Delta]) -> None:
        before = len(self._text)
        self._text += text
        start = max(0, before - self._longest + 1)  # a match not found yet ends in the new text
        found = [(at, stop) for stop in self._stops if (at := self._text.find(stop, start)) >= 0]
        if found:
            at, stop = min(found)
            self._emit(self._text[self._sent:at + len(stop) if self._keep else at], out)
            self.stopped = True
            return
        end = len(self._text) - self._held()
        if end > self._sent:
            self._emit(self._text[self._sent:end], out)
            self._sent = end

    def _held(self) -> int:
        """How much of the text's end may still begin a stop string (not sent yet)."""
        text = self._text
        for size in range(min(self._longest - 1, len(text) - self._sent), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0

    def _flush(self, out: list[Delta]) -> None:
        """The message ended: what was held back goes out."""
        if not self.stopped and self._sent < len(self._text):
            self._emit(self._text[self._sent:], out)
        self._key, self._text, self._sent = None, "", 0

    def _emit(self, piece: str, out: list[Delta]) -> None:
        if not piece or self._key is None:
            return
        kind, phase = self._key
        out.append(TextDelta(piece, phase=phase) if kind is TextDelta else ReasoningDelta(piece))
