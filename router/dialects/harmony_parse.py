"""Generated harmony token ids -> normalized deltas (``HarmonyParser``), for gpt-oss pools.

openai-harmony's ``StreamableParser`` (0.0.8) rebuilds its whole special-token table
when it is built and on each header token (~4M instructions per response), so this
module parses the tokens itself, reproducing what ``StreamableParser(encoding,
Role.ASSISTANT, strict=False)`` reports: its states (Header / Content / ExpectStart),
its header grammar (``_parse_header``, ``_cut_channel``) and its content deltas (the
lossy UTF-8 decoding of ``_lossy_step``). tests/unit/harmony_oracle.py keeps the parser built
on ``StreamableParser`` as the reference; tests/unit/test_harmony_parse.py compares the two.

Pure: no I/O. Token bytes come from the encoding, asked once per id (``_vocab``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from openai_harmony import HarmonyEncoding, HarmonyError

from router.dialects.deltas import Delta, Finish, ReasoningDelta, ReasoningText, TextDelta, ToolCallDelta, Usage
from router.protocol.ids import new_id

# -- the encoding's tokens ----------------------------------------------------------

_Info = tuple[bytes, bool, str | None]  # a token's bytes, whether it is special, its text if valid UTF-8 alone


class _Vocab:
    """Token ids -> bytes, asked of the encoding once per id: each ask crosses into Rust."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self._enc = encoding
        self.known: dict[int, _Info] = {}  # at most the vocabulary's size: ids outside it are not kept
        ids = {t: encoding.encode(t, allowed_special="all")[0] for t in ("<|start|>", "<|message|>", "<|return|>", "<|call|>")}
        self.start, self.message = ids["<|start|>"], ids["<|message|>"]
        self.return_, self.call = ids["<|return|>"], ids["<|call|>"]
        self.stops = frozenset(encoding.stop_tokens())  # what ends a message: <|end|>, <|return|>, <|call|>

    def info(self, token: int) -> _Info | None:
        """The token's bytes etc.; None for an id outside the vocabulary. Raises OverflowError or
        TypeError for what is not a u32, as openai-harmony does."""
        known = self.known.get(token)
        if known is not None:
            return known
        special = self._enc.is_special_token(token)
        try:
            data = self._enc.decode([token], errors="surrogateescape").encode("utf-8", "surrogateescape")
        except HarmonyError:
            return None
        try:
            text: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        known = self.known[token] = (data, special, text)
        return known


@functools.cache
def _vocab(encoding: HarmonyEncoding) -> _Vocab:
    return _Vocab(encoding)


# -- headers ------------------------------------------------------------------------


class ParseError(ValueError):
    """A sequence StreamableParser rejects (a bad header, a token where ``<|start|>`` belongs)."""


# What Rust's char::is_whitespace / str::trim see as white space (Unicode White_Space);
# Python's str.isspace() differs (it also takes U+001C..U+001F).
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
_CHANNEL_END = re.compile(f"[{_WS}<]")
_PARTS = re.compile(r"[^\t\n\x0c\r ]+")  # Rust's split_ascii_whitespace (U+000B is not one)
_CHANNEL = "<|channel|>"
_CONSTRAIN = "<|constrain|>"
_ROLES = frozenset({"user", "assistant", "system", "developer", "tool"})


@dataclass(frozen=True)
class _Header:
    role: str
    channel: str | None
    recipient: str | None


def _cut_channel(text: str) -> tuple[str | None, str]:
    """The channel after the first ``<|channel|>`` (up to white space or ``<``), and the
    text without it."""
    at = text.find(_CHANNEL)
    if at < 0:
        return None, text
    after = text[at + len(_CHANNEL) :]
    end = _CHANNEL_END.search(after)
    cut = end.start() if end else len(after)
    if not cut:
        raise ParseError("channel marker present but no channel value found in header")
    return after[:cut], text[:at] + after[cut:]


