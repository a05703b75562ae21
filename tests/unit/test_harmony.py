"""The harmony dialect (gpt-oss) on plain data, with the real openai-harmony encoding.

The vocabulary is built offline from quicktok-v1 (harmony_vocab.py) into
``$TIKTOKEN_ENCODINGS_BASE`` when that is set, else ``~/.cache/responses-router/harmony``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_harmony import (
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    Role,
    load_harmony_encoding,
)

from router.dialects import harmony_vocab
from router.dialects.deltas import Delta, Finish, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from router.dialects.harmony import HarmonyParser, refuse_media, render_prompt, stop_token_ids
from router.protocol.errors import InvalidRequest

DATE = "2025-06-01"


@pytest.fixture(scope="session")
def vocab_dir(harmony_vocab: Path) -> Path:
    return harmony_vocab


@pytest.fixture(scope="session")
def enc(vocab_dir: Path) -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


# -- the vocabulary ----------------------------------------------------------------


def test_build_vocab_writes_the_official_file(tmp_path: Path) -> None:
    path = harmony_vocab.build_vocab(tmp_path / "v")
    assert path.name == "o200k_base.tiktoken"
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
    assert data.startswith(b"IQ== 0\n")  # "!" is rank 0


def test_ensure_vocab_reuses_a_good_file_and_rebuilds_a_bad_one(tmp_path: Path) -> None:
    path = harmony_vocab.ensure_vocab(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert harmony_vocab.ensure_vocab(tmp_path) == path and path.stat().st_mtime_ns == mtime
    path.write_bytes(b"IQ== 0\n")
    harmony_vocab.ensure_vocab(tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == harmony_vocab.SHA256


def test_build_vocab_errors_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one_token = (1).to_bytes(4, "little") + (1).to_bytes(2, "little") + b"!" + (0).to_bytes(4, "little")
    monkeypatch.setattr(harmony_vocab, "_quicktok_vocab", lambda: one_token)
    with pytest.raises(harmony_vocab.VocabError, match="sha256"):
        harmony_vocab.build_vocab(tmp_path)
    assert not (tmp_path / "o200k_base.tiktoken").exists()
    monkeypatch.setattr(harmony_vocab, "_quicktok_vocab", lambda: one_token[:-2])
    with pytest.raises(harmony_vocab.VocabError, match="truncated"):
        harmony_vocab.build_vocab(tmp_path)
    monkeypatch.undo()
    monkeypatch.setitem(__import__("sys").modules, "quicktok", None)  # not installed
    with pytest.raises(harmony_vocab.VocabError, match="quicktok-v1"):
        harmony_vocab.build_vocab(tmp_path)


def test_cli_harmony_vocab(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    main(["harmony-vocab", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "out" / "o200k_base.tiktoken")
    assert "TIKTOKEN_ENCODINGS_BASE" in captured.err


def test_harmony_loads_exactly_o200k_base_tiktoken_from_the_folder(vocab_dir: Path, tmp_path: Path) -> None:
    """No download: the folder in TIKTOKEN_ENCODINGS_BASE must hold ``o200k_base.tiktoken``."""
    (tmp_path / "o200k.tiktoken").write_bytes((vocab_dir / "o200k_base.tiktoken").read_bytes())
    os.environ[harmony_vocab.ENV_VAR] = str(tmp_path)
    try:
        with pytest.raises(HarmonyError):
            load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        (tmp_path / "o200k.tiktoken").rename(tmp_path / "o200k_base.tiktoken")
        assert load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).name == "HarmonyGptOss"
    finally:
        os.environ[harmony_vocab.ENV_VAR] = str(vocab_dir)


# -- rendering ---------------------------------------------------------------------


def user(text: str) -> dict:
    return {"type": "message", "id": "msg_u", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str, phase: str | None = None) -> dict:
    item = {"type": "message", "id": "msg_a", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    if phase:
        item["phase"] = phase
    return item


def reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": "fc_1", "call_id": call_id, "name": name, "arguments": arguments}


def output(call_id: str, out: object) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": out}


WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def render(enc: HarmonyEncoding, items: list[dict], **kw: object) -> str:
    args: dict = {"instructions": None, "tools": None, "reasoning_effort": None, "current_date": DATE, **kw}
    return enc.decode(render_prompt(items, encoding=enc, **args))


def assert_in_order(text: str, *parts: str) -> None:
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} not found (in order) in:\n{text}"
        at = found + len(part)


def test_plain_user_turn(enc: HarmonyEncoding) -> None:
    text = render(enc, [user("Hello")])
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {DATE}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>user<|message|>Hello<|end|><|start|>assistant"
    )


def test_instructions_tools_and_folded_system_messages(enc: HarmonyEncoding) -> None:
    items = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        user("Weather in Paris?"),
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use metric units."}]},
    ]
    tools = [WEATHER, {"type": "web_search"}]
    text = render(enc, items, instructions="You are a weather bot.", tools=tools, reasoning_effort="high",
                  knowledge_cutoff="2024-07")
    assert_in_order(
        text,
        "<|start|>system<|message|>",
        "Knowledge cutoff: 2024-07\nCurrent date: 2025-06-01",
        "Reasoning: high",
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>",
        "<|start|>developer<|message|># Instructions\n\nYou are a weather bot.\n\nBe brief.\n\nUse metric units.",
        "# Tools\n\n## functions\n\nnamespace functions {\n\n// Get the weather.\ntype get_weather = (_: {\ncity: string,\n}) => any;",
        "} // namespace functions<|end|>",
        "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant",
    )
    assert text.endswith("<|start|>assistant")
    assert "Be brief." not in text.split("<|start|>developer")[0]  # folded, not a separate message
    assert text.count("<|start|>user") == 1


def test_reasoning_effort_and_date_defaults(enc: HarmonyEncoding) -> None:
    assert "Reasoning: low" in render(enc, [user("x")], reasoning_effort="low")
    assert "Reasoning: low" in render(enc, [user("x")], reasoning_effort="minimal")
    text = enc.decode(render_prompt([user("x")], instructions=None, tools=None, reasoning_effort=None, encoding=enc))
    assert "Reasoning: medium" in text and "Current date: 20" in text


def test_tool_round_trip(enc: HarmonyEncoding) -> None:
    items = [
        user("Weather in Paris?"),
        reasoning("Need the weather tool."),
        call("call_1", "get_weather", '{"city":"Paris"}'),
        output("call_1", '{"temp":20}'),
    ]
    text = render(enc, items, tools=[WEATHER])
    tail = text[text.index("<|start|>user"):]
    assert tail == (
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp":20}<|end|>'
        "<|start|>assistant"
    )


def test_tool_output_parts_and_unknown_call_id(enc: HarmonyEncoding) -> None:
    items = [user("q"), call("call_1", "f", "{}"), output("call_1", [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}])]
    assert "<|start|>functions.f to=assistant<|channel|>commentary<|message|>ab<|end|>" in render(enc, items)
    with pytest.raises(InvalidRequest, match="call_9"):
        render(enc, [user("q"), output("call_9", "x")])


def test_old_chain_of_thought_is_dropped_the_current_tool_loop_is_kept(enc: HarmonyEncoding) -> None:
    items = [
        user("What is 2+2?"),
        reasoning("OLD-COT-1 simple arithmetic."),
        assistant("4."),
        user("And the weather in Paris?"),
        reasoning("OLD-COT-2 call the tool."),
        call("call_1", "get_weather", '{"city":"Paris"}'),
        output("call_1", '{"temp":20}'),
        reasoning("OLD-COT-3 answer now."),
        assistant("It is 20 degrees."),
        user("And in Rome?"),
        reasoning("NEW-COT-1 call the tool again."),
        assistant("Let me check.", phase="commentary"),
        call("call_2", "get_weather", '{"city":"Rome"}'),
        output("call_2", '{"temp":25}'),
        reasoning("NEW-COT-2 got it."),
    ]
    text = render(enc, items, tools=[WEATHER])
    assert "OLD-COT" not in text
    assert_in_order(
        text,
        "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>final<|message|>4.<|end|>",
        "<|start|>user<|message|>And the weather in Paris?<|end|>",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp":20}<|end|>',
        "<|start|>assistant<|channel|>final<|message|>It is 20 degrees.<|end|>",
        "<|start|>user<|message|>And in Rome?<|end|>",
        "<|start|>assistant<|channel|>analysis<|message|>NEW-COT-1 call the tool again.<|end|>",
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>",
        '{"city":"Rome"}<|call|>',
        '{"temp":25}<|end|>',
        "<|start|>assistant<|channel|>analysis<|message|>NEW-COT-2 got it.<|end|><|start|>assistant",
    )
    assert text.endswith("NEW-COT-2 got it.<|end|><|start|>assistant")


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}
FILE = {"type": "input_file", "file_data": "data:text/plain;base64,aGk=", "filename": "a.txt"}


def refused(written: list[dict], resolved: list[dict] | None = None, history: list[dict] | None = None,
            history_param: str = "previous_response_id") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        refuse_media(written, written if resolved is None else resolved, history or [], model="gpt-oss", history_param=history_param)
    assert err.value.code == "unsupported_content_type" and err.value.type == "invalid_request_error"
    assert "'gpt-oss' reads text only" in err.value.message
    return err.value


def test_media_parts_are_refused_by_name() -> None:
    """gpt-oss reads text only: a part harmony cannot render is a 400 naming it, never dropped."""
    look = {**user("look"), "content": [{"type": "input_text", "text": "look"}, IMAGE]}
    error = refused([user("hi"), look])
    assert error.param == "input[1].content[1]" and "input[1].content[1] is an input_image part" in error.message
    answer = output("call_1", [{"type": "input_text", "text": "a"}, FILE])
    error = refused([user("q"), call("call_1", "f", "{}"), answer])
    assert error.param == "input[2].output[1]" and "input_file" in error.message
    text_only = [user("q"), call("call_1", "f", "{}"), output("call_1", [{"type": "input_text", "text": "a"}]), output("call_2", "x")]
    refuse_media(text_only, text_only, [reasoning("r"), assistant("a")], model="gpt-oss", history_param="conversation")


def test_media_from_a_reference_or_the_history_names_the_earlier_item() -> None:
    stored = {**user("look"), "id": "msg_old", "content": [IMAGE]}
    reference = {"type": "item_reference", "id": "msg_old"}
    error = refused([user("hi"), reference], resolved=[user("hi"), stored])
    assert error.param == "input[1]" and "refers to item 'msg_old', whose content[0] is an input_image part" in error.message
    error = refused([user("more")], history=[user("a"), assistant("b"), stored])
    assert error.param == "previous_response_id" and "'msg_old' (from previous_response_id)" in error.message
    assert refused([user("more")], history=[stored], history_param="conversation").param == "conversation"


def test_a_prompt_with_media_is_never_rendered_without_it(enc: HarmonyEncoding) -> None:
    """What renders a prompt without a create's checks (input_tokens counts) refuses as clearly."""
    with pytest.raises(InvalidRequest, match="input_image part at content\\[1\\]") as err:
        render(enc, [{**user("look"), "content": [{"type": "input_text", "text": "look"}, IMAGE]}])
    assert err.value.param == "input" and err.value.code == "unsupported_content_type"


