"""router/dialects/harmony_parse.py's HarmonyParser against the reference built on
openai-harmony's StreamableParser (tests/unit/harmony_oracle.py), with the real encoding.

Both parsers get the same token ids in the same chunks, then ``finish(reason)``; each
``feed`` / ``finish`` must give the same deltas (tool call ids masked: they are random),
the same ``done``, and both must agree on whether an error stopped them. Streams are
well-formed harmony (any channel, recipient, content type, content split anywhere in its
UTF-8, other authors' messages, every ending) or garbage: header text from an alphabet
of odd words, white space and markers, special ids anywhere, ids outside the vocabulary
and ids that are no u32, plain bytes that are no UTF-8.
"""

from __future__ import annotations

import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st
from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser

from router.dialects.deltas import Delta, ToolCallDelta
from router.dialects.harmony import _action_ends
from router.dialects.harmony_parse import HarmonyParser, ParseError, _parse_header
from tests.unit.harmony_oracle import OracleParser

Piece = tuple[str, object]  # ("special" | "plain", text), ("bytes", bytes) or ("ids", list[int])




# -- streams ------------------------------------------------------------------------

SPECIALS = ["<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
SPECIAL_IDS = [199998, 199999, 200000, 200001, 200002, 200003, 200004, 200005, 200006, 200007, 200008, 200012, 201087]
CHANNELS = st.sampled_from([None, "analysis", "final", "commentary", "commentary.x", "analysis<"])
RECIPIENTS = st.sampled_from([None, None, None, "functions.get_weather", "functions.x", "browser.search", "python", "assistant", ""])
CONSTRAINS = st.sampled_from(["", " <|constrain|>json", "<|constrain|>json", " json", " code", " <|constrain|>"])
ROLES = st.sampled_from(
    ["assistant"] * 6 + ["user", "tool", "system", "developer", "functions.x", "browser.search", "Assistant", "to=functions.x"]
)
ENDINGS = st.sampled_from(["<|end|>"] * 4 + ["<|return|>", "<|call|>", ""])  # <|end|>: more messages follow
CONTENT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=16) | st.sampled_from(["héllo wörld", "日本語のテキスト", "🙂🚀 ok", '{"q": "ü"}'])
# header words, white space Rust and Python disagree on (\x0b \x1c \x85 \u3000), markers
HEADER_WORDS = st.sampled_from([
    "assistant", "user", "tool", "developer", "Assistant", "foo", "to=", "to=functions.f", "functions.f", "json", "analysis",
    "final", "commentary", " ", "  ", "\t", "\n", "\x0b", "\x1c", "\x85", "\u3000", "<", "<|channel|>", "<|constrain|>",
    "<|start|>", "x", "é", "to=a b",
])


@st.composite
def header(draw: st.DrawFn, first: bool) -> str:
    """A well-formed header, the recipient before or after the channel (role omitted when
    the prompt gave it)."""
    role = draw(st.sampled_from(["", "", "", "assistant", "user"])) if first else draw(ROLES)
    channel, recipient = draw(CHANNELS), draw(RECIPIENTS)
    constrain = draw(CONSTRAINS) if recipient is not None or draw(st.sampled_from([False] * 5 + [True])) else ""
    to = f" to={recipient}" if recipient is not None else ""
    chan = f"<|channel|>{channel}" if channel is not None else ""
    if draw(st.booleans()):
        return f"{role}{to}{chan}{constrain}"
    return f"{role}{chan}{to}{constrain}"


@st.composite
def content(draw: st.DrawFn) -> list[Piece]:
    """Text tokenized as the model would, or byte by byte (UTF-8 split across tokens), or
    bytes that are no UTF-8."""
    text = draw(CONTENT)
    how = draw(st.sampled_from(["tokens", "bytes", "cut", "bad"]))
    if how == "tokens":
        return [("plain", text)]
    data = text.encode()
    if how == "cut":  # maybe inside a character
        data = data[: draw(st.integers(1, len(data)))]
    elif how == "bad":
        data = draw(st.binary(max_size=6)) + data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=3))
    return [("bytes", data)]


