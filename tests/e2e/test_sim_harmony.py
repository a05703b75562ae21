"""The sim's harmony mode (backends/sim/harmony.py) as a process, over raw HTTP.

Prompts are rendered with openai-harmony (system, developer with function tools,
user); the generated ids are read back with openai-harmony's StreamableParser
and with the router's HarmonyParser. The vocabulary is built offline
(router/dialects/harmony_vocab.py), as in tests/unit/test_harmony.py.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from backends.sim.harmony import CALL, RETURN, cut_ids, function_args
from router.dialects import harmony_vocab
from router.dialects.deltas import Finish, ToolCallDelta
from router.dialects.harmony import HarmonyParser
from tests.support.sim_proc import ROOT, Sim

END = 200007  # <|end|>
WEATHER = {"type": "object", "required": ["location", "unit"], "properties": {
    "location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer"}}}


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    folder = os.environ.get(harmony_vocab.ENV_VAR) or str(
        Path.home() / ".cache" / "responses-router" / "harmony")
    path = harmony_vocab.ensure_vocab(folder)
    os.environ[harmony_vocab.ENV_VAR] = str(path.parent)
    return path.parent


@pytest.fixture(scope="module")
def enc(vocab_dir: Path) -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _sim(vocab_dir: Path, *args: str) -> Sim:
    return Sim("--dialect", "harmony", "--harmony-vocab-dir", str(vocab_dir), *args)


@pytest.fixture(scope="module")
def vllm(vocab_dir: Path):
    sim = _sim(vocab_dir)
    yield sim
    assert sim.stop() == 0


@pytest.fixture(scope="module")
def sglang(vocab_dir: Path):
    sim = _sim(vocab_dir, "--engine", "sglang")
    yield sim
    assert sim.stop() == 0


@pytest.fixture(scope="module")
def sglang_inc(vocab_dir: Path):
    sim = _sim(vocab_dir, "--engine", "sglang", "--incremental-streaming-output")
    yield sim
    assert sim.stop() == 0


@pytest.fixture(params=["vllm", "sglang", "sglang_inc"])
def engine(request) -> tuple[str, Sim]:
    return request.param, request.getfixturevalue(request.param)


def prompt(enc: HarmonyEncoding, text: str, tool_reply: str | None = None) -> list[int]:
    tools = [ToolDescription.new("get_weather", "Weather of a city", WEATHER),
             ToolDescription.new("noargs", "Takes nothing", None)]
    messages = [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(
            "2025-06-01").with_browser_tool().with_python_tool()),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(
            "Be brief.").with_function_tools(tools)),
        Message.from_role_and_content(Role.USER, text)]
    if tool_reply is not None:
        messages += [
            Message.from_role_and_content(Role.ASSISTANT, '{"location":"x"}').with_channel(
                "commentary").with_recipient("functions.get_weather").with_content_type(
                "<|constrain|>json"),
            Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"),
                                            tool_reply).with_channel("commentary")
            .with_recipient("assistant")]
    return list(enc.render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT))


def parse(enc: HarmonyEncoding, ids: list[int]) -> list[tuple]:
    """(channel, recipient, content_type, text) of each complete message."""
    parser = StreamableParser(enc, Role.ASSISTANT)
    for token in ids:
        parser.process(token)
    return [(m.channel, m.recipient, m.content_type, "".join(c.text for c in m.content))
            for m in parser.messages]


def sse(payload: bytes) -> list[dict]:
    frames = [f[len("data: "):] for f in payload.decode().split("\n\n") if f]
    assert all(f.startswith("data: ") for f in payload.decode().split("\n\n") if f)
    assert frames[-1] == "[DONE]" and "[DONE]" not in frames[:-1]
    return [json.loads(f) for f in frames[:-1]]


def generate(sim: Sim, engine: str, ids: list[int], stream: bool = False, **sp) -> dict:
    """One generation in the engine's wire -> {ids, finish, matched, frames, body}."""
    if engine == "vllm":
        body = {"token_ids": ids, "sampling_params": {"temperature": 0, **sp}, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        status, _, payload = sim.request("POST", "/inference/v1/generate", body)
        assert status == 200, payload
        if not stream:
            out = json.loads(payload)
            choice = out["choices"][0]
            return {"ids": choice["token_ids"], "finish": choice["finish_reason"], "body": out}
        frames = sse(payload)
        chunks = [f["choices"][0] for f in frames if f["choices"]]
        assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        return {"ids": [t for c in chunks for t in c["token_ids"]],
                "finish": chunks[-1]["finish_reason"], "frames": frames}
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, **sp}, "stream": stream}
    status, _, payload = sim.request("POST", "/generate", body)
    assert status == 200, payload
    if not stream:
        out = json.loads(payload)
        fr = out["meta_info"]["finish_reason"]
        return {"ids": out["output_ids"], "finish": fr["type"], "matched": fr.get("matched"),
                "body": out}
    frames = sse(payload)
    assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])
    incremental = json.loads(sim.request("GET", "/server_info")[2])["incremental_streaming_output"]
    out = [t for f in frames for t in f["output_ids"]] if incremental else frames[-1]["output_ids"]
    fr = frames[-1]["meta_info"]["finish_reason"]
    return {"ids": out, "finish": fr["type"], "matched": fr.get("matched"), "frames": frames}