def _parse_header(text: str, first: bool) -> _Header:
    """A header's text -> role, channel, recipient, as StreamableParser 0.0.8 parses it.
    ``first``: the header the prompt opened with ``<|start|>assistant`` (role given)."""
    channel, text = _cut_channel(text)
    # "to=f<|constrain|>json": the content type is a word of its own
    parts = _PARTS.findall(text.strip(_WS).replace(_CONSTRAIN, " " + _CONSTRAIN))
    role = "assistant" if first else _role(parts)
    if parts and parts[0] == role:
        del parts[0]
    return _Header(role, channel, _recipient(parts))


def _role(parts: list[str]) -> str:
    """The header's first word when it names a role; an unknown word followed by more (or
    ``to=...``) is a tool's name and is dropped."""
    if not parts:
        raise ParseError("message header did not contain a role")
    if parts[0] in _ROLES:
        return parts[0]
    if len(parts) > 1 or parts[0].startswith("to="):
        del parts[0]
        return "tool"
    raise ParseError(f"Unknown role: {parts[0]}")


def _recipient(parts: list[str]) -> str | None:
    """The last word is ``to=R``, a lone recipient, or a content type after the recipient;
    nothing may remain before them."""
    if not parts:
        return None
    last = parts.pop()
    recipient = last.removeprefix("to=") if last.startswith("to=") or not parts else parts.pop().removeprefix("to=")
    if parts:
        raise ParseError(f"unexpected tokens remaining in message header: {parts!r}")
    return recipient


# -- content ------------------------------------------------------------------------


def _lossy_step(pending: bytes) -> tuple[str, bytes]:
    """Content bytes that are not valid UTF-8 -> (delta, bytes kept), as StreamableParser
    does per token: the valid prefix, then U+FFFD for the FIRST bad sequence only (the
    rest waits for the next token); an incomplete sequence at the end waits too."""
    try:
        return pending.decode("utf-8"), b""
    except UnicodeDecodeError as exc:
        valid, bad = exc.start, exc.end
        truncated = exc.reason == "unexpected end of data"
    delta = pending[:valid].decode("utf-8")
    if truncated:
        return delta, pending[valid:]
    return delta + "\ufffd", pending[bad:]


# -- generated tokens -> deltas ---------------------------------------------------

_REASONING, _TEXT, _COMMENTARY, _TOOL, _IGNORE = range(5)
_HEADER, _CONTENT, _EXPECT_START = range(3)  # StreamableParser's states
_HANDLED = (ValueError, OverflowError, TypeError)  # garbage: bad headers, ids that are no u32