@st.composite
def message(draw: st.DrawFn, first: bool) -> list[Piece]:
    start = [] if first else [("special", "<|start|>")]
    if draw(st.sampled_from(["well-formed"] * 4 + ["fuzz"])) == "well-formed":
        head = draw(header(first))
    else:
        head = "".join(draw(st.lists(HEADER_WORDS, min_size=1, max_size=6)))
    body = draw(content())
    return [*start, ("special", head), ("special", "<|message|>"), *body, ("special", draw(ENDINGS))]


@st.composite
def garbage(draw: st.DrawFn) -> list[Piece]:
    """Special ids anywhere, words, plain and odd ids, a header cut short."""
    ids = st.one_of(
        st.sampled_from(SPECIAL_IDS),
        st.integers(0, 199997),
        st.integers(201088, 2**32 - 1),  # outside the vocabulary
        st.sampled_from([-1, 2**32, 2**40]),  # no u32
    )
    return draw(st.lists(
        st.tuples(st.just("ids"), st.lists(ids, min_size=1, max_size=3))
        | st.tuples(st.just("special"), st.sampled_from(SPECIALS))
        | st.tuples(st.just("special"), HEADER_WORDS)
        | content().map(lambda pieces: pieces[0]),
        max_size=5,
    ))


@st.composite
def stream(draw: st.DrawFn) -> list[Piece]:
    """Messages (the first in the header the prompt opened), garbage between them sometimes."""
    pieces: list[Piece] = []
    for i in range(draw(st.integers(1, 4))):
        pieces += draw(message(first=i == 0))
        if draw(st.sampled_from([False] * 5 + [True])):
            pieces += draw(garbage())
    return pieces


def token_ids(enc: HarmonyEncoding, byte_ids: dict[int, int], pieces: list[Piece]) -> list[int]:
    ids: list[int] = []
    for kind, value in pieces:
        if kind == "special":  # header text: markers as special tokens
            ids += enc.encode(str(value), allowed_special="all")
        elif kind == "plain":  # content: markers as plain text
            ids += enc.encode(str(value), disallowed_special=())
        elif kind == "bytes":
            ids += [byte_ids[b] for b in bytes(value)]  # type: ignore[arg-type]
        else:
            ids += list(value)  # type: ignore[call-overload]
    return ids


# -- comparison ---------------------------------------------------------------------


def masked(deltas: list[Delta]) -> list[Delta]:
    return [
        dataclasses.replace(d, call_id="call_*") if type(d) is ToolCallDelta and d.call_id is not None else d
        for d in deltas
    ]


def run(parser: HarmonyParser | OracleParser, ids: list[int], cuts: list[int], reason: str | None) -> list[object]:
    """Each call's deltas and ``done``, then whether an error stopped it."""
    seen: list[object] = []
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        seen.append((masked(parser.feed(ids[a:b])), parser.done))
    seen.append((masked(parser.finish(reason)), parser.done))
    seen.append(parser.error is None)
    return seen


def same_as_oracle(enc: HarmonyEncoding, ids: list[int], cuts: list[int], reason: str | None) -> None:
    expected = run(OracleParser(enc), ids, cuts, reason)
    parser = HarmonyParser(enc)
    assert run(parser, ids, cuts, reason) == expected, ids
    assert parser.reasoning_tokens == analysis_tokens(enc, ids), ids


def analysis_tokens(enc: HarmonyEncoding, ids: list[int]) -> int:
    """usage's reasoning_tokens as vLLM's Responses server counts them: the tokens after which
    StreamableParser's ``current_channel`` is ``analysis``, up to the turn's end or an error."""
    parser = StreamableParser(enc, Role.ASSISTANT, strict=False)
    ends = set(_action_ends(enc))
    count = 0
    for token in ids:
        try:
            parser.process(token)
        except Exception:  # noqa: BLE001 - garbage: the parsers stop there
            break
        count += parser.current_channel == "analysis"
        if token in ends:
            break
    return count


def test_reasoning_tokens_are_the_analysis_messages(enc: HarmonyEncoding) -> None:
    """Each analysis message's <|message|> and content, built-in calls on it included; nothing of
    the final answer, of commentary, or after the turn's end."""
    think, code, answer = (enc.encode(t, disallowed_special=()) for t in ("a b c", "print(1)", "x y"))
    ids = enc.encode("<|channel|>analysis<|message|>", allowed_special="all") + think
    ids += enc.encode("<|end|><|start|>assistant<|channel|>final<|message|>", allowed_special="all") + answer
    ids += enc.encode("<|end|><|start|>assistant<|channel|>analysis to=python code<|message|>", allowed_special="all")
    ids += code + enc.encode("<|call|><|channel|>analysis<|message|>", allowed_special="all") + think
    parser = HarmonyParser(enc)
    parser.feed(ids)
    assert parser.reasoning_tokens == (1 + len(think)) + (1 + len(code)) == analysis_tokens(enc, ids)