def wire(engine: str) -> str:
    return "vllm" if engine == "vllm" else "sglang"


# ---------------------------------------------------------------- pure pieces


def test_function_args_reads_the_rendered_tool_types(enc):
    text = next(m for m in enc.parse_messages_from_completion_tokens(
        prompt(enc, "hi")[:-2], role=None) if m.author.role == Role.DEVELOPER).content[0].text
    assert function_args(text) == {"get_weather": {"location": "sim", "unit": "c"}, "noargs": {}}


def test_cut_ids_checks_length_before_stop_tokens():
    assert cut_ids([1, 2, RETURN, 3], {RETURN}, 10) == ([1, 2, RETURN], "stop", RETURN)
    assert cut_ids([1, 2, RETURN], {RETURN}, 3) == ([1, 2, RETURN], "length", None)
    assert cut_ids([1, 2, RETURN], {RETURN}, 2) == ([1, 2], "length", None)
    assert cut_ids([1, 2, RETURN], {RETURN}, 0) == ([], "length", None)


def test_missing_vocabulary_fails_fast(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "backends.sim", "--port", "0", "--dialect",
                           "harmony", "--harmony-vocab-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30,
                          env={k: v for k, v in os.environ.items() if k != harmony_vocab.ENV_VAR})
    assert proc.returncode != 0 and "o200k_base.tiktoken" in proc.stderr


# ---------------------------------------------------------------- what is generated


def test_default_answer_is_analysis_then_final(engine, enc):
    name, sim = engine
    ids = prompt(enc, "hello [sim:tokens=5]")
    got = generate(sim, wire(name), ids)
    msgs = parse(enc, got["ids"])
    assert [(c, r) for c, r, _, _ in msgs] == [("analysis", None), ("final", None)]
    assert len(msgs[0][3].split()) == 4 and len(msgs[1][3].split()) == 5
    assert got["ids"][-1] == RETURN and got["finish"] == "stop"
    assert got.get("matched", RETURN) == RETURN
    assert generate(sim, wire(name), ids)["ids"] == got["ids"]  # deterministic
    assert generate(sim, wire(name), prompt(enc, "other [sim:tokens=5]"))["ids"] != got["ids"]


def test_stream_gives_the_same_ids(engine, enc):
    name, sim = engine
    ids = prompt(enc, "stream me [sim:reason=6] [sim:tokens=9]")
    whole = generate(sim, wire(name), ids)
    streamed = generate(sim, wire(name), ids, stream=True)
    assert streamed["ids"] == whole["ids"] and streamed["finish"] == whole["finish"] == "stop"
    assert len(streamed["frames"]) >= len(whole["ids"])  # one id per frame (+ vLLM's usage)
    ids = prompt(enc, "stream me [sim:reason=6] [sim:tokens=9] [sim:chunk=4]")
    chunked = generate(sim, wire(name), ids, stream=True)
    assert chunked["ids"] == generate(sim, wire(name), ids)["ids"]
    assert len(chunked["frames"]) < len(streamed["frames"])


