"""The simulated worker (backends/sim/) as a process, over real HTTP: wire shapes, errors, limits.

Each fixture starts `python -m backends.sim` and talks to it with the openai
SDK (as the router's clients would) and with http.client for raw wire checks.
The scripted Responses semantics (tools, reasoning, structured output,
logprobs) are in test_sim_scripting.py.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.request

import openai
import pytest

from backends.sim import VOCAB, count_prompt_tokens, generate_tokens, parse_markers
from tests.support.sim_proc import MODEL, Sim, sglang, user, vllm  # noqa: F401 - vllm, sglang: fixtures

# ---------------------------------------------------------------- pure helpers


def test_pure_helpers():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a b"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert count_prompt_tokens(msgs) == 3 + (3 + 2) + (3 + 2)
    assert parse_markers("x [sim:tokens=3] [sim:echo] y") == {"tokens": "3", "echo": None}
    toks = generate_tokens(msgs, 5)
    assert toks == generate_tokens(msgs, 5) and toks[:3] == generate_tokens(msgs, 3)
    assert toks[0] in VOCAB and all(t.startswith(" ") and t[1:] in VOCAB for t in toks[1:])


# ---------------------------------------------------------------- vLLM shapes


def test_ready_line_and_health(vllm):  # noqa: F811
    assert vllm.ready_line == f"sim worker ready on http://127.0.0.1:{vllm.port}"
    assert vllm.request("GET", "/health")[::2] == (200, b"")


def test_models(vllm):  # noqa: F811
    status, _, payload = vllm.request("GET", "/v1/models")
    body = json.loads(payload)
    assert status == 200 and body["object"] == "list"
    (card,) = body["data"]
    assert isinstance(card.pop("created"), int)
    assert card == {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL,
                    "parent": None, "max_model_len": 4096}
    assert [m.id for m in vllm.client().models.list()] == [MODEL]


def test_non_stream_shape_and_determinism(vllm):  # noqa: F811
    messages = [{"role": "system", "content": "you are terse"}, *user("hello there world")]
    status, body = vllm.chat({"messages": messages, "temperature": 0.3, "seed": 7,
                              "tools": [], "top_p": 0.9})
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    msg = choice["message"]
    # vLLM 0.32's ChatMessage: `reasoning` (not reasoning_content), no empty tool_calls
    assert msg["role"] == "assistant" and "tool_calls" not in msg
    assert msg["reasoning"] is None and "reasoning_content" not in msg
    assert msg["refusal"] is None and msg["function_call"] is None
    assert choice["logprobs"] is None and choice["finish_reason"] == "stop"
    words = msg["content"].split(" ")
    assert len(words) == 12 and set(words) <= set(VOCAB)
    prompt = 3 + (3 + 3) + (3 + 3)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 12,
                             "total_tokens": prompt + 12, "prompt_tokens_details": None,
                             "completion_tokens_details": None}

    client = vllm.client()
    again = client.chat.completions.create(model=MODEL, messages=messages, seed=7)  # the seed draws the words too
    other = client.chat.completions.create(model=MODEL, messages=user("something else entirely"), seed=7)
    assert again.choices[0].message.content == msg["content"]
    assert other.choices[0].message.content != msg["content"]


def test_stream_with_usage_matches_non_stream(vllm):  # noqa: F811
    messages = user("tell me a story [sim:tokens=7]")
    full = vllm.client().chat.completions.create(model=MODEL, messages=messages)
    chunks = list(vllm.client().chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    first, *tokens, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert len(tokens) == 7 and all(c.choices[0].finish_reason is None for c in tokens)
    assert finish.choices[0].finish_reason == "stop" and not finish.choices[0].delta.content
    assert usage.choices == [] and usage.usage.model_dump(exclude_none=True) == \
        full.usage.model_dump(exclude_none=True)
    assert "".join(c.choices[0].delta.content for c in tokens) == full.choices[0].message.content

    # The raw wire: SSE frames, no usage chunk unless asked, [DONE] last.
    status, ctype, raw = vllm.request("POST", "/v1/chat/completions",
                                      {"model": MODEL, "messages": messages, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    frames = raw.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and all(f.startswith("data: ") for f in frames[:-1])
    datas = [json.loads(f[6:]) for f in frames[:-2]]
    assert len(datas) == 1 + 7 + 1 and all("usage" not in d for d in datas)
    assert datas[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_cuts_with_length(vllm):  # noqa: F811
    client = vllm.client()
    full = client.chat.completions.create(model=MODEL, messages=user("cut me"))
    cut = client.chat.completions.create(model=MODEL, messages=user("cut me"), max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert full.choices[0].message.content.startswith(cut.choices[0].message.content)
    assert len(cut.choices[0].message.content.split(" ")) == 3
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=user("cut me"), max_completion_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) == 1 + 2 + 1


def test_tokens_marker(vllm):  # noqa: F811
    client = vllm.client()
    five = client.chat.completions.create(model=MODEL, messages=user("[sim:tokens=5] hi"))
    assert len(five.choices[0].message.content.split(" ")) == 5
    assert five.usage.completion_tokens == 5 and five.choices[0].finish_reason == "stop"
    zero = client.chat.completions.create(model=MODEL, messages=user("[sim:tokens=0]"))
    assert zero.choices[0].message.content == "" and zero.usage.completion_tokens == 0
    assert zero.choices[0].finish_reason == "stop"
    # Only the LAST user message scripts: an old marker in history is inert.
    history = [*user("[sim:tokens=2]"), {"role": "assistant", "content": "ok"}, *user("more")]
    assert client.chat.completions.create(model=MODEL, messages=history).usage.completion_tokens \
        == 12


def test_status_marker(vllm):  # noqa: F811
    status, body = vllm.chat({"messages": user("boom [sim:status=500]")})
    assert status == 500
    assert body == {"error": {"message": "simulated failure", "type": "InternalServerError",
                              "param": None, "code": 500}}
    with pytest.raises(openai.RateLimitError) as exc:
        vllm.client().chat.completions.create(model=MODEL, messages=user("[sim:status=429]"))
    assert exc.value.status_code == 429 and "simulated failure" in str(exc.value)


def test_drop_after(vllm):  # noqa: F811
    client = vllm.client()
    got = []
    with pytest.raises(openai.APIConnectionError):
        for chunk in client.chat.completions.create(
                model=MODEL, messages=user("[sim:drop_after=2]"), stream=True):
            got.append(chunk)
    # The role chunk and two tokens arrived, then the connection broke.
    assert len(got) == 3 and got[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in got)
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model=MODEL, messages=user("[sim:drop_after=1]"))
    # Raw: the chunked body is cut short, so the client sees a broken read.
    with pytest.raises(http.client.IncompleteRead):
        vllm.request("POST", "/v1/chat/completions", {
            "model": MODEL, "stream": True, "messages": user("[sim:drop_after=1]")})


def test_echo(vllm):  # noqa: F811
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "echo [sim:echo] é"}]}]
    out = vllm.client().chat.completions.create(model=MODEL, messages=messages)
    assert json.loads(out.choices[0].message.content) == messages
    chunks = list(vllm.client().chat.completions.create(model=MODEL, messages=messages,
                                                        stream=True))
    pieces = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert all(0 < len(p) <= 16 for p in pieces)
    assert "".join(pieces) == out.choices[0].message.content
    cut = vllm.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert cut.choices[0].message.content == out.choices[0].message.content[:32]
    assert cut.choices[0].finish_reason == "length"


def test_errors_vllm(vllm):  # noqa: F811
    status, body = vllm.chat({"model": "nope", "messages": user("hi")})
    assert status == 404
    assert body == {"error": {"message": "The model `nope` does not exist.",
                              "type": "NotFoundError", "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        vllm.client().chat.completions.create(model="nope", messages=user("hi"))

    status, _, payload = vllm.request("POST", "/v1/chat/completions", raw=b"{not json")
    err = json.loads(payload)["error"]
    assert status == 400 and err["type"] == "BadRequestError" and err["code"] == 400
    status, body = vllm.chat({})
    assert status == 400 and body["error"]["param"] == "messages"

    # vLLM 0.32's words (renderers/params.py, v1/engine/input_processor.py): max_tokens above the
    # context is a 400 whatever the prompt; below it, clamped to the room the prompt leaves.
    status, body = vllm.chat({"messages": user("hi"), "max_tokens": 5000})
    assert status == 400 and body["error"] == {
        "message": "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
                   "(parameter=max_tokens, value=5000)", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    status, body = vllm.chat({"messages": user("hi"), "max_completion_tokens": 4097})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"
    assert body["error"]["message"].startswith("max_completion_tokens=4097 cannot be greater than max_model_len=4096.")
    long = user("w " * 4080)  # 4080 words + 6 template tokens: 10 left of the 4096
    status, body = vllm.chat({"messages": long, "max_tokens": 4096})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 4086 and body["usage"]["completion_tokens"] == 10
    status, body = vllm.chat({"messages": user("w " * 5000)})
    assert status == 400 and body["error"] == {
        "message": "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 "
                   "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                   "of the input prompt. (parameter=input_tokens, value=4097)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}
    status, body = vllm.chat({"messages": user("w " * 4090)})  # exactly the context: no room for one token
    assert status == 400 and body["error"]["param"] is None
    assert body["error"]["message"].startswith("The decoder prompt (length 4096) plus the number of requested output "
                                               "tokens (at least 1) is longer than the maximum model length of 4096.")


def test_metrics_and_slot_release(vllm):  # noqa: F811
    client = vllm.client()
    before = vllm.metrics()
    client.chat.completions.create(model=MODEL, messages=user("[sim:tokens=4] count me"))
    m = vllm.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert m["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 3 + (3 + 3)
    stop = 'vllm:request_success_total{engine="0",model_name="sim-model",finished_reason="stop"}'
    assert m[stop] - before[stop] == 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{vllm.port}/metrics").read().decode()
    assert "# TYPE vllm:num_requests_running gauge" in text
    assert "# TYPE vllm:generation_tokens_total counter" in text and "# HELP " in text

    # A hung request holds a slot until the client gives up.
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).chat.completions.create(
            model=MODEL, messages=user("[sim:hang]"))
    vllm.wait_metric("vllm:num_requests_running", lambda v: v == 0)

    # A client that leaves mid-stream stops generation and frees the slot.
    gen0 = vllm.metrics()["vllm:generation_tokens_total"]
    stream = client.chat.completions.create(
        model=MODEL, messages=user("[sim:tokens=300] [sim:itl_ms=10]"), stream=True)
    next(stream), next(stream)
    stream.close()
    m = vllm.wait_metric("vllm:num_requests_running", lambda v: v == 0)
    assert m["vllm:generation_tokens_total"] - gen0 < 300


def test_ttft_marker_delays_answer(vllm):  # noqa: F811
    t0 = time.monotonic()
    vllm.client().chat.completions.create(model=MODEL, messages=user("[sim:ttft_ms=250]"))
    assert time.monotonic() - t0 >= 0.25


# ---------------------------------------------------------------- SGLang shapes


def test_sglang_shapes(sglang):  # noqa: F811
    status, _, payload = sglang.request("GET", "/v1/models")
    assert status == 200 and json.loads(payload)["data"][0]["owned_by"] == "sglang"

    status, body = sglang.chat({"model": "sg-model", "messages": user("hi [sim:tokens=3]")})
    (choice,) = body["choices"]
    assert status == 200 and choice["finish_reason"] == "stop" and "matched_stop" in choice
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 3
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["reasoning_tokens"] == 0

    status, _, raw = sglang.request("POST", "/v1/chat/completions", {
        "model": "sg-model", "messages": user("hi [sim:tokens=2]"), "stream": True,
        "stream_options": {"include_usage": True}})
    frames = raw.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    first, *tokens, finish, usage = [json.loads(f[6:]) for f in frames[:-2]]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["matched_stop"] is None for c in [first, *tokens])
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["choices"][0]["matched_stop"] is not None and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == \
        sglang.chat({"model": "sg-model", "messages": user("hi [sim:tokens=2]")})[1][
            "choices"][0]["message"]["content"]

    cut = sglang.client().chat.completions.create(model="sg-model", messages=user("x"),
                                                  max_tokens=1)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].model_extra["matched_stop"] is None


def test_sglang_errors_and_metrics(sglang):  # noqa: F811
    status, body = sglang.chat({"model": "other", "messages": user("hi")})
    assert status == 400
    assert body == {"object": "error", "message": "The model `other` does not exist.",
                    "type": "BadRequestError", "param": "model", "code": 400}
    # SGLang's words (tokenizer_manager.py _validate_one_request): prompt + max_tokens must stay below the context.
    status, body = sglang.chat({"model": "sg-model", "messages": user("hi"), "max_tokens": 4090})
    assert status == 400 and body == {
        "object": "error", "message": "Requested token count exceeds the model's maximum context length of 4096 "
        "tokens. You requested a total of 4097 tokens: 7 tokens from the input messages and 4090 tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the completion to fit within the "
        "limit.", "type": "BadRequestError", "param": None, "code": 400}
    status, body = sglang.chat({"model": "sg-model", "messages": user("hi"), "max_tokens": 4088})
    assert status == 200 and body["usage"]["completion_tokens"] > 0
    status, body = sglang.chat({"model": "sg-model", "messages": user("w " * 4090)})
    assert status == 400 and body["message"] == ("The input (4096 tokens) is longer than the model's context length "
                                                 "(4096 tokens).") and body["param"] is None
    status, body = sglang.chat({"model": "sg-model", "messages": user("[sim:status=503]")})
    assert status == 503 and body["object"] == "error" and body["message"] == "simulated failure"
    m = sglang.metrics()
    assert m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0
    assert m["sglang:generation_tokens_total"] > 0 and m["sglang:prompt_tokens_total"] > 0
    assert 'sglang:num_running_reqs{model_name="sg-model"}' in m


# ---------------------------------------------------------------- concurrency, signals


def test_max_concurrency_queues_the_second_stream():
    sim = Sim("--max-concurrency", "1", "--itl-ms", "20")
    try:
        texts: list[str] = []

        def run() -> None:
            chunks = sim.client().chat.completions.create(
                model=MODEL, messages=user("[sim:tokens=40] queue"), stream=True)
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks))

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        m = sim.wait_metric("vllm:num_requests_waiting", lambda v: v == 1)
        assert m["vllm:num_requests_running"] == 1
        for t in threads:
            t.join(timeout=10)
        assert len(texts) == 2 and texts[0] == texts[1] and len(texts[0].split()) == 40
        m = sim.metrics()
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    finally:
        assert sim.stop() == 0


def test_sigint_exits_cleanly():
    sim = Sim()
    sim.proc.send_signal(signal.SIGINT)
    assert sim.proc.wait(timeout=10) == 0
    sim.stop()
