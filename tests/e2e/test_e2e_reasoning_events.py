"""The names of streamed reasoning events, OpenAI's or the Open Responses specification's, through a
real router process and sim workers (``[sim:reason=N]`` streams reasoning on the per-token fast path,
``[sim:think=N]`` on a think-tag pool the general one).

Each stream is checked whole by a validator of its vocabulary: the openai SDK's own event types
(``ResponseStreamEvent``) for OpenAI's names, and for the Open Responses names a reading of its
schema (openresponses/openresponses ``schema/events.tsp``): ``response.reasoning.delta`` with
``type, sequence_number, item_id, output_index, content_index, delta`` (and an optional
``obfuscation``), ``response.reasoning.done`` with ``text`` for ``delta``; the other events are the
ones both vocabularies share, so the SDK's types check them. Chosen per request (``reasoning_events``),
per API key and per model in config; the request's choice wins, then the key's, then the model's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from harness import RouterProcess, sim_pool_toml, start_router
from router.protocol.replay import output_of

pytestmark = pytest.mark.e2e

KEY_PLAIN = "sk-plain-0123456789"
KEY_OR = "sk-open-responses-0123456789"
PROMPT = "Think first [sim:reason=6] [sim:tokens=4]"
THINK_PROMPT = "Think in tags [sim:think=5] [sim:tokens=3]"
OPENAI_NAMES = ("response.reasoning_text.delta", "response.reasoning_text.done")
OPEN_NAMES = ("response.reasoning.delta", "response.reasoning.done")
SDK_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)

# The Open Responses reasoning events (schema/events.tsp): required fields and optional ones, with their types.
_BASE = {"type": str, "sequence_number": int, "item_id": str, "output_index": int, "content_index": int}
OPEN_RESPONSES_REASONING: dict[str, tuple[dict[str, type], dict[str, type]]] = {
    "response.reasoning.delta": ({**_BASE, "delta": str}, {"obfuscation": str}),
    "response.reasoning.done": ({**_BASE, "text": str}, {}),
}


def openai_event(event: dict[str, Any]) -> None:
    """The openai SDK's reading: the event is one of its ResponseStreamEvent types, fields and all."""
    SDK_EVENT.validate_python(event)


