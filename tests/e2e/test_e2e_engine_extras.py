"""Engine options (``seed``, ``stop``, ``top_k``, ... as vLLM's and SGLang's own Responses servers take
them), ``service_tier`` and ``prompt_cache_key``, through a real router process and sim workers, driven
by the openai SDK (the options in ``extra_body``, as a user moving from an engine's endpoint sends them).

- On pools whose engine is vLLM or SGLang (sims speaking their wires) every option reaches the chat call
  under the engine's name (``[sim:echo=request]`` answers with the body the worker got).
- The sim engine honours ``seed`` and ``stop`` (observably) and refuses the rest: a 400
  ``unsupported_parameter`` naming the field and the pool; harmony pools refuse what cannot apply
  there (their generate calls: tests/e2e/test_e2e_harmony_engine_options.py).
- The response and the stored one record the options; a chained turn has only those it sends itself.
- ``service_tier`` "priority" / "flex" become the engine's ``priority`` on a pool with
  ``honor_service_tier = true`` only; ``prompt_cache_key`` puts requests on one worker of an affinity pool.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from harness import RouterProcess, engine_pool_toml, sim_pool_toml, start_router
from tests.e2e.test_e2e_harmony import harmony_pool

pytestmark = pytest.mark.e2e

ECHO = "Show me [sim:echo=request]"
ResponseStreamEventAdapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
# Every engine option, with a value each engine's request model takes.
OPTIONS: dict[str, Any] = {
    "seed": 11, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "logit_bias": {"42": -100.0}, "priority": 3, "cache_salt": "salt-of-this-tenant",
    "request_id": "my-request-1", "session_id": "session-9", "chat_template_kwargs": {"custom": True},
    "stop_token_ids": [7, 9], "ignore_eos": False, "skip_special_tokens": True, "include_stop_str_in_output": False,
}
VLLM_ONLY = {"vllm_xargs": {"mode": "x"}}
SGLANG_ONLY = {"extra_key": "tenant-a"}
# The field a request sends -> the field SGLang's chat call takes it as (the rest: the same name).
SGLANG_NAMES = {"request_id": "rid", "include_stop_str_in_output": "no_stop_trim"}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, harmony_vocab: Path) -> Iterator[RouterProcess]:
    body = (
        f'[harmony]\nvocab_dir = "{harmony_vocab}"\n'
        + sim_pool_toml(name="sim", replicas=1)
        + sim_pool_toml(name="aff", replicas=2).replace('engine = "sim"\n', 'engine = "sim"\npolicy = "affinity"\n')
        + engine_pool_toml("vl", "vllm", honor_service_tier=True)
        + engine_pool_toml("sg", "sglang")
        + harmony_pool("oss", "vllm", harmony_vocab)
        + '\n[[models]]\nname = "sim-chat"\npool = "sim"\n[[models]]\nname = "sim-affinity"\npool = "aff"\n'
        + '[[models]]\nname = "vl"\npool = "vl"\n[[models]]\nname = "sg"\npool = "sg"\n'
        + '[[models]]\nname = "gpt-oss"\npool = "oss"\n'
    )
    proc = start_router(tmp_path_factory.mktemp("engine-extras"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def echoed(response: Any) -> dict[str, Any]:
    """The chat body (without its messages) the worker got, from a ``[sim:echo=request]`` answer."""
    body: dict[str, Any] = json.loads(response.output_text)
    return body


def refusal(client: openai.OpenAI, model: str, **extra: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", extra_body=extra)
    assert caught.value.status_code == 400
    error: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


# -- the engines' wires ---------------------------------------------------------------------------


def test_vllm_pool_gets_every_option_by_its_name(client: openai.OpenAI) -> None:
    response = client.responses.create(model="vl", input=ECHO, extra_body={**OPTIONS, **VLLM_ONLY})
    sent = echoed(response)
    for name, value in {**OPTIONS, **VLLM_ONLY}.items():
        assert sent[name] == value, name
    assert "rid" not in sent and "no_stop_trim" not in sent


def test_sglang_pool_gets_every_option_by_its_name(client: openai.OpenAI) -> None:
    response = client.responses.create(model="sg", input=ECHO, extra_body={**OPTIONS, **SGLANG_ONLY})
    sent = echoed(response)
    for name, value in {**OPTIONS, **SGLANG_ONLY}.items():
        assert sent[SGLANG_NAMES.get(name, name)] == value, name
    assert "request_id" not in sent and "include_stop_str_in_output" not in sent


def test_streamed_call_gets_the_options_too(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="vl", input=ECHO, stream=True, extra_body={"top_k": 5, "seed": 3}))
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed"
    sent = echoed(final)
    assert sent["top_k"] == 5 and sent["seed"] == 3 and sent["stream"] is True


@pytest.mark.parametrize(("model", "field", "value", "pool"), [
    ("vl", "extra_key", "tenant-a", "vl"),  # SGLang's
    ("sg", "vllm_xargs", {"a": 1}, "sg"),  # vLLM's
    ("sim-chat", "top_k", 40, "sim"),  # the sim honours seed and stop only
    ("sim-chat", "request_id", "r1", "sim"),
    ("gpt-oss", "chat_template_kwargs", {"x": 1}, "oss"),  # harmony pools use no chat template
    ("gpt-oss", "extra_key", "k", "oss"),  # nor an option their engine lacks (tests/e2e/test_e2e_harmony_engine_options.py)
])
def test_an_option_the_pools_engine_lacks_is_a_400_naming_field_and_pool(
        client: openai.OpenAI, model: str, field: str, value: Any, pool: str) -> None:
    error = refusal(client, model, **{field: value})
    assert error["code"] == "unsupported_parameter" and error["param"] == field
    assert error["type"] == "invalid_request_error"
    assert f"'{field}'" in error["message"] and f"pool '{pool}'" in error["message"] and f"'{model}'" in error["message"]


@pytest.mark.parametrize(("field", "value", "param"), [
    ("top_k", -5, "top_k"),
    ("min_p", 1.5, "min_p"),
    ("presence_penalty", 3, "presence_penalty"),
    ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("stop", ["a", ""], "stop[1]"),
    ("seed", "seven", "seed"),
    ("ignore_eos", "yes", "ignore_eos"),
    ("cache_salt", "", "cache_salt"),
])
def test_an_invalid_option_is_a_400_naming_it(client: openai.OpenAI, field: str, value: Any, param: str) -> None:
    error = refusal(client, "vl", **{field: value})
    assert error["code"] == "invalid_value" and error["param"] == param


def test_chat_template_kwargs_are_merged_over_the_effort_switch(client: openai.OpenAI) -> None:
    response = client.responses.create(model="vl", input=ECHO, reasoning={"effort": "low"},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    sent = echoed(response)
    assert sent["chat_template_kwargs"] == {"enable_thinking": False, "x": 1} and sent["reasoning_effort"] == "low"


# -- the sim honours seed and stop ----------------------------------------------------------------


@pytest.mark.parametrize("model", ["sim-chat", "vl", "sg"])
def test_seed_draws_the_words(client: openai.OpenAI, model: str) -> None:
    def text(**extra: Any) -> str:
        return client.responses.create(model=model, input="Tell me something [sim:tokens=12]", extra_body=extra).output_text

    plain, seven, seven_again, eight = text(), text(seed=7), text(seed=7), text(seed=8)
    assert seven == seven_again
    assert len({plain, seven, eight}) == 3


@pytest.mark.parametrize("model", ["sim-chat", "vl", "sg"])
def test_stop_ends_the_answer_before_the_stop_string(client: openai.OpenAI, model: str) -> None:
    prompt = "Tell me a story [sim:tokens=16]"
    full = client.responses.create(model=model, input=prompt).output_text
    words = full.split(" ")
    stop = " " + words[5]
    expected = full[:full.index(stop)]
    cut = client.responses.create(model=model, input=prompt, extra_body={"stop": [stop, "never-there"]})
    assert cut.output_text == expected and cut.status == "completed"
    assert cut.usage is not None and cut.usage.output_tokens < 16
    events = list(client.responses.create(model=model, input=prompt, stream=True, extra_body={"stop": stop}))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == expected and events[-1].response.output_text == expected  # type: ignore[union-attr]


@pytest.mark.parametrize("model", ["vl", "sg"])  # SGLang's chat call takes it as no_stop_trim
def test_stop_string_kept_when_asked(client: openai.OpenAI, model: str) -> None:
    prompt = "Tell me a story [sim:tokens=16]"
    full = client.responses.create(model=model, input=prompt).output_text
    stop = " " + full.split(" ")[4]
    kept = client.responses.create(model=model, input=prompt, extra_body={"stop": stop, "include_stop_str_in_output": True})
    assert kept.output_text == full[:full.index(stop) + len(stop)]


# -- recorded with the response, not carried along a chain ---------------------------------------


def test_options_are_recorded_and_not_carried_over_a_chain(client: openai.OpenAI) -> None:
    first = client.responses.create(model="vl", input=ECHO, extra_body={"seed": 5, "top_k": 9, "presence_penalty": 0.25})
    assert echoed(first)["seed"] == 5
    assert first.model_extra is not None and first.model_extra["seed"] == 5 and first.model_extra["top_k"] == 9
    assert first.presence_penalty == 0.25
    stored = client.responses.retrieve(first.id)
    assert stored.model_extra is not None and stored.model_extra["seed"] == 5 and stored.presence_penalty == 0.25
    second = client.responses.create(model="vl", input=ECHO, previous_response_id=first.id)
    sent = echoed(second)
    assert "seed" not in sent and "top_k" not in sent and "presence_penalty" not in sent
    again = client.responses.retrieve(second.id)
    assert "seed" not in (again.model_extra or {}) and again.presence_penalty == 0.0
    third = client.responses.create(model="vl", input=ECHO, previous_response_id=second.id, extra_body={"seed": 6})
    assert echoed(third)["seed"] == 6


# -- service_tier and prompt_cache_key -------------------------------------------------------------


@pytest.mark.parametrize(("tier", "priority"), [("priority", -1), ("flex", 1)])
def test_service_tier_is_the_engines_priority_where_the_pool_honours_it(client: openai.OpenAI, tier: str, priority: int) -> None:
    """The response says the tier that served it, as OpenAI's does: the one asked for where the pool
    honours it, ``default`` where it does not."""
    honoured = client.responses.create(model="vl", input=ECHO, service_tier=tier)  # type: ignore[arg-type]
    assert echoed(honoured)["priority"] == priority and honoured.service_tier == tier
    not_honoured = client.responses.create(model="sg", input=ECHO, service_tier=tier)  # type: ignore[arg-type]
    assert "priority" not in echoed(not_honoured) and not_honoured.service_tier == "default"
    stored = client.responses.retrieve(not_honoured.id)
    assert stored.service_tier == "default"
    auto = client.responses.create(model="vl", input="hi", service_tier="auto")
    assert auto.service_tier == "default"


def test_service_tier_default_sends_no_priority_and_an_explicit_one_wins(client: openai.OpenAI) -> None:
    assert "priority" not in echoed(client.responses.create(model="vl", input=ECHO, service_tier="default"))
    explicit = echoed(client.responses.create(model="vl", input=ECHO, service_tier="priority", extra_body={"priority": 4}))
    assert explicit["priority"] == 4


def test_prompt_cache_key_keeps_requests_on_one_worker(client: openai.OpenAI) -> None:
    def worker(text: str, key: str | None) -> str:
        raw = client.responses.with_raw_response.create(model="sim-affinity", input=text, prompt_cache_key=key) \
            if key is not None else client.responses.with_raw_response.create(model="sim-affinity", input=text)
        raw.parse()
        return raw.headers["x-router-worker"]

    prompts = [f"A different question number {i} about topic {i * 7}" for i in range(12)]
    unkeyed = {worker(p, None) for p in prompts}
    assert len(unkeyed) == 2  # without the key, different prefixes spread over both workers
    for key in ("tenant-a", "tenant-b"):
        assert len({worker(p, key) for p in prompts}) == 1


# -- stream_options.include_obfuscation -----------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def sse(router: RouterProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", router.base_url + "/v1/responses", json=body, timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "response.completed"
    return events


@pytest.mark.parametrize("prompt", ["Think [sim:reason=5] [sim:tokens=9]", "Call it [sim:call=get_weather]"])
def test_obfuscation_pads_every_delta_when_asked(router: RouterProcess, prompt: str) -> None:
    body = {"model": "sim-chat", "input": prompt, "stream": True, "tools": [WEATHER]}
    plain = sse(router, body)
    padded = sse(router, {**body, "stream_options": {"include_obfuscation": True}})
    deltas = [e for e in padded if "delta" in e]
    assert len(deltas) >= 2 and [e["type"] for e in padded] == [e["type"] for e in plain]
    for event in deltas:
        pad = event["obfuscation"]
        assert pad and (len(event["delta"]) + len(pad)) % 16 == 0 and pad.replace("-", "").replace("_", "").isalnum()
        ResponseStreamEventAdapter.validate_python(event)  # the SDK's types take it (an extra field)
    assert len({e["obfuscation"] for e in deltas}) > 1  # random characters, not one string repeated
    assert not [e for e in padded if "obfuscation" in e and "delta" not in e]
    assert not [e for e in plain if "obfuscation" in e]
    off = sse(router, {**body, "stream_options": {"include_obfuscation": False}})
    assert not [e for e in off if "obfuscation" in e]
    # The padding changes nothing else: the same text, arguments and output.
    strip = [{k: v for k, v in e.items() if k not in ("obfuscation", "item_id", "response", "item")} for e in padded]
    assert strip == [{k: v for k, v in e.items() if k not in ("item_id", "response", "item")} for e in plain]


def test_obfuscation_must_be_a_boolean(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="sim-chat", input="hi", stream=True,
                                stream_options={"include_obfuscation": "yes"})  # type: ignore[typeddict-item]
    error: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert error["param"] == "stream_options.include_obfuscation" and error["code"] == "invalid_type"


@pytest.mark.parametrize("field", ["enable_response_messages", "previous_input_messages", "structured_outputs",
                                   "kv_transfer_params", "include_reasoning"])
def test_an_engine_servers_option_the_router_does_not_pass_is_named(client: openai.OpenAI, field: str) -> None:
    error = refusal(client, "vl", **{field: True})
    assert error["code"] == "unsupported_parameter" and error["param"] == field and "not available here" in error["message"]
