"""End to end: the openai SDK -> a router process -> two sim worker processes."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.conftest import MODEL, THINK_MODEL
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e


def echoed(response: openai.types.responses.Response) -> list[dict]:
    """The chat messages the worker received (the sim's [sim:echo] answer)."""
    return json.loads(response.output_text)


def test_text(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say something.")
    assert response.status == "completed"
    assert response.id.startswith("resp_")
    assert response.model == MODEL
    assert len(response.output) == 1 and response.output[0].type == "message"
    assert response.output[0].status == "completed"
    assert len(response.output_text.split()) == 12  # the sim's default length
    assert response.usage is not None and response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    # Deterministic worker: the same prompt gives the same text on either worker.
    again = client.responses.create(model=MODEL, input="Say something.")
    assert again.output_text == response.output_text and again.id != response.id


def test_settings_reach_the_worker_and_are_echoed(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[
            {"role": "system", "content": "sys text"},
            {"role": "developer", "content": [{"type": "input_text", "text": "dev text"}]},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "second [sim:echo]"}]},
        ],
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=4000,
        metadata={"team": "a", "run": "7"},
    )
    # System and developer text merge into one leading system message (the pool's default).
    assert echoed(response) == [
        {"role": "system", "content": "Be brief.\n\nsys text\n\ndev text"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second [sim:echo]"},
    ]
    assert response.instructions == "Be brief."
    assert response.temperature == 0.2 and response.top_p == 0.9
    assert response.max_output_tokens == 4000
    assert response.metadata == {"team": "a", "run": "7"}
    assert response.store is True


def test_stream_events_obey_the_rules(client: openai.OpenAI) -> None:
    events = [e.model_dump() for e in client.responses.create(model=MODEL, input="stream me [sim:tokens=7]", stream=True)]
    response = check_stream(events)
    assert events[-1]["type"] == "response.completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == 7
    assert "".join(deltas) == response["output"][0]["content"][0]["text"]
    assert response["usage"]["output_tokens"] == 7
    # What was streamed is what was stored.
    stored = client.responses.retrieve(response["id"])
    assert stored.output_text == "".join(deltas) and stored.status == "completed"


def test_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input="same prompt [sim:tokens=9]")
    events = list(client.responses.create(model=MODEL, input="same prompt [sim:tokens=9]", stream=True))
    final = events[-1].response
    assert final.output_text == plain.output_text
    assert final.usage == plain.usage


def test_stream_helper_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="helper [sim:tokens=5]") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(texts) and len(texts) == 5


def test_chain_of_many_turns_carries_history(client: openai.OpenAI) -> None:
    previous = None
    answers = []
    for turn in range(6):
        response = client.responses.create(model=MODEL, input=f"turn {turn}", previous_response_id=previous)
        answers.append(response.output_text)
        previous = response.id
    final = client.responses.create(model=MODEL, input="recap [sim:echo]", previous_response_id=previous,
                                    instructions="only this turn's instructions")
    messages = echoed(final)
    assert messages[0] == {"role": "system", "content": "only this turn's instructions"}
    expected = []
    for turn, answer in enumerate(answers):
        expected += [{"role": "user", "content": f"turn {turn}"}, {"role": "assistant", "content": answer}]
    assert messages[1:] == expected + [{"role": "user", "content": "recap [sim:echo]"}]
    assert final.previous_response_id == previous


def test_streamed_turn_can_be_chained_at_once(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="first") as stream:
        first = stream.get_final_response()
    # Persisted before response.completed was sent: chaining right away works.
    second = client.responses.create(model=MODEL, input="next [sim:echo]", previous_response_id=first.id)
    assert echoed(second)[1] == {"role": "assistant", "content": first.output_text}


def test_retrieve_and_delete(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="keep me", metadata={"k": "v"})
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(created.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=created.id)
    assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_input_items_pagination(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": f"message {i}"} for i in range(7)]
    response = client.responses.create(model=MODEL, input=items)
    page = client.responses.input_items.list(response.id, order="asc", limit=3)
    assert [item.content[0].text for item in page.data] == ["message 0", "message 1", "message 2"]
    assert page.has_more is True and page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    page2 = client.responses.input_items.list(response.id, order="asc", limit=3, after=page.last_id)
    assert [item.content[0].text for item in page2.data] == ["message 3", "message 4", "message 5"]
    every = [item.content[0].text for item in client.responses.input_items.list(response.id, order="asc", limit=2)]
    assert every == [f"message {i}" for i in range(7)]  # auto-pagination walks all pages
    newest = client.responses.input_items.list(response.id)
    assert [item.content[0].text for item in newest.data] == [f"message {i}" for i in reversed(range(7))]
    assert newest.has_more is False
    assert all(item.type == "message" and item.role == "user" and item.id for item in newest.data)


def test_max_output_tokens_gives_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="long answer [sim:tokens=50]", max_output_tokens=16)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 16
    events = [e.model_dump() for e in client.responses.create(
        model=MODEL, input="long answer [sim:tokens=50]", max_output_tokens=16, stream=True)]
    final = check_stream(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["output"][0]["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="forget me", store=False)
    assert response.status == "completed" and response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=response.id)
    assert err.value.body["code"] == "previous_response_not_found"


def test_models_and_health(client: openai.OpenAI, router) -> None:
    assert [m.id for m in client.models.list()] == [MODEL, THINK_MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    import urllib.request

    with urllib.request.urlopen(router.base_url + "/health") as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok"
    pool = health["pools"][0]
    assert pool["name"] == "sim" and pool["healthy_workers"] == 2
    assert all(w["healthy"] for w in pool["workers"])


def test_load_spreads_over_both_workers(client: openai.OpenAI, router) -> None:
    import urllib.request

    for i in range(6):
        client.responses.create(model=MODEL, input=f"spread {i}")
    with urllib.request.urlopen(router.base_url + "/health") as resp:
        workers = json.loads(resp.read())["pools"][0]["workers"]
    assert all(w["served"] >= 2 for w in workers), workers


def test_chat_completions_passthrough(client: openai.OpenAI) -> None:
    direct = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi [sim:tokens=5]"}])
    assert direct.choices[0].message.content and direct.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi [sim:tokens=5]"}],
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):  # the worker's own 400 comes back as it is
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x [sim:status=400]"}])


def test_every_answer_has_a_request_id(client: openai.OpenAI) -> None:
    """``x-request-id`` on every answer, a new one each time: the SDK's ``_request_id``, what a
    user quotes when something went wrong. Hot routes, streams, errors and the other routes alike."""
    made = client.responses.create(model=MODEL, input="hi")
    retrieved = client.responses.with_raw_response.retrieve(made.id)
    with client.responses.with_streaming_response.create(model=MODEL, input="hi", stream=True) as streamed:
        streamed_id = streamed.headers.get("x-request-id")
        assert any(line.startswith("event: response.completed") for line in streamed.iter_lines())
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=[])
    chat = client.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    models = client.models.with_raw_response.list()
    ids = [made._request_id, retrieved.headers.get("x-request-id"), streamed_id, missing.value.request_id,
           refused.value.request_id, chat.headers.get("x-request-id"), models.headers.get("x-request-id")]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i or "") for i in ids), ids
    assert len(set(ids)) == len(ids)