def open_responses_event(event: dict[str, Any]) -> None:
    """The Open Responses reading: its reasoning events exactly as its schema has them, no OpenAI
    reasoning_text event, and the events both vocabularies share as the SDK types them."""
    kind = event["type"]
    if kind in OPEN_RESPONSES_REASONING:
        required, optional = OPEN_RESPONSES_REASONING[kind]
        assert set(required) <= set(event) <= set(required) | set(optional), f"{kind}: fields {sorted(event)}"
        for field, kind_of in {**required, **optional}.items():
            if field in event:
                assert type(event[field]) is kind_of, f"{kind}.{field}: {event[field]!r}"
        return
    assert not kind.startswith("response.reasoning_text."), f"{kind} is not an Open Responses event"
    openai_event(event)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    body = (
        sim_pool_toml(name="sim", replicas=1)
        + sim_pool_toml(name="think", replicas=1) + "[pools.chat]\nthink_tags = true\n"
        + '\n[[models]]\nname = "sim-chat"\npool = "sim"\n'
        + '[[models]]\nname = "sim-or"\npool = "sim"\nreasoning_events = "open-responses"\n'
        + '[[models]]\nname = "sim-think"\npool = "think"\n'
        + f'\n[auth]\nkeys = [{{ name = "plain", key = "{KEY_PLAIN}" }},'
        + f' {{ name = "or", key = "{KEY_OR}", reasoning_events = "open-responses" }}]\n'
    )
    proc = start_router(tmp_path_factory.mktemp("reasoning-events"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


def sse(router: RouterProcess, body: dict[str, Any], key: str = KEY_PLAIN, path: str = "/v1/responses",
        method: str = "POST") -> list[dict[str, Any]]:
    """A stream's events as sent, each frame's ``event:`` line checked against its type."""
    events: list[dict[str, Any]] = []
    request = dict(json=body) if method == "POST" else {}
    with httpx.stream(method, router.base_url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      **request) as answer:  # type: ignore[arg-type]
        assert answer.status_code == 200, answer.read()
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert event["type"] == name
                events.append(event)
    assert events and events[-1]["type"] == "response.completed"
    return events


def reasoning(events: list[dict[str, Any]], names: tuple[str, str]) -> str:
    """The reasoning text the events stream under ``names``, checked against their done event and the
    final response's reasoning item; no event of the other vocabulary."""
    other = OPEN_NAMES if names == OPENAI_NAMES else OPENAI_NAMES
    assert not [e for e in events if e["type"] in other]
    deltas = [e for e in events if e["type"] == names[0]]
    done = [e for e in events if e["type"] == names[1]]
    assert deltas and len(done) == 1
    text = "".join(e["delta"] for e in deltas)
    assert done[0]["text"] == text and text
    item = next(i for i in events[-1]["response"]["output"] if i["type"] == "reasoning")
    assert item["content"] == [{"type": "reasoning_text", "text": text}]
    assert {e["item_id"] for e in deltas + done} == {item["id"]}
    return text


def test_default_names_are_openais(router: RouterProcess) -> None:
    events = sse(router, {"model": "sim-chat", "input": PROMPT, "stream": True})
    for event in events:
        openai_event(event)
    reasoning(events, OPENAI_NAMES)


def test_the_openai_sdk_reads_the_default_stream(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY_PLAIN, max_retries=0)
    with client.responses.stream(model="sim-chat", input=PROMPT) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert OPENAI_NAMES[0] in kinds and OPENAI_NAMES[1] in kinds
    assert final.output[0].type == "reasoning" and final.output[0].content


def test_a_request_asks_for_open_responses_names(router: RouterProcess) -> None:
    plain = sse(router, {"model": "sim-chat", "input": PROMPT, "stream": True})
    events = sse(router, {"model": "sim-chat", "input": PROMPT, "stream": True, "reasoning_events": "open-responses"})
    for event in events:
        open_responses_event(event)
    assert reasoning(events, OPEN_NAMES) == reasoning(plain, OPENAI_NAMES)
    # Each validator refuses the other vocabulary: why the choice exists.
    with pytest.raises(ValidationError):
        openai_event(next(e for e in events if e["type"] == OPEN_NAMES[0]))
    with pytest.raises(AssertionError):
        open_responses_event(next(e for e in plain if e["type"] == OPENAI_NAMES[0]))
    # Nothing else differs: the same events, in the same order, with the same numbers.
    assert [e["type"] for e in events] == [{OPENAI_NAMES[0]: OPEN_NAMES[0], OPENAI_NAMES[1]: OPEN_NAMES[1]}.get(
        e["type"], e["type"]) for e in plain]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_general_path_uses_the_chosen_names(router: RouterProcess) -> None:
    default = sse(router, {"model": "sim-think", "input": THINK_PROMPT, "stream": True})
    for event in default:
        openai_event(event)
    chosen = sse(router, {"model": "sim-think", "input": THINK_PROMPT, "stream": True, "reasoning_events": "open-responses"})
    for event in chosen:
        open_responses_event(event)
    assert reasoning(chosen, OPEN_NAMES) == reasoning(default, OPENAI_NAMES)


def test_a_model_set_to_open_responses(router: RouterProcess) -> None:
    events = sse(router, {"model": "sim-or", "input": PROMPT, "stream": True})
    for event in events:
        open_responses_event(event)
    reasoning(events, OPEN_NAMES)
    asked = sse(router, {"model": "sim-or", "input": PROMPT, "stream": True, "reasoning_events": "openai"})
    for event in asked:
        openai_event(event)
    reasoning(asked, OPENAI_NAMES)  # the request's choice wins over the model's


def test_a_key_set_to_open_responses(router: RouterProcess) -> None:
    events = sse(router, {"model": "sim-chat", "input": PROMPT, "stream": True}, key=KEY_OR)
    for event in events:
        open_responses_event(event)
    reasoning(events, OPEN_NAMES)
    asked = sse(router, {"model": "sim-chat", "input": PROMPT, "stream": True, "reasoning_events": "openai"}, key=KEY_OR)
    for event in asked:
        openai_event(event)
    reasoning(asked, OPENAI_NAMES)  # the request's choice wins over the key's


def test_a_background_replay_keeps_the_names_its_create_chose(router: RouterProcess) -> None:
    events = sse(router, {"model": "sim-chat", "input": PROMPT, "stream": True, "background": True,
                          "reasoning_events": "open-responses"})
    text = reasoning(events, OPEN_NAMES)
    replayed = sse(router, {}, path=f"/v1/responses/{events[0]['response']['id']}?stream=true", method="GET")
    for event in replayed:
        open_responses_event(event)
    assert reasoning(replayed, OPEN_NAMES) == text
    # What the sweep rebuilds from such a log cut off mid-reasoning (its replica died): the text so far.
    done = next(i for i, e in enumerate(replayed) if e["type"] == OPEN_NAMES[1])
    rebuilt = output_of(replayed[:done])
    assert rebuilt[0]["content"] == [{"type": "reasoning_text", "text": text}] and rebuilt[0]["status"] == "incomplete"


def test_a_json_answer_is_the_same_either_way(router: RouterProcess) -> None:
    answers = []
    for choice in ("openai", "open-responses"):
        answer = httpx.post(router.base_url + "/v1/responses", headers={"Authorization": f"Bearer {KEY_PLAIN}"},
                            json={"model": "sim-chat", "input": PROMPT, "reasoning_events": choice}, timeout=30)
        assert answer.status_code == 200
        answers.append(answer.json()["output"][0]["content"])
    assert answers[0] == answers[1] and answers[0][0]["text"]


def test_an_unknown_choice_is_a_400(router: RouterProcess) -> None:
    answer = httpx.post(router.base_url + "/v1/responses", headers={"Authorization": f"Bearer {KEY_PLAIN}"},
                        json={"model": "sim-chat", "input": "hi", "reasoning_events": "anthropic"}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "reasoning_events" and error["code"] == "invalid_value" and error["type"] == "invalid_request_error"