def test_markers_shape_the_messages(engine, enc):
    name, sim = engine
    def msgs(text: str, **kw) -> list[tuple]:
        return parse(enc, generate(sim, wire(name), prompt(enc, text, **kw))["ids"])
    assert [m[0] for m in msgs("[sim:reason=0] [sim:tokens=3]")] == ["final"]
    assert len(msgs("[sim:reason=7]")[0][3].split()) == 7
    pre = msgs("[sim:preamble] [sim:tokens=2]")
    assert [(c, r) for c, r, _, _ in pre] == [("analysis", None), ("commentary", None),
                                               ("final", None)]
    assert msgs("thanks", tool_reply="sunny, 21C")[-1][::3] == ("final", "tool said: sunny, 21C")


def test_function_calls(engine, enc):
    name, sim = engine
    got = generate(sim, wire(name), prompt(enc, "weather? [sim:call=get_weather]"))
    msgs = parse(enc, got["ids"])
    assert [(c, r, t) for c, r, t, _ in msgs] == [
        ("analysis", None, None), ("commentary", "functions.get_weather", "<|constrain|>json")]
    assert json.loads(msgs[1][3]) == {"location": "sim", "unit": "c"}
    assert got["ids"][-1] == CALL and got["finish"] == "stop"
    assert got.get("matched", CALL) == CALL
    # Two calls in one turn: the first ends with <|end|>, the second with <|call|>.
    got = generate(sim, wire(name), prompt(enc, "[sim:call=get_weather,noargs]"))
    msgs = parse(enc, got["ids"])
    assert [m[1] for m in msgs] == [None, "functions.get_weather", "functions.noargs"]
    assert msgs[2][3] == "{}"
    parser = HarmonyParser(enc)
    deltas = parser.feed(got["ids"]) + parser.finish()
    calls = [d for d in deltas if isinstance(d, ToolCallDelta) and d.name]
    assert [c.name for c in calls] == ["get_weather", "noargs"] and parser.error is None
    assert deltas[-1] == Finish("tool_calls")


def test_builtin_tools(engine, enc):
    name, sim = engine
    msgs = parse(enc, generate(sim, wire(name), prompt(
        enc, "find sglang [sim:builtin=browser.search]"))["ids"])
    assert msgs[-1][:3] == ("analysis", "browser.search", "code")
    assert json.loads(msgs[-1][3]) == {"query": "find sglang", "topn": 10}
    msgs = parse(enc, generate(sim, wire(name), prompt(enc, "[sim:builtin=python]"))["ids"])
    assert msgs[-1][1:] == ("python", "code", "print(1 + 1)")


def test_garbage_never_breaks_the_router_parser(engine, enc):
    name, sim = engine
    got = generate(sim, wire(name), prompt(enc, "[sim:garbage=40]"))
    assert len(got["ids"]) == 41 and got["ids"][-1] == RETURN
    assert RETURN not in got["ids"][:-1] and CALL not in got["ids"][:-1]
    parser = HarmonyParser(enc)
    deltas = parser.feed(got["ids"]) + parser.finish()
    assert isinstance(deltas[-1], Finish)


def test_length_cut_and_stop_tokens(engine, enc):
    name, sim = engine
    key = "max_tokens" if name == "vllm" else "max_new_tokens"
    ids = prompt(enc, "[sim:tokens=30]")
    full = generate(sim, wire(name), ids)["ids"]
    cut = generate(sim, wire(name), ids, **{key: 5})
    assert cut["ids"] == full[:5] and cut["finish"] == "length"
    if name != "vllm":
        assert cut["body"]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    # A stop id of the request (here <|end|>) ends after the analysis message.
    stopped = generate(sim, wire(name), ids, stop_token_ids=[END])
    assert stopped["ids"] == full[:full.index(END) + 1] and stopped["finish"] == "stop"
    assert stopped.get("matched", END) == END
    # ignore_eos: <|return|> does not stop; the script simply ends there.
    assert generate(sim, wire(name), ids, ignore_eos=True)["ids"] == full


# ---------------------------------------------------------------- wire shapes