REASONS = st.sampled_from([None, "stop", "length", "abort"])


@settings(max_examples=400, deadline=None)
@given(stream(), REASONS, st.data())
@example([("special", "<|channel|>analysis"), ("special", "<|message|>"), ("bytes", b"\xe2\x82A\xff\xffb"), ("special", "<|end|>")], "stop", None)
@example([("special", "a b c"), ("special", "<|message|>")], "stop", None)  # rejected first header: flushed as text
@example([("special", "<|message|>x<|end|><|start|>user to=x"), ("special", "")], "stop", None)  # cut: not text
@example([("special", "\x0bassistant\x0b<|channel|>final\x0b<|message|>x<|end|><|start|>\x0bAssistant\x0b to=x<|message|>y")], None, None)
@example([("special", "<|channel|>analysis\x85<|message|>x")], None, None)  # U+0085 ends a channel name
@example([("special", "<|message|>x<|end|><|start|>to=functions.f<|message|>x<|end|><|start|>assistant<|message|>y")], None, None)
@example([("special", "<|message|>"), ("bytes", "é".encode()[:1]), ("special", "<|end|><|start|>assistant<|message|>"), ("plain", "x")], None, None)
@example([("plain", "<|channel|> x"), ("special", "<|end|>")], "stop", None)  # a textual marker, no channel
@example([("special", "x"), ("ids", [300000]), ("special", "<|end|>")], "stop", None)
@example([("special", "<|message|>"), ("plain", "a"), ("ids", [300000]), ("plain", "b"), ("special", "<|end|><|start|>")], None, None)
def test_same_deltas_as_streamable_parser(
    enc: HarmonyEncoding, byte_ids: dict[int, int], pieces: list[Piece], reason: str | None, data: st.DataObject | None
) -> None:
    ids = token_ids(enc, byte_ids, pieces)
    if data and data.draw(st.booleans()):  # cut anywhere (a big range: hypothesis prefers small ints)
        ids = ids[: data.draw(st.integers(0, 2**20)) % (len(ids) + 1)]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=5))) if data else []
    same_as_oracle(enc, ids, cuts, reason)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(SPECIAL_IDS) | st.integers(0, 600) | st.integers(199990, 201100), max_size=40), REASONS, st.data())
def test_same_on_random_ids(enc: HarmonyEncoding, ids: list[int], reason: str | None, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=5)))
    same_as_oracle(enc, ids, cuts, reason)


@settings(max_examples=500, deadline=None)
@given(st.lists(HEADER_WORDS, max_size=8).map("".join), st.booleans())
@example("assistant<|channel|>x<|constrain|>json", False)
@example("foo to=a", False)
def test_headers_parse_as_streamable_parser(enc: HarmonyEncoding, text: str, first: bool) -> None:
    """Role, channel and recipient of a header, or its rejection, exactly as StreamableParser's;
    and the parsers' deltas when that header is followed by a message, cut by a stop token, or
    left open."""
    before = "" if first else "<|message|>x<|end|><|start|>"
    for after in ("<|message|>y<|end|>", "<|end|>", "<|return|>", ""):
        same_as_oracle(enc, enc.encode(before + text + after, allowed_special="all"), [], "stop")
    reference = StreamableParser(enc, Role.ASSISTANT if first else None, strict=False)
    try:
        for token in enc.encode(text if first else "<|start|>" + text, allowed_special="all"):
            reference.process(token)
        reference.process(enc.encode("<|message|>", allowed_special="all")[0])
        role = reference.current_role
        expected: object = (role and role.value, reference.current_channel, reference.current_recipient)
    except HarmonyError:
        expected = "rejected"
    try:
        header = _parse_header(text, first)
        got: object = (header.role, header.channel, header.recipient)
    except ParseError:
        got = "rejected"
    assert got == expected
