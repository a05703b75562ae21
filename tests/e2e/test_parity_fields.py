"""Every field of the request model, on every pool kind, as router/protocol/fields.py says.

- The table has a row for every field of ``CreateResponse`` (a new field cannot be silently ignored).
- Through ONE real router with four sim pools (chat on vLLM's and SGLang's wires, with the router's pool
  engine ``vllm`` / ``sglang`` so engine options go by those engines' names; harmony on both wires) and
  the openai SDK, one request per (row, pool kind) with a representative value: a 400 has the code and
  param the table names; ``echoed`` comes back as sent; ``accepted`` is not in the response; an
  ``effect`` answers 200 and, where the sim shows it cheaply, shows the effect (``[sim:echo=request]``:
  the chat body the worker got); otherwise the table names the test that shows it, which must exist.
- docs/api.md holds the table exactly as ``render_markdown`` writes it.
"""

from __future__ import annotations

import ast
import inspect
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import ROOT, RouterProcess, engine_pool_toml, start_router
from router.dialects.engine_options import GENERATE_OPTIONS, HARMONY_REFUSED
from router.protocol import fields as table
from router.protocol.fields import CHAT, FIELDS, HARMONY, POOL_KINDS
from router.protocol.requests import ENGINE_FIELDS, CreateResponse
from tests.e2e.test_e2e_harmony import harmony_pool
from tests.support.fake_search import FakeSearch

pytestmark = pytest.mark.e2e

ROWS = {row.name: row for row in FIELDS}
ECHO_REQUEST = "Show me [sim:echo=request]"
PLAIN = "Hello there [sim:tokens=3]"
REASON = "Think first [sim:reason=3] [sim:tokens=2]"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
# The create parameters the SDK has; others go in extra_body.
SDK_PARAMS = frozenset(inspect.signature(openai.OpenAI(api_key="x").responses.create).parameters)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, harmony_vocab: Path) -> Iterator[RouterProcess]:
    search = FakeSearch().start()  # web_search runs on the router: max_tool_calls and include show on it
    body = (f'[harmony]\nvocab_dir = "{harmony_vocab}"\n' + engine_pool_toml(table.CHAT_VLLM, "vllm", honor_service_tier=True)
            + engine_pool_toml(table.CHAT_SGLANG, "sglang", honor_service_tier=True)
            + harmony_pool(table.HARMONY_VLLM, "vllm", harmony_vocab, honor_service_tier=True)
            + harmony_pool(table.HARMONY_SGLANG, "sglang", harmony_vocab, honor_service_tier=True)
            + "".join(f'\n[[models]]\nname = "{kind}"\npool = "{kind}"\n' for kind in POOL_KINDS)
            + f'\n[tools]\nprivate_networks = ["127.0.0.0/8"]\n[tools.web_search]\nurl = "{search.search_url}"\n')
    try:
        proc = start_router(tmp_path_factory.mktemp("parity-fields"), body)
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        search.stop()


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


# -- the cases: a representative request per row, and what shows its effect --------------------------


@dataclass
class Answer:
    status: int
    body: dict[str, Any]  # the Response (a stream's final one), or the error
    events: list[dict[str, Any]] = field(default_factory=list)


Check = Callable[[openai.OpenAI, str, Answer], None]


@dataclass
class Case:
    params: dict[str, Any]
    prompt: str = PLAIN
    echo: tuple[str, ...] = ()  # where an echoed value sits in the response (default: the field)
    checks: dict[str, Check] = field(default_factory=dict)  # pool kind -> what shows the effect there
    # More params from a first request on the same kind; keys starting "_" are not sent but handed to the checks.
    before: Callable[[openai.OpenAI, str], dict[str, Any]] | None = None
    prompts: dict[str, str] = field(default_factory=dict)  # pool kind -> its own prompt


def text_of(body: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in body["output"] if item["type"] == "message" for part in item["content"])