def test_vllm_generate_shapes(vllm, enc):
    ids = prompt(enc, "shape [sim:tokens=4] [sim:cached=32]")
    status, _, payload = vllm.request("POST", "/inference/v1/generate", {
        "request_id": "abc", "model": "sim-model", "token_ids": ids,
        "sampling_params": {"max_tokens": 100}})
    body = json.loads(payload)
    assert status == 200 and body["request_id"] == "generate-tokens-abc"
    assert isinstance(body.pop("created"), int)
    out = body["choices"][0]["token_ids"]
    assert body == {"request_id": "generate-tokens-abc", "model": "sim-model", "choices": [
        {"index": 0, "logprobs": None, "finish_reason": "stop", "token_ids": out,
         "routed_experts": None}], "usage": {
        "prompt_tokens": len(ids), "total_tokens": len(ids) + len(out),
        "completion_tokens": len(out), "prompt_tokens_details": {"cached_tokens": 32}},
        "prompt_logprobs": None, "kv_transfer_params": None}
    frames = generate(vllm, "vllm", ids, stream=True)["frames"]
    assert frames[0] == {"request_id": frames[0]["request_id"], "usage": None, "choices": [
        {"index": 0, "logprobs": None, "finish_reason": None, "token_ids": out[:1]}]}
    assert frames[-1] == {"request_id": frames[0]["request_id"], "choices": [], "usage": {
        "prompt_tokens": len(ids), "total_tokens": len(ids) + len(out),
        "completion_tokens": len(out), "prompt_tokens_details": {"cached_tokens": 32}}}


def test_vllm_completions_fallback(vllm, enc):
    ids = prompt(enc, "fallback [sim:tokens=4]")
    expected = generate(vllm, "vllm", ids)["ids"]
    status, _, payload = vllm.request("POST", "/v1/completions", {
        "model": "sim-model", "prompt": ids, "max_tokens": 200, "return_token_ids": True})
    body = json.loads(payload)
    choice = body["choices"][0]
    assert status == 200 and body["object"] == "text_completion"
    assert choice["token_ids"] == expected and choice["prompt_token_ids"] == ids
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None  # the primary EOS
    assert "<|" not in choice["text"] and body["usage"]["completion_tokens"] == len(expected)
    raw = vllm.request("POST", "/v1/completions", {
        "prompt": ids, "max_tokens": 200, "skip_special_tokens": False})[2]
    text = json.loads(raw)["choices"][0]["text"]
    assert text.startswith("<|channel|>analysis<|message|>") and not text.endswith("<|return|>")
    assert json.loads(raw)["choices"][0]["token_ids"] is None
    call = json.loads(vllm.request("POST", "/v1/completions", {
        "prompt": prompt(enc, "[sim:call=noargs]"), "max_tokens": 200})[2])["choices"][0]
    assert call["stop_reason"] == CALL
    status, _, payload = vllm.request("POST", "/v1/completions", {
        "prompt": ids, "max_tokens": 200, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True}})
    frames = sse(payload)
    chunks = [f["choices"][0] for f in frames[:-1]]
    assert chunks[0]["prompt_token_ids"] == ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == expected
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == len(expected)
    assert json.loads(vllm.request("POST", "/v1/completions", {"prompt": ids})[2])[
        "usage"]["completion_tokens"] == 16  # CompletionRequest's default max_tokens


def test_sglang_shapes_and_text(sglang, enc):
    ids = prompt(enc, "shape [sim:tokens=4] [sim:cached=7]")
    status, _, payload = sglang.request("POST", "/generate", {
        "input_ids": ids, "rid": "r1", "sampling_params": {"max_new_tokens": 100}})
    body = json.loads(payload)
    meta = body["meta_info"]
    assert status == 200 and list(body) == ["text", "output_ids", "meta_info"]
    assert isinstance(meta.pop("e2e_latency"), float)
    out = body["output_ids"]
    assert meta == {"id": "r1", "finish_reason": {"type": "stop", "matched": RETURN},
                    "prompt_tokens": len(ids), "weight_version": "default",
                    "total_retractions": 0, "completion_tokens": len(out), "cached_tokens": 7}
    assert body["text"] == enc.decode([t for t in out if not enc.is_special_token(t)])
    raw = json.loads(sglang.request("POST", "/generate", {"input_ids": ids, "sampling_params": {
        "skip_special_tokens": False}})[2])["text"]
    assert raw == enc.decode(out[:-1])  # the matched <|return|> trimmed from text only
    call_ids = prompt(enc, "[sim:call=noargs]")
    raw = json.loads(sglang.request("POST", "/generate", {"input_ids": call_ids, "sampling_params": {
        "skip_special_tokens": False}})[2])["text"]
    assert raw.endswith("<|call|>")  # kept under the gpt-oss tool-call parser