def test_stop_token_ids(enc: HarmonyEncoding) -> None:
    ids = stop_token_ids(enc)
    assert sorted(enc.decode([t]) for t in ids) == ["<|call|>", "<|return|>"]


# -- parsing -----------------------------------------------------------------------


def tokens(enc: HarmonyEncoding, text: str) -> list[int]:
    """A completion as the model writes it (the prompt ended in ``<|start|>assistant``)."""
    return enc.encode(text, allowed_special="all")


def rendered(enc: HarmonyEncoding, *messages: Message, end: str) -> list[int]:
    """Assistant messages rendered by openai-harmony, as a completion: each message ends in
    ``<|end|>`` (a rendered call ends in ``<|call|>``, which would end the turn), the last in ``end``."""
    ids: list[int] = []
    for m in messages:
        ids += enc.render(m)[:-1] + tokens(enc, "<|end|>")
    assert ids[:2] == tokens(enc, "<|start|>assistant")
    return ids[2:-1] + tokens(enc, end)


def parse(enc: HarmonyEncoding, ids: list[int], reason: str | None = "stop", one_by_one: bool = False) -> list[Delta]:
    parser = HarmonyParser(enc)
    out: list[Delta] = []
    if one_by_one:
        for t in ids:
            out += parser.feed([t])
    else:
        out += parser.feed(ids)
    return out + parser.finish(reason)