class HarmonyParser:
    """Generated token ids -> deltas, for one turn; parses as openai-harmony 0.0.8's
    ``StreamableParser(strict=False)`` (see the module's docstring).

    Channels: ``analysis`` -> ReasoningDelta; ``final`` (or none) -> TextDelta;
    ``commentary`` without a recipient -> TextDelta(phase="commentary"); any message
    with a recipient (on any channel) -> ToolCallDelta: ``functions.X`` -> name X,
    anything else (``browser.search``, ``python``, ``container.exec``, ...) -> name =
    the recipient, for the tool loop to decide. Messages of other authors (a model
    imagining a tool's answer) are ignored.

    Endings: ``<|return|>`` or ``<|call|>`` end the turn at once in ``feed`` (later
    tokens are ignored) with Finish("tool_calls") if the turn made a call, else
    Finish("stop"). Otherwise ``finish(engine_reason)`` ends it: "length" ->
    Finish("length"), anything else (an engine that strips the stop token, an
    abort) -> "tool_calls" if the turn made a call, else "stop".
    A message whose header never completed (the model wrote plain text, no channel
    tokens) is flushed as text when it ends or at ``finish``.

    Invalid sequences never raise: an error (a header StreamableParser rejects, a
    token other than ``<|start|>`` after a message, an id that is no u32) stops the
    parsing; what was produced stays, later tokens are ignored, ``done`` turns true
    (the caller may abort the engine) and ``error`` says why; ``finish`` then ends
    as above. Exactly one Finish is produced per parser. Token ids are ints.

    ``reasoning_tokens``: the tokens read inside analysis-channel messages, each one's
    ``<|message|>`` and content (any author or recipient), as vLLM's Responses server counts
    them (a token after which StreamableParser's ``current_channel`` is ``analysis``).
    """

    def __init__(self, encoding: HarmonyEncoding) -> None:
        self._vocab = _vocab(encoding)
        self._state = _HEADER  # the prompt ended in <|start|>assistant
        self._first = True  # in that first header, whose role is given (only it may be flushed as text)
        self._header: list[int] = []  # tokens of a header not yet complete
        self._pending = b""  # content bytes waiting for the rest of a UTF-8 sequence
        self._lost = False  # an id outside the vocabulary in this message's content: no more deltas
        self._kind = _IGNORE  # what the current message's content becomes
        self._index = -1  # the current tool call's index
        self._calls = 0
        self._analysis = False  # the current message is on the analysis channel
        self.reasoning_tokens = 0
        self._finished = False
        self.done = False
        self.error: str | None = None

    def feed(self, token_ids: Iterable[int]) -> list[Delta]:
        out: list[Delta] = []
        if self.done:
            return out
        tokens = token_ids if type(token_ids) is list else list(token_ids)
        at, end = 0, len(tokens)
        while at < end:
            try:
                if self._state == _CONTENT and not self._pending and not self._lost:
                    after = self._plain_run(tokens, at, out)
                    if after > at:
                        at = after
                        continue
                self._step(tokens[at], out)
            except _HANDLED as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                self.done = True
            if self.done:
                break
            at += 1
        return _merge(out)

    def plain(self, token: int) -> str | None:
        """``feed([token])``'s one delta as its text when that is a piece of the answer (a ``str``)
        or of the reasoning (a ``ReasoningText``), else None, and then nothing changed: feed it.

        The per-token fast path (``HarmonyTurn.decode``): a content token valid UTF-8 alone, none
        pending, in a text or reasoning message, where ``_content`` makes exactly that delta and
        changes no state (tests/unit/test_harmony_fast_path.py compares the two)."""
        if self._state != _CONTENT or self._pending or self._lost or self.done:
            return None
        info = self._vocab.known.get(token)
        if info is None or not info[2] or token in self._vocab.stops:
            return None
        kind = self._kind
        if kind == _TEXT:
            return info[2]
        if kind == _REASONING:
            self.reasoning_tokens += 1
            return ReasoningText(info[2])
        return None

    def finish(self, reason_from_engine: str | None = None, usage: Usage | None = None) -> list[Delta]:
        out: list[Delta] = []
        if not self._finished:
            if self._state == _HEADER:
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

    def _step(self, token: int, out: list[Delta]) -> None:
        vocab = self._vocab
        state = self._state
        if state == _CONTENT:
            if token in vocab.stops:
                self._close(token, out)
            else:
                self._content(token, out)
                self.reasoning_tokens += self._analysis
        elif state == _HEADER:
            if token == vocab.message:
                self._open(out)
            elif token in vocab.stops:
                self._cut_header(token, out)
            else:
                vocab.info(token)  # an id that is no u32 is an error here too
                self._header.append(token)
        elif token == vocab.start:
            self._state = _HEADER
        else:
            raise ParseError(f"Unexpected token {token} while expecting start token {vocab.start}")

    def _header_text(self) -> str:
        """The header's text; raises for an id outside the vocabulary or invalid UTF-8."""
        infos = [self._vocab.info(t) for t in self._header]
        if any(info is None for info in infos):
            raise ParseError("could not decode header: a token outside the vocabulary")
        return b"".join(info[0] for info in infos if info).decode("utf-8")

    def _open(self, out: list[Delta]) -> None:
        """``<|message|>`` ends the header: what the content becomes (a tool call opens here)."""
        header = _parse_header(self._header_text(), self._first)
        self._state, self._first, self._header = _CONTENT, False, []
        recipient, channel = header.recipient, header.channel
        self._analysis = channel == "analysis"
        self.reasoning_tokens += self._analysis  # <|message|> itself
        if header.role != "assistant":
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
            assert recipient
            self._index = self._calls
            self._calls += 1
            name = recipient[len("functions.") :] if recipient.startswith("functions.") else recipient
            out.append(ToolCallDelta(self._index, new_id("call"), name))

    def _cut_header(self, token: int, out: list[Delta]) -> None:
        """A stop token before ``<|message|>``: StreamableParser (strict=False) still decodes
        the first header and reads its channel, which may fail."""
        if self._first and self._header:
            _cut_channel(self._header_text())
        self._flush_header(out)
        self._state, self._first = _EXPECT_START, False
        if token == self._vocab.return_ or token == self._vocab.call:
            self._end_turn(out)

    def _close(self, token: int, out: list[Delta]) -> None:
        self._state, self._pending, self._lost, self._analysis = _EXPECT_START, b"", False, False
        if token == self._vocab.return_ or token == self._vocab.call:
            self._end_turn(out)

    def _end_turn(self, out: list[Delta]) -> None:
        out.append(Finish("tool_calls" if self._calls else "stop"))
        self._finished = self.done = True

    def _plain_run(self, tokens: list[int], at: int, out: list[Delta]) -> int:
        """Content tokens from ``at`` on that are valid UTF-8 alone and no stop, as one delta;
        where the run ends. With nothing pending each such token's delta is its own text and
        changes no state, so the run's one delta is what ``_content`` per token, then ``_merge``,
        would give: a non-stream answer (all its tokens in one ``feed``) costs a dict lookup
        per token instead of ~40 lines."""
        known, stops = self._vocab.known, self._vocab.stops
        texts: list[str] = []
        for token in islice(tokens, at, None):
            info = known.get(token)
            if info is None or info[2] is None or token in stops:
                break
            texts.append(info[2])
        if self._analysis:
            self.reasoning_tokens += len(texts)
        text = "".join(texts)
        if text:
            kind = self._kind
            if kind == _TEXT:
                out.append(TextDelta(text))
            elif kind == _REASONING:
                out.append(ReasoningDelta(text))
            elif kind == _TOOL:
                out.append(ToolCallDelta(self._index, arguments=text))
            elif kind == _COMMENTARY:
                out.append(TextDelta(text, phase="commentary"))
        return at + len(texts)

    def _content(self, token: int, out: list[Delta]) -> None:
        info = self._vocab.known.get(token) or self._vocab.info(token)  # the first: per token, cheaper
        if self._lost:
            return
        if info is None:
            self._lost = True  # StreamableParser keeps the id and never decodes again
            return
        if info[2] is not None and not self._pending:
            text = info[2]
        else:
            text, self._pending = _lossy_step(self._pending + info[0])
        if not text:
            return
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
        """The first header, never completed: plain text if it holds no special token, else dropped
        (a later header holds the ``<|start|>`` that opened it)."""
        tokens, self._header = self._header, []
        if not self._first or not tokens:
            return
        infos = [self._vocab.info(t) for t in tokens]
        if any(info is None or info[1] for info in infos):
            return
        text = b"".join(info[0] for info in infos if info).decode("utf-8", "replace")
        if text:
            out.append(TextDelta(text))


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent fragments of the same kind as one delta: fewer events per upstream read."""
    if len(deltas) < 2:
        return deltas
    out: list[Delta] = []
    run: list[str] = []  # texts of a run of mergeable deltas, joined once
    head: Delta | None = None  # the run's first delta
    for delta in deltas:
        if head is not None and _joins(head, delta):
            run.append(delta.arguments if type(delta) is ToolCallDelta else delta.text)  # type: ignore[union-attr]
            continue
        if head is not None:
            out.append(_joined(head, run))
        head, run = delta, []
    if head is not None:
        out.append(_joined(head, run))
    return out


def _joins(head: Delta, delta: Delta) -> bool:
    kind = type(delta)
    if kind is not type(head):
        return False
    if kind is TextDelta:
        return delta.phase == head.phase and not delta.logprobs and not head.logprobs  # type: ignore[union-attr]
    if kind is ToolCallDelta:
        return delta.index == head.index and delta.call_id is None and delta.name is None  # type: ignore[union-attr]
    return kind is ReasoningDelta


def _joined(head: Delta, run: list[str]) -> Delta:
    if not run:
        return head
    if type(head) is TextDelta:
        return TextDelta(head.text + "".join(run), phase=head.phase)
    if type(head) is ReasoningDelta:
        return ReasoningDelta(head.text + "".join(run))
    assert type(head) is ToolCallDelta
    return ToolCallDelta(head.index, head.call_id, head.name, head.arguments + "".join(run))