def test_sglang_cumulative_and_incremental_streams(sglang, sglang_inc, enc):
    ids = prompt(enc, "[sim:call=get_weather] [sim:preamble]")
    final = generate(sglang, "sglang", ids)
    cum = generate(sglang, "sglang", ids, stream=True)
    inc = generate(sglang_inc, "sglang", ids, stream=True)
    assert cum["ids"] == inc["ids"] == final["ids"]
    frames = cum["frames"]
    assert all(f["output_ids"] == final["ids"][:len(f["output_ids"])] for f in frames)
    assert [len(f["output_ids"]) for f in frames] == list(range(1, len(final["ids"]) + 1))
    assert frames[-1]["text"] == final["body"]["text"]
    assert all(len(f["output_ids"]) == 1 for f in inc["frames"])
    assert "".join(f["text"] for f in inc["frames"]) == final["body"]["text"]
    counts = [f["meta_info"]["completion_tokens"] for f in inc["frames"]]
    assert counts == list(range(1, len(final["ids"]) + 1))  # counters stay cumulative


def test_sglang_server_info(sglang, sglang_inc):
    for sim, flag in ((sglang, False), (sglang_inc, True)):
        for path in ("/server_info", "/get_server_info"):
            status, _, payload = sim.request("GET", path)
            info = json.loads(payload)
            assert status == 200 and info["incremental_streaming_output"] is flag
            assert info["stream_output"] is flag
            assert info["max_total_num_tokens"] > 0 and info["version"]


# ---------------------------------------------------------------- aborts, errors, timing


def _slow_stream(sim: Sim, path: str, body: dict, out: list) -> threading.Thread:
    def run() -> None:
        out.append(sse(sim.request("POST", path, body)[2]))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_vllm_abort(vllm, enc):
    for path in ("/abort_requests", "/inference/v1/abort_requests"):
        assert vllm.request("POST", path, {"request_ids": ["nobody"]})[::2] == (200, b"")
    assert vllm.request("POST", "/abort_requests", {})[0] == 400
    ids = prompt(enc, "[sim:tokens=300] [sim:itl_ms=10]")
    out: list = []
    generated = vllm.metrics()["vllm:generation_tokens_total"]
    thread = _slow_stream(vllm, "/inference/v1/generate", {
        "request_id": "slow", "token_ids": ids, "sampling_params": {}, "stream": True,
        "stream_options": {"include_usage": True}}, out)
    vllm.wait_metric("vllm:generation_tokens_total", lambda v: v > generated)  # under way: a token out
    assert vllm.request("POST", "/abort_requests", {"request_ids": ["generate-tokens-slow"]})[0] \
        == 200
    thread.join(timeout=10)
    chunks = [f["choices"][0] for f in out[0] if f["choices"]]
    sent = sum(len(c["token_ids"]) for c in chunks)
    assert 0 < sent < 300 and all(c["finish_reason"] is None for c in chunks)  # no abort chunk
    assert out[0][-1]["usage"]["completion_tokens"] == sent
    # A request still waiting ([sim:hang]) ends at the abort too: no ids, then [DONE].
    out = []
    thread = _slow_stream(vllm, "/inference/v1/generate", {
        "request_id": "stuck", "token_ids": prompt(enc, "[sim:hang]"), "sampling_params": {},
        "stream": True}, out)
    vllm.wait_metric("vllm:num_requests_running", lambda v: v >= 1)  # taken, and waiting
    assert vllm.request("POST", "/inference/v1/abort_requests", {"request_ids": ["stuck"]})[0] \
        == 200
    thread.join(timeout=10)
    assert out == [[]]


