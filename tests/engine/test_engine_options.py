"""Engine options on the chat wire, pure: router/dialects/chat.py ``build_request`` and ``refused_options``
(the end-to-end checks through a router are tests/e2e/test_e2e_engine_extras.py); on the harmony pools'
generate call, pure (router/dialects/engine_options.py, stop_strings.py) and, in the engine tier, the
real vLLM taking every option that applies (the sim's checks: tests/e2e/test_e2e_harmony_engine_options.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from router.dialects.chat import ENGINE_OPTIONS, ChatOptions, build_request, refused_options
from router.protocol.requests import ENGINE_FIELDS, CreateResponse, engine_options
from router.protocol.tools import ToolSet
from tests.support.engine_env import vllm_prepared  # noqa: F401 - the session fixture of the engine tier

MESSAGES = [{"role": "user", "content": "hi"}]


def body(engine: str, honor: bool = False, **fields: Any) -> dict[str, Any]:
    req = CreateResponse.model_validate({"model": "m", "input": "hi", **fields})
    return build_request(req, MESSAGES, ToolSet(), ChatOptions(engine=engine, honor_service_tier=honor), model="w", stream=False)


def test_every_engine_field_has_an_entry() -> None:
    assert set(ENGINE_OPTIONS) == ENGINE_FIELDS
    assert ENGINE_FIELDS <= set(CreateResponse.model_fields)


def test_only_what_was_sent_and_not_null() -> None:
    req = CreateResponse.model_validate({"model": "m", "input": "hi", "seed": 1, "top_k": None})
    assert engine_options(req) == {"seed": 1}
    assert engine_options(CreateResponse.model_validate({"model": "m", "input": "hi"})) == {}


@pytest.mark.parametrize(("engine", "field", "wire"), [
    ("vllm", "request_id", "request_id"), ("sglang", "request_id", "rid"),
    ("vllm", "include_stop_str_in_output", "include_stop_str_in_output"), ("sglang", "include_stop_str_in_output", "no_stop_trim"),
    ("sim", "seed", "seed"), ("sim", "stop", "stop"),
])
def test_each_engine_gets_its_own_name(engine: str, field: str, wire: str) -> None:
    value: Any = {"request_id": "r-1", "include_stop_str_in_output": True, "seed": 3, "stop": ["x"]}[field]
    sent = body(engine, **{field: value})
    assert sent[wire] == value and (wire == field or field not in sent)


def test_refused_options_name_what_the_engine_lacks() -> None:
    options = {"seed": 1, "top_k": 2, "extra_key": "k", "vllm_xargs": {}}
    assert refused_options(options, "vllm") == ["extra_key"]
    assert refused_options(options, "sglang") == ["vllm_xargs"]
    assert refused_options(options, "sim") == ["top_k", "extra_key", "vllm_xargs"]


def test_service_tier_priority_only_where_honoured() -> None:
    assert body("vllm", True, service_tier="priority")["priority"] == -1
    assert body("sglang", True, service_tier="flex")["priority"] == 1
    assert "priority" not in body("vllm", False, service_tier="priority")
    assert "priority" not in body("vllm", True, service_tier="auto")
    assert "priority" not in body("sim", True, service_tier="priority")  # the sim does not schedule by priority
    assert body("vllm", True, service_tier="priority", priority=9)["priority"] == 9


def test_chat_template_kwargs_over_the_effort_switch() -> None:
    req = CreateResponse.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "none"},
                                         "chat_template_kwargs": {"enable_thinking": True, "x": 1}})
    sent = build_request(req, MESSAGES, ToolSet(), ChatOptions(reasoning_effort_as="enable_thinking"), model="w", stream=False)
    assert sent["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}


# -- harmony pools: the generate call (router/dialects/engine_options.py) -------------------------


def test_generate_options_merge_and_replace() -> None:
    from router.dialects.engine_options import place_options

    vllm = {"token_ids": [1], "request_id": "router-id", "sampling_params": {"stop_token_ids": [200002, 200012]}}
    place_options(vllm, {"seed": 3, "request_id": "mine", "stop_token_ids": [7, 200002], "vllm_xargs": {"a": 1}}, "vllm")
    assert vllm["request_id"] == "mine" and vllm["sampling_params"] == {
        "stop_token_ids": [200002, 200012, 7], "seed": 3, "extra_args": {"a": 1}}
    sglang: dict[str, Any] = {"input_ids": [1], "rid": "router-id", "sampling_params": {"no_stop_trim": True}}
    place_options(sglang, {"seed": 3, "cache_salt": "s-", "include_stop_str_in_output": True, "extra_key": "k"}, "sglang")
    assert sglang["extra_key"] == "s-k" and sglang["sampling_params"] == {"no_stop_trim": True, "sampling_seed": 3}
    completions: dict[str, Any] = {"prompt": [1], "stop_token_ids": [200002]}
    place_options(completions, {"seed": 3, "vllm_xargs": {"a": 1}, "stop_token_ids": [7]}, "vllm", completions=True)
    assert completions == {"prompt": [1], "stop_token_ids": [200002, 7], "seed": 3, "vllm_xargs": {"a": 1}}


def test_generate_refuses_what_cannot_apply() -> None:
    from router.dialects.engine_options import refused_on_generate

    assert refused_on_generate({"seed": 1, "top_k": 2}, "vllm") is None
    assert refused_on_generate({"seed": 1, "extra_key": "k"}, "vllm") == ("extra_key", "its engine (vllm) does not take it on the generate call")
    assert refused_on_generate({"vllm_xargs": {}}, "sglang") is not None
    for name in ("chat_template_kwargs", "skip_special_tokens", "session_id"):
        for engine in ("vllm", "sglang", "sim"):
            refused = refused_on_generate({name: 1}, engine)
            assert refused is not None and refused[0] == name


def test_stop_strings_cut_the_text_and_hold_back_what_may_begin_one() -> None:
    from router.dialects.deltas import Finish, ReasoningDelta, TextDelta, ToolCallDelta
    from router.dialects.stop_strings import StopStrings

    stops = StopStrings(["END", "xyz"], keep=False)
    assert stops.filter([TextDelta("hello E")]) == [TextDelta("hello ")]  # "E" may begin END
    assert stops.filter([TextDelta("N")]) == []
    assert stops.filter([TextDelta("Dafter"), ToolCallDelta(0, "c", "f")]) == []  # cut; nothing after it
    assert stops.stopped and stops.filter([Finish("stop")]) == [Finish("stop")]
    kept = StopStrings("END", keep=True)
    assert kept.filter([ReasoningDelta("think EN"), TextDelta("D ok")]) == [ReasoningDelta("think "), ReasoningDelta("EN"),
                                                                           TextDelta("D ok")]  # messages matched apart
    assert kept.filter([TextDelta(" then END and more")]) == [TextDelta(" then END")]
    held = StopStrings(["abc"], keep=False)
    assert held.filter([TextDelta("xa"), Finish("stop")]) == [TextDelta("x"), TextDelta("a"), Finish("stop")]


# -- the engine tier: a real vLLM (CPU) takes every option on /inference/v1/generate ----------------


@pytest.fixture(scope="module")
def oss_router(tmp_path_factory: pytest.TempPathFactory, vllm_prepared: Any) -> Iterator[Any]:  # noqa: F811
    """One harmony pool on a real vLLM CPU worker with the tiny gpt-oss (tests/engine/test_engine_vllm.py's pool)."""
    from harness import start_router
    from tests.engine.test_engine_vllm import OSS, START_TIMEOUT_S, _pool
    from tests.support.engine_env import serving

    body = (f'[harmony]\nvocab_dir = "{vllm_prepared.vocab_dir}"\n'
            + _pool(OSS, vllm_prepared.oss_model, vllm_prepared, dialect="harmony", env=vllm_prepared.engine_env())
            + f'\n[[models]]\nname = "{OSS}"\npool = "{OSS}"\n')
    yield from serving(start_router(tmp_path_factory.mktemp("engine-options"), body, wait=False), START_TIMEOUT_S + 30,
                       "a vLLM CPU worker")


@pytest.mark.e2e
@pytest.mark.engine
def test_real_vllm_generate_takes_every_option_that_applies(oss_router: Any) -> None:
    """Every option a harmony pool on vLLM sends, on the real /inference/v1/generate (0 as the priority:
    the pool does not schedule by priority), streamed and not: accepted, and the response ends."""
    client = openai.OpenAI(base_url=oss_router.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    options = {"seed": 11, "stop": ["never-there"], "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
               "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": -100.0}, "priority": 0,
               "cache_salt": "salt-of-this-tenant", "request_id": "engine-options-1", "stop_token_ids": [7, 9],
               "ignore_eos": False, "include_stop_str_in_output": False, "vllm_xargs": {"mode": "x"}}
    response = client.responses.create(model="tiny-oss", input="Hello", max_output_tokens=16, extra_body=options)
    assert response.status in ("completed", "incomplete"), response.error  # a random model: it may use every token
    assert response.usage is not None and 0 < response.usage.output_tokens <= 16
    events = list(client.responses.create(model="tiny-oss", input="Hello", max_output_tokens=16, stream=True,
                                          extra_body={**options, "request_id": "engine-options-2"}))
    assert events[-1].type in ("response.completed", "response.incomplete")
