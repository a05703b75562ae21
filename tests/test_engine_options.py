"""Engine options on the chat wire, pure: router/dialects/chat.py ``build_request`` and ``refused_options``
(the end-to-end checks through a router are tests/test_e2e_engine_extras.py)."""

from __future__ import annotations

from typing import Any

import pytest

from router.dialects.chat import ENGINE_OPTIONS, ChatOptions, build_request, refused_options
from router.protocol.requests import ENGINE_FIELDS, CreateResponse, engine_options
from router.protocol.tools import ToolSet

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