def summary(deltas: list[Delta]) -> dict:
    """What the assembler would build, minus random ids."""
    texts: list[list] = []
    calls: dict[int, list] = {}
    reasoning_text = ""
    for d in deltas:
        if type(d) is TextDelta:
            if texts and texts[-1][0] == d.phase:
                texts[-1][1] += d.text
            else:
                texts.append([d.phase, d.text])
        elif type(d) is ReasoningDelta:
            reasoning_text += d.text
        elif type(d) is ToolCallDelta:
            if d.index not in calls:
                assert d.call_id and d.call_id.startswith("call_") and d.name, d
                calls[d.index] = [d.name, ""]
            else:
                assert d.call_id is None and d.name is None
            calls[d.index][1] += d.arguments
    finishes = [d.reason for d in deltas if type(d) is Finish]
    return {"text": texts, "reasoning": reasoning_text, "calls": calls, "finish": finishes}


def test_analysis_then_final(enc: HarmonyEncoding) -> None:
    ids = rendered(
        enc,
        Message.from_role_and_content(Role.ASSISTANT, "The user greets. Reply.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "Hello! 👋 How can I help?").with_channel("final"),
        end="<|return|>",
    )
    deltas = parse(enc, ids, one_by_one=True)
    assert [type(d) for d in deltas[:2]] == [ReasoningDelta, ReasoningDelta]
    assert summary(deltas) == {
        "text": [[None, "Hello! 👋 How can I help?"]], "reasoning": "The user greets. Reply.", "calls": {}, "finish": ["stop"],
    }
    assert deltas[-1] == Finish("stop")
    assert summary(parse(enc, ids)) == summary(deltas)


def test_function_call_streams_its_arguments(enc: HarmonyEncoding) -> None:
    text = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
    deltas = parse(enc, tokens(enc, text), one_by_one=True)
    first = next(d for d in deltas if type(d) is ToolCallDelta)
    assert first.index == 0 and first.name == "get_weather" and first.call_id.startswith("call_")
    fragments = [d.arguments for d in deltas if type(d) is ToolCallDelta and d.arguments]
    assert len(fragments) > 3
    assert json.loads("".join(fragments)) == {"city": "Paris", "unit": "celsius"}
    result = summary(deltas)
    assert result == {"text": [], "reasoning": "Need weather.", "calls": {0: ["get_weather", result["calls"][0][1]]},
                      "finish": ["tool_calls"]}
    assert summary(parse(enc, tokens(enc, text))) == result
    # the recipient in the role header, as openai-harmony renders history, parses the same
    ids = rendered(enc, Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
                   .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"), end="<|call|>")
    assert summary(parse(enc, ids))["calls"] == {0: ["get_weather", '{"city": "Paris"}']}


def test_two_function_calls_in_one_turn(enc: HarmonyEncoding) -> None:
    text = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "CET"}<|call|>')
    deltas = parse(enc, tokens(enc, text), one_by_one=True)
    heads = [d for d in deltas if type(d) is ToolCallDelta and d.call_id]
    assert [(d.index, d.name) for d in heads] == [(0, "get_weather"), (1, "get_time")]
    assert heads[0].call_id != heads[1].call_id
    assert summary(deltas) == {"text": [], "reasoning": "", "finish": ["tool_calls"],
                               "calls": {0: ["get_weather", '{"city": "Paris"}'], 1: ["get_time", '{"tz": "CET"}']}}
    assert summary(parse(enc, tokens(enc, text))) == summary(deltas)


@pytest.mark.parametrize("recipient", ["browser.search", "python", "container.exec"])
def test_builtin_tool_calls_keep_the_recipient_as_name(enc: HarmonyEncoding, recipient: str) -> None:
    text = f'<|channel|>analysis<|message|>Search it.<|end|><|start|>assistant<|channel|>analysis to={recipient} code<|message|>{{"query": "harmony"}}<|call|>'
    assert summary(parse(enc, tokens(enc, text))) == {
        "text": [], "reasoning": "Search it.", "calls": {0: [recipient, '{"query": "harmony"}']}, "finish": ["tool_calls"],
    }


def test_commentary_preamble_is_text_with_a_phase(enc: HarmonyEncoding) -> None:
    text = ('<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{}<|call|>')
    assert summary(parse(enc, tokens(enc, text))) == {
        "text": [["commentary", "Checking the weather."]], "reasoning": "", "calls": {0: ["get_weather", "{}"]},
        "finish": ["tool_calls"],
    }


def test_length_cut(enc: HarmonyEncoding) -> None:
    ids = tokens(enc, "<|channel|>analysis<|message|>Thinking.<|end|><|start|>assistant<|channel|>final<|message|>The answer is")
    assert summary(parse(enc, ids, "length")) == {
        "text": [[None, "The answer is"]], "reasoning": "Thinking.", "calls": {}, "finish": ["length"],
    }
    # cut inside the second header: the header is dropped, not shown as text
    ids = tokens(enc, "<|channel|>analysis<|message|>Thinking.<|end|><|start|>assistant<|channel|>fin")
    assert summary(parse(enc, ids, "length")) == {"text": [], "reasoning": "Thinking.", "calls": {}, "finish": ["length"]}


@pytest.mark.parametrize("reason,expected", [("length", "length"), ("stop", "stop"), (None, "stop")])
def test_text_without_channel_tokens_is_flushed(enc: HarmonyEncoding, reason: str | None, expected: str) -> None:
    deltas = parse(enc, tokens(enc, "Plain text, no header at all."), reason, one_by_one=True)
    assert deltas == [TextDelta("Plain text, no header at all."), Finish(expected)]  # type: ignore[arg-type]
    deltas = parse(enc, tokens(enc, "Plain text.<|return|>"), "stop")
    assert deltas == [TextDelta("Plain text."), Finish("stop")]


def test_engine_that_strips_the_stop_token(enc: HarmonyEncoding) -> None:
    ids = tokens(enc, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}")
    assert summary(parse(enc, ids, "stop"))["finish"] == ["tool_calls"]
    ids = tokens(enc, "<|channel|>final<|message|>Done.")
    assert summary(parse(enc, ids, "stop"))["finish"] == ["stop"]


def test_garbage_ends_without_raising(enc: HarmonyEncoding) -> None:
    ids = tokens(enc, "<|channel|>final<|message|>Fine.<|end|>then text where a start token belongs")
    parser = HarmonyParser(enc)
    out = parser.feed(ids)
    assert parser.done and parser.error and "start token" in parser.error
    assert parser.feed(tokens(enc, "more")) == []
    out += parser.finish("stop", Usage(10, 5))
    assert out == [TextDelta("Fine."), Finish("stop"), Usage(10, 5)]
    assert parser.finish("stop") == []  # one Finish only
    for bad in ([-1], [2**40], [300000, 5]):
        deltas = parse(enc, bad, "length")
        assert deltas[-1] == Finish("length") and sum(type(d) is Finish for d in deltas) == 1


def test_tokens_after_the_end_are_ignored(enc: HarmonyEncoding) -> None:
    parser = HarmonyParser(enc)
    out = parser.feed(tokens(enc, "<|channel|>final<|message|>Hi<|return|><|start|>assistant<|channel|>final<|message|>more"))
    assert out == [TextDelta("Hi"), Finish("stop")] and parser.done
    assert parser.finish("length") == []


SPECIAL = list(range(199998, 200019))
token_ids = st.one_of(
    st.integers(0, 199997),
    st.sampled_from(SPECIAL),
    st.sampled_from([17196, 173781, 35644, 12606, 815, 316, 28, 44580, 775, 170154, 3490, 5701, 10848, 92]),  # header words
    st.integers(199998, 201087),
    st.integers(201088, 2**32 - 1),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(token_ids, max_size=60), st.sampled_from([None, "stop", "length", "abort"]), st.data())
def test_random_tokens_never_raise_and_end_once(enc: HarmonyEncoding, ids: list[int], reason: str | None, data: st.DataObject) -> None:
    whole = parse(enc, ids, reason)
    assert sum(type(d) is Finish for d in whole) == 1 and type(whole[-1]) is Finish
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    parser = HarmonyParser(enc)
    pieces: list[Delta] = []
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        pieces += parser.feed(ids[a:b])
    pieces += parser.finish(reason)
    assert summary(pieces) == summary(whole)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["analysis", "final", "commentary", "tool"]), min_size=1, max_size=4),
       st.lists(st.text(max_size=12), min_size=4, max_size=4), st.booleans())