def test_sglang_abort(sglang, enc):
    assert sglang.request("POST", "/abort_request", {"rid": "nobody"})[::2] == (200, b"")
    ids = prompt(enc, "[sim:tokens=300] [sim:itl_ms=10]")
    for body in ({"rid": "slow"}, {"abort_all": True}):
        out: list = []
        generated = sglang.metrics()["sglang:generation_tokens_total"]
        thread = _slow_stream(sglang, "/generate", {
            "rid": "slow", "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 400}}, out)
        sglang.wait_metric("sglang:generation_tokens_total", lambda v: v > generated)  # noqa: B023 - under way: a token out
        assert sglang.request("POST", "/abort_request", body)[0] == 200
        thread.join(timeout=10)
        last = out[0][-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < 300


def test_errors(vllm, sglang, enc):
    ids = prompt(enc, "[sim:status=503]")
    status, _, payload = vllm.request("POST", "/inference/v1/generate", {
        "token_ids": ids, "sampling_params": {}})
    assert status == 503 and json.loads(payload)["error"]["code"] == 503
    status, _, payload = sglang.request("POST", "/generate", {"input_ids": ids, "stream": True})
    assert status == 503 and json.loads(payload) == {"error": {"message": "simulated failure"}}
    assert vllm.request("POST", "/inference/v1/generate", {
        "model": "other", "token_ids": [1], "sampling_params": {}})[0] == 404
    status, _, payload = vllm.request("POST", "/inference/v1/generate", {
        "token_ids": [1, 300000], "sampling_params": {}})
    assert status == 400 and "out of vocabulary" in json.loads(payload)["error"]["message"]
    status, _, payload = vllm.request("POST", "/inference/v1/generate", {
        "token_ids": [1] * 10, "sampling_params": {"max_tokens": 5000}})
    assert status == 400 and "maximum context length" in json.loads(payload)["error"]["message"]
    # SGLang: a request refused inside a stream is a 200 with an error frame.
    status, _, payload = sglang.request("POST", "/generate", {
        "input_ids": [1] * 5000, "stream": True})
    assert status == 200 and payload.decode().endswith("data: [DONE]\n\n")
    assert "maximum context length" in json.loads(payload.decode().split("\n\n")[0][6:])[
        "error"]["message"]
    assert sglang.request("POST", "/generate", {"input_ids": [1] * 5000})[0] == 400
    # [sim:error_after=K]: K ids, then the engine's error frame and [DONE].
    for sim, path, body in ((vllm, "/inference/v1/generate", {"sampling_params": {}}),
                            (sglang, "/generate", {})):
        key = "token_ids" if sim is vllm else "input_ids"
        payload = sim.request("POST", path, {**body, key: prompt(enc, "[sim:error_after=3]"),
                                             "stream": True})[2]
        frames = [json.loads(f[6:]) for f in payload.decode().split("\n\n")[:-2]]
        assert len(frames) == 4 and frames[-1]["error"]["message"] == "simulated failure"


def test_drop_after_and_timing(vllm, sglang, enc):
    with pytest.raises(http.client.IncompleteRead):
        vllm.request("POST", "/inference/v1/generate", {
            "token_ids": prompt(enc, "[sim:drop_after=2]"), "sampling_params": {}, "stream": True})
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        sglang.request("POST", "/generate", {"input_ids": prompt(enc, "[sim:drop_after=2]")})
    start = time.monotonic()
    generate(vllm, "vllm", prompt(enc, "[sim:ttft_ms=300] [sim:tokens=2]"))
    assert time.monotonic() - start >= 0.3


def test_metrics_count_harmony_requests(sglang, enc):
    before = sglang.metrics()
    got = generate(sglang, "sglang", prompt(enc, "[sim:tokens=3]"))
    after = sglang.wait_metric("sglang:generation_tokens_total",
                               lambda v: v >= before["sglang:generation_tokens_total"] + 1)
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] \
        == len(got["ids"])
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert after["sglang:prompt_tokens_total"] > before["sglang:prompt_tokens_total"]