def sent(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body (without its messages) the worker got, from a ``[sim:echo=request]`` answer."""
    echoed: dict[str, Any] = json.loads(text_of(body))
    return echoed


def sent_has(key: str, value: Any) -> Check:
    def check(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
        assert sent(answer.body)[key] == value, (key, sent(answer.body).get(key))
    return check


def on_chat(check: Check) -> dict[str, Check]:
    return dict.fromkeys(CHAT, check)


def everywhere(check: Check) -> dict[str, Check]:
    return dict.fromkeys(POOL_KINDS, check)


def first_turn(client: openai.OpenAI, kind: str) -> dict[str, Any]:
    first = client.responses.create(model=kind, input="An earlier turn [sim:tokens=4]")
    assert first.usage is not None
    return {"previous_response_id": first.id, "_first_input_tokens": first.usage.input_tokens}


def check_model(_client: openai.OpenAI, kind: str, answer: Answer) -> None:
    assert answer.body["model"] == kind


def check_five_words(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    assert len(text_of(answer.body).split()) == 5, text_of(answer.body)


def new_conversation(client: openai.OpenAI, _kind: str) -> dict[str, Any]:
    conversation = client.conversations.create()
    return {"conversation": conversation.id, "_conversation": conversation.id}


def check_in_conversation(client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    conversation = answer.body["_conversation"]
    assert answer.body["conversation"] == {"id": conversation}
    ids = [item.id for item in client.conversations.items.list(conversation, order="asc").data]
    assert len(ids) == 1 + len(answer.body["output"]) and ids[1:] == [item["id"] for item in answer.body["output"]]


def check_chain(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    assert answer.body["previous_response_id"] and answer.body["usage"]["input_tokens"] > answer.body["_first_input_tokens"]


def check_instructions(client: openai.OpenAI, kind: str, answer: Answer) -> None:
    if kind in CHAT:  # [sim:echo] answers with the messages it got
        messages = json.loads(text_of(answer.body))
        assert messages[0] == {"role": "system", "content": "Answer in haiku."}
    else:  # the developer message lengthens the prompt
        plain = client.responses.create(model=kind, input=PLAIN)
        assert plain.usage is not None and answer.body["usage"]["input_tokens"] > plain.usage.input_tokens


def check_incomplete(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    body = answer.body
    assert body["status"] == "incomplete" and body["incomplete_details"]["reason"] == "max_output_tokens"
    assert body["usage"]["output_tokens"] <= 5


def check_not_stored(client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.body["id"])


def check_streamed(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    assert answer.events[0]["type"] == "response.created" and answer.events[-1]["type"] == "response.completed"
    assert any(e["type"] == "response.output_text.delta" for e in answer.events)


def check_obfuscated(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    deltas = [e for e in answer.events if "delta" in e]
    assert deltas and all(e.get("obfuscation") and (len(e["delta"]) + len(e["obfuscation"])) % 16 == 0 for e in deltas)


def check_background(client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    assert answer.body["status"] in ("queued", "in_progress")
    deadline = time.monotonic() + 20
    while (done := client.responses.retrieve(answer.body["id"])).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.05)
    assert done.status == "completed" and done.output_text


def check_called(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    calls = [i for i in answer.body["output"] if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather"] and isinstance(json.loads(calls[0]["arguments"])["city"], str)


def check_json(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    assert isinstance(json.loads(text_of(answer.body))["city"], str)


def reasoning_item(body: dict[str, Any]) -> dict[str, Any]:
    item: dict[str, Any] = next(i for i in body["output"] if i["type"] == "reasoning")
    return item


def check_summary(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    item = reasoning_item(answer.body)
    assert item["summary"] and item["summary"][0]["text"] == item["content"][0]["text"]


def check_sealed(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    assert reasoning_item(answer.body).get("encrypted_content")


def check_logprobs(top: int) -> Check:
    def check(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
        (message,) = [i for i in answer.body["output"] if i["type"] == "message"]
        logprobs = message["content"][0]["logprobs"]
        assert logprobs and all(len(lp["top_logprobs"]) == top for lp in logprobs)
    return check


def check_compacted(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    kinds = [i["type"] for i in answer.body["output"]]
    assert kinds[0] == "compaction" and "message" in kinds and answer.body["output"][0]["encrypted_content"]


def check_open_responses_names(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    types = {e["type"] for e in answer.events}
    assert "response.reasoning.delta" in types and "response.reasoning_text.delta" not in types


WEB_SEARCH = [{"type": "web_search"}]
# A search (two of them) on every kind: the chat sim's web_search function, gpt-oss's own browser.search.
SEARCH_ONCE = {**dict.fromkeys(CHAT, "look it up [sim:call=web_search]"),
               **dict.fromkeys(HARMONY, "look it up [sim:builtin=browser.search]")}
SEARCH_TWICE = {**dict.fromkeys(CHAT, "look it up [sim:call=web_search,web_search]"),
                **dict.fromkeys(HARMONY, "look it up [sim:builtin=browser.search,browser.search]")}


def searches(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in body["output"] if item["type"] == "web_search_call"]


def check_capped(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    """Two searches asked for, one allowed: the response ends there, incomplete."""
    body = answer.body
    assert body["status"] == "incomplete" and body["incomplete_details"]["reason"] == "max_tool_calls"
    assert len(searches(body)) == 2


def check_sources(client: openai.OpenAI, kind: str, answer: Answer) -> None:
    (shown,) = searches(answer.body)
    assert shown["action"]["sources"] and shown["status"] == "completed"
    unasked = client.responses.create(model=kind, input=SEARCH_ONCE[kind], tools=WEB_SEARCH)  # type: ignore[list-item]
    (hidden,) = searches(unasked.model_dump())
    assert not hidden["action"].get("sources")


ENGINE_VALUES: dict[str, Any] = {
    "seed": 11, "stop": ["never-there"], "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "logit_bias": {"42": -100.0}, "priority": 3, "cache_salt": "salt", "request_id": "req-1",
    "session_id": "session-9", "chat_template_kwargs": {"custom": True}, "stop_token_ids": [7, 9], "ignore_eos": False,
    "skip_special_tokens": True, "include_stop_str_in_output": False, "extra_key": "tenant-a", "vllm_xargs": {"mode": "x"},
}
SGLANG_NAMES = {"request_id": "rid", "include_stop_str_in_output": "no_stop_trim"}


def check_stop(_client: openai.OpenAI, _kind: str, answer: Answer) -> None:
    """The echoed body holds the stop string itself: the sim's answer ends just before it."""
    text = text_of(answer.body)
    assert '"stop"' in text and "never-there" not in text, text


def generate_has(name: str, value: Any) -> Check:
    """Harmony pools: the generate body the worker got holds the option where router/dialects/engine_options.py
    puts it (a list after what the router put there itself: harmony's stop ids)."""
    def check(_client: openai.OpenAI, kind: str, answer: Answer) -> None:
        where, key = GENERATE_OPTIONS[name]["vllm" if kind == table.HARMONY_VLLM else "sglang"]
        body = sent(answer.body)
        got = (body["sampling_params"] if where == "sampling" else body).get(key)
        if isinstance(value, list):
            assert got[-len(value):] == value and len(got) > len(value), (key, got)
        else:
            assert got == value, (key, got)
    return check


def engine_checks(name: str, value: Any) -> dict[str, Check]:
    """Each pool kind that sends the option to its engine: the value in the body the worker got."""
    checks = {table.CHAT_VLLM: sent_has(name, value), table.CHAT_SGLANG: sent_has(SGLANG_NAMES.get(name, name), value)}
    for kind, engine in ((table.HARMONY_VLLM, "vllm"), (table.HARMONY_SGLANG, "sglang")):
        if GENERATE_OPTIONS.get(name, {}).get(engine, ("router", ""))[0] != "router":
            checks[kind] = generate_has(name, value)
    return checks


CASES: dict[str, Case] = {
    "model": Case({}, checks=everywhere(check_model)),
    "input": Case({}, prompt="Say five words [sim:tokens=5]", checks=everywhere(check_five_words)),
    "instructions": Case({"instructions": "Answer in haiku."}, prompt="What do you see [sim:echo]",
                         checks=everywhere(check_instructions)),
    "previous_response_id": Case({}, before=first_turn, checks=everywhere(check_chain)),
    "conversation": Case({}, before=new_conversation, checks=everywhere(check_in_conversation)),
    "temperature": Case({"temperature": 0.3}, prompt=ECHO_REQUEST, checks=on_chat(sent_has("temperature", 0.3))),
    "top_p": Case({"top_p": 0.7}, prompt=ECHO_REQUEST, checks=on_chat(sent_has("top_p", 0.7))),
    "max_output_tokens": Case({"max_output_tokens": 5}, prompt="A long answer [sim:tokens=40]",
                              checks=everywhere(check_incomplete)),
    "max_tool_calls": Case({"tools": WEB_SEARCH, "max_tool_calls": 1}, prompts=SEARCH_TWICE, echo=("max_tool_calls",),
                           checks=everywhere(check_capped)),
    "metadata": Case({"metadata": {"team": "parity"}}),
    "store": Case({"store": False}, checks=everywhere(check_not_stored)),
    "stream": Case({"stream": True}, checks=everywhere(check_streamed)),
    "stream_options.include_obfuscation": Case({"stream": True, "stream_options": {"include_obfuscation": True}},
                                               checks=everywhere(check_obfuscated)),
    "background": Case({"background": True}, checks=everywhere(check_background)),
    "tools": Case({"tools": [WEATHER]}, prompt="What's the weather in Paris?", checks=everywhere(check_called)),
    "tool_choice": Case({"tools": [WEATHER], "tool_choice": "required"}, prompt="hello there", checks=everywhere(check_called)),
    "parallel_tool_calls": Case({"tools": [WEATHER], "parallel_tool_calls": False}, prompt=ECHO_REQUEST,
                                checks=on_chat(sent_has("parallel_tool_calls", False))),
    "text.format": Case({"text": {"format": {"type": "json_schema", "name": "place", "schema": CITY, "strict": True}}},
                        checks=everywhere(check_json)),
    "text.verbosity": Case({"text": {"verbosity": "low"}}, echo=("text", "verbosity")),
    "reasoning.effort": Case({"reasoning": {"effort": "low"}}, prompt=ECHO_REQUEST, echo=("reasoning", "effort"),
                             checks=on_chat(sent_has("reasoning_effort", "low"))),
    "reasoning.summary": Case({"reasoning": {"summary": "auto"}}, prompt=REASON, checks=everywhere(check_summary)),
    "reasoning.generate_summary": Case({"reasoning": {"generate_summary": "auto"}}, echo=("reasoning", "generate_summary")),
    "include: reasoning.encrypted_content": Case({"include": ["reasoning.encrypted_content"]}, prompt=REASON,
                                                 checks=everywhere(check_sealed)),
    "include: message.output_text.logprobs": Case({"include": ["message.output_text.logprobs"]},
                                                  checks=on_chat(check_logprobs(0))),
    "include: code_interpreter_call.outputs": Case({"include": ["code_interpreter_call.outputs"]}),
    "include: web_search_call.action.sources": Case({"tools": WEB_SEARCH, "include": ["web_search_call.action.sources"]},
                                                    prompts=SEARCH_ONCE, checks=everywhere(check_sources)),
    "include: message.input_image.image_url": Case({"include": ["message.input_image.image_url"]}),
    "include: file_search_call.results": Case({"include": ["file_search_call.results"]}),
    "include: computer_call_output.output.image_url": Case({"include": ["computer_call_output.output.image_url"]}),
    "truncation": Case({"truncation": "auto"}, echo=("truncation",)),
    "top_logprobs": Case({"top_logprobs": 2}, checks=on_chat(check_logprobs(2))),
    "user": Case({"user": "user-7"}, echo=("user",)),
    "safety_identifier": Case({"safety_identifier": "safe-7"}, echo=("safety_identifier",)),
    "prompt_cache_key": Case({"prompt_cache_key": "tenant-a"}, echo=("prompt_cache_key",)),
    "prompt_cache_retention": Case({"prompt_cache_retention": "24h"}, echo=("prompt_cache_retention",)),
    "service_tier": Case({"service_tier": "priority"}, prompt=ECHO_REQUEST, echo=("service_tier",),
                         checks=everywhere(sent_has("priority", -1))),
    "prompt": Case({"prompt": {"id": "pmpt_123"}}),
    "context_management": Case({"context_management": [{"type": "compaction", "compact_threshold": 1}]}, before=first_turn,
                               checks=everywhere(check_compacted)),
    "client_metadata": Case({"client_metadata": {"app": "parity"}}, echo=("client_metadata",)),
    "verbosity": Case({"verbosity": "low"}, echo=("text", "verbosity")),
    "prompt_cache_options": Case({"prompt_cache_options": {"mode": "x"}}, echo=("prompt_cache_options",)),
    "background_options": Case({"background_options": {"window": "24h"}}, echo=("background_options",)),
    "reasoning_events": Case({"stream": True, "reasoning_events": "open-responses"}, prompt=REASON,
                             checks=everywhere(check_open_responses_names)),
    **{name: Case({name: value}, prompt=ECHO_REQUEST, echo=(name,), checks=engine_checks(name, value))
       for name, value in ENGINE_VALUES.items()},
}
CASES["stop"].checks = everywhere(check_stop)  # the echo itself is cut at the stop string, on every kind


def send(client: openai.OpenAI, kind: str, case: Case) -> Answer:
    params = dict(case.params)
    extra_keys: dict[str, Any] = {}
    if case.before is not None:
        params.update(case.before(client, kind))
        extra_keys = {k: params.pop(k) for k in [k for k in params if k.startswith("_")]}
    prompt = case.prompts.get(kind, case.prompt)
    sdk = {k: v for k, v in params.items() if k in SDK_PARAMS}
    extra = {k: v for k, v in params.items() if k not in SDK_PARAMS}
    try:
        if params.get("stream"):
            stream = client.responses.create(model=kind, input=prompt, **sdk, extra_body=extra or None)
            events = [event.model_dump(warnings=False) for event in stream]
            return Answer(200, {**events[-1].get("response", {}), **extra_keys}, events)
        raw = client.responses.with_raw_response.create(model=kind, input=prompt, **sdk, extra_body=extra or None)
        return Answer(raw.http_response.status_code, {**raw.http_response.json(), **extra_keys})
    except openai.BadRequestError as exc:
        error = exc.body if isinstance(exc.body, dict) else {}
        return Answer(exc.status_code, error)


def at(body: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = body
    for key in path:
        value = value[key]
    return value


def sent_value(case: Case, row: str) -> Any:
    """The value the case sends for the row's field (the last part of a nested one)."""
    top = ROWS[row].top_level
    value = case.params[top]
    if "." in row and ":" not in row:
        value = value[row.split(".", 1)[1]]
    return value


# -- the table is whole ----------------------------------------------------------------------------


def test_every_field_of_the_request_model_has_a_row() -> None:
    rows = {row.top_level for row in FIELDS}
    missing = [name for name in CreateResponse.model_fields if name not in rows]
    assert not missing, f"fields with no row in router/protocol/fields.py: {missing}"
    assert not rows - set(CreateResponse.model_fields), "rows for fields the model does not have"
    assert len(ROWS) == len(FIELDS), "a row twice"
    for row in FIELDS:
        assert set(row.outcomes) == set(POOL_KINDS) and row.meaning, row.name
        for outcome in row.outcomes.values():
            assert (outcome.status == "400") == bool(outcome.code and outcome.param), row.name


def test_every_row_has_a_case_and_every_effect_is_shown() -> None:
    assert set(CASES) == set(ROWS)
    for name, row in ROWS.items():
        for kind, outcome in row.outcomes.items():
            if outcome.status == "effect":
                assert kind in CASES[name].checks or outcome.proof, f"{name} on {kind}: no check and no proof"


def test_every_proof_names_a_test_that_exists() -> None:
    proofs = {o.proof for row in FIELDS for o in row.outcomes.values() if o.proof}
    assert proofs
    for proof in proofs:
        path, _, name = proof.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        assert any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body), proof


def test_the_api_page_holds_the_rendered_table() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    rendered = table.render_markdown()
    assert rendered in page and page.count("| `model` |") == 1
    assert "**Request fields on each pool kind**" in page


def test_harmony_rows_say_what_the_generate_table_does() -> None:
    """An engine option's harmony cells are a 400 exactly where router/dialects/engine_options.py refuses it."""
    assert set(GENERATE_OPTIONS) | set(HARMONY_REFUSED) == ENGINE_FIELDS
    for name in ENGINE_FIELDS:
        for kind, engine in ((table.HARMONY_VLLM, "vllm"), (table.HARMONY_SGLANG, "sglang")):
            refused = name in HARMONY_REFUSED or engine not in GENERATE_OPTIONS.get(name, {})
            assert (ROWS[name].outcomes[kind].status == "400") == refused, (name, kind)


def test_generate_body_carries_the_sampling_fields(enc: Any) -> None:
    """Harmony pools: temperature and top_p reach the generate call's sampling_params on both wires (the
    sim does not show them)."""
    from router.dialects.harmony_turn import HarmonyTurn
    from router.protocol.items import normalize_input
    from router.protocol.tools import build_toolset

    req = CreateResponse(model="m", input="hi", temperature=0.3, top_p=0.7)
    for engine in ("vllm", "sglang"):
        turn = HarmonyTurn(req, build_toolset([], "auto"), enc, engine=engine, context_length=8192, request_id="r")
        sampling = turn.request(normalize_input("hi"), stream=False)["sampling_params"]
        assert sampling["temperature"] == 0.3 and sampling["top_p"] == 0.7, engine


# -- each row on each pool kind, through the router ------------------------------------------------


@pytest.mark.parametrize("row", list(ROWS))
def test_the_field_does_what_the_table_says(client: openai.OpenAI, row: str) -> None:
    case = CASES[row]
    failures = []
    for kind in POOL_KINDS:
        outcome = ROWS[row].outcomes[kind]
        answer = send(client, kind, case)
        try:
            if outcome.status == "400":
                assert answer.status == 400, answer.body
                assert (answer.body.get("code"), answer.body.get("param")) == (outcome.code, outcome.param), answer.body
                continue
            assert answer.status == 200 and answer.body.get("status") != "failed", answer.body
            if outcome.status == "echoed":
                assert at(answer.body, case.echo or (ROWS[row].top_level,)) == sent_value(case, row)
            elif outcome.status == "accepted":
                path = case.echo or (ROWS[row].top_level,)
                assert path[-1] not in at(answer.body, path[:-1]), f"{row} is in the response: the table says accepted"
            else:
                if case.echo:  # recorded in the response too
                    assert at(answer.body, case.echo) == sent_value(case, row)
                check = case.checks.get(kind)
                if check is not None:
                    check(client, kind, answer)
        except AssertionError as exc:
            failures.append(f"{kind}: {exc}")
    assert not failures, f"{row}: " + "\n".join(failures)