def test_well_formed_streams_round_trip(enc: HarmonyEncoding, channels: list[str], texts: list[str], cut: bool) -> None:
    messages = []
    for i, channel in enumerate(channels):
        body = texts[i]
        if channel == "tool":
            body = json.dumps({"q": body})
            m = Message.from_role_and_content(Role.ASSISTANT, body).with_channel("commentary") \
                .with_recipient(f"functions.f{i}").with_content_type("<|constrain|>json")
        else:
            m = Message.from_role_and_content(Role.ASSISTANT, body).with_channel(channel)
        messages.append((channel, body, m))
    ids = rendered(enc, *(m for _, _, m in messages), end="<|call|>" if channels[-1] == "tool" else "<|return|>")
    if cut:
        ids = ids[:-1]
    result = summary(parse(enc, ids, "length" if cut else "stop", one_by_one=True))
    assert result == summary(parse(enc, ids, "length" if cut else "stop"))
    assert result["reasoning"] == "".join(b for c, b, _ in messages if c == "analysis")
    calls = [b for c, b, _ in messages if c == "tool"]
    assert [a for _, a in result["calls"].values()] == calls
    assert "".join(t for _, t in result["text"]) == "".join(b for c, b, _ in messages if c in ("final", "commentary"))
    assert result["finish"] == ["length" if cut else "tool_calls" if calls else "stop"]
