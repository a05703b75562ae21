"""The reference: router/dialects/harmony.py's ``HarmonyParser`` as it was built on
openai-harmony's ``StreamableParser`` (strict=False), before the router parsed the
tokens itself (router/dialects/harmony_parse.py). Its logic is kept unchanged
(only renamed ``OracleParser``); tests/unit/test_harmony_parse.py checks that the new
parser produces the same deltas, ``done`` and ``error is None`` on the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from openai_harmony import HarmonyEncoding, Role, StreamableParser

from router.dialects.deltas import Delta, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from router.dialects.harmony import _action_ends
from router.dialects.harmony_parse import _merge
from router.protocol.ids import new_id

_REASONING, _TEXT, _COMMENTARY, _TOOL, _IGNORE = range(5)


class OracleParser:
    """Generated token ids -> deltas, for one turn; wraps ``StreamableParser``. The contract
    (channels, endings, errors) is ``HarmonyParser``'s, in router/dialects/harmony_parse.py."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self._enc = encoding
        self._parser = StreamableParser(encoding, Role.ASSISTANT, strict=False)
        self._return, self._call = _action_ends(encoding)
        self._state = "Header"  # mirrors the parser's state; it only changes on special tokens
        self._header: list[int] = []  # tokens of a header not yet complete
        self._kind = _IGNORE  # what the current message's content becomes
        self._index = -1  # the current tool call's index
        self._calls = 0
        self._finished = False
        self.done = False
        self.error: str | None = None

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        out: list[Delta] = []
        if self.done:
            return out
        parser = self._parser
        is_special = self._enc.is_special_token
        for token in token_ids:
            try:
                special = is_special(token)
                parser.process(token)
                if special:
                    self._transition(token, out)
                    if self.done:
                        break
                elif self._state == "Content":
                    delta = parser.last_content_delta
                    if delta:
                        self._content(delta, out)
                elif self._state == "Header":
                    self._header.append(token)
            except Exception as exc:  # noqa: BLE001 - garbage must never raise
                self.error = f"{type(exc).__name__}: {exc}"
                self.done = True
                break
        return _merge(out)

    def finish(self, reason_from_engine: str | None = None, usage: Usage | None = None) -> list[Delta]:
        out: list[Delta] = []
        if not self._finished:
            if self._state == "Header":
                self._flush_header(out)
            if reason_from_engine == "length":
                out.append(Finish("length"))
            else:
                out.append(Finish("tool_calls" if self._calls else "stop"))
            self._finished = self.done = True
        if usage is not None:
            out.append(usage)
        return _merge(out)

    # -- internals ---------------------------------------------------------

    def _transition(self, token: int, out: list[Delta]) -> None:
        before = self._state
        self._state = state = self._parser.state_data["state"]
        if state == "Header":
            # <|start|> opens a header: kept in it, so a cut header is never flushed as text
            self._header = [*self._header, token] if before == "Header" else [token]
        elif state == "Content":
            if before == "Header":
                self._open(out)
            else:  # a special token inside content is content (as openai-harmony parses it)
                delta = self._parser.last_content_delta
                if delta:
                    self._content(delta, out)
        elif before == "Header":  # a stop token ended a message that never had a header
            self._flush_header(out)
        if token == self._return or token == self._call:
            self._flush_header(out)
            out.append(Finish("tool_calls" if self._calls else "stop"))
            self._finished = self.done = True

    def _open(self, out: list[Delta]) -> None:
        parser = self._parser
        self._header = []
        recipient = parser.current_recipient
        channel = parser.current_channel
        if parser.current_role != Role.ASSISTANT:
            kind = _IGNORE
        elif recipient:
            kind = _TOOL
        elif channel == "analysis":
            kind = _REASONING
        elif channel == "commentary":
            kind = _COMMENTARY
        else:
            kind = _TEXT
        self._kind = kind
        if kind == _TOOL:
            self._index = self._calls
            self._calls += 1
            name = recipient[len("functions.") :] if recipient.startswith("functions.") else recipient
            out.append(ToolCallDelta(self._index, new_id("call"), name))

    def _content(self, text: str, out: list[Delta]) -> None:
        kind = self._kind
        if kind == _TOOL:
            out.append(ToolCallDelta(self._index, arguments=text))
        elif kind == _REASONING:
            out.append(ReasoningDelta(text))
        elif kind == _TEXT:
            out.append(TextDelta(text))
        elif kind == _COMMENTARY:
            out.append(TextDelta(text, phase="commentary"))

    def _flush_header(self, out: list[Delta]) -> None:
        """A header that never completed: plain text if it holds no special token, else dropped."""
        tokens, self._header = self._header, []
        if tokens and not any(self._enc.is_special_token(t) for t in tokens):
            try:
                text = self._enc.decode(tokens)
            except Exception:  # noqa: BLE001 - an id outside the vocabulary
                return
            if text:
                out.append(TextDelta(text))
