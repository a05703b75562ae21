"""State the router owns, end to end: conversations, background responses, replay, cancel, isolation."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from harness import RouterProcess
from tests.conftest import MODEL
from tests.support.streamrules import check_stream
from tests.support.waits import running_on_workers, wait_until

pytestmark = pytest.mark.e2e


def wait_for(client: openai.OpenAI, rid: str, statuses: set[str], timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(rid)
        if response.status in statuses:
            return response
        time.sleep(0.05)
    raise AssertionError(f"{rid} never reached {statuses}: {response.status}")


# -- conversations -------------------------------------------------------------------


def test_conversations_resource(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "first"}], metadata={"topic": "t"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "t"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "t"}
    assert client.conversations.update(conv.id, metadata={"topic": "u"}).metadata == {"topic": "u"}
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "second"},
                                                                {"type": "message", "role": "assistant", "content": "reply"}])
    assert [i.type for i in added.data] == ["message", "message"]
    items = client.conversations.items.list(conv.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["first", "second", "reply"]
    page = client.conversations.items.list(conv.id, order="asc", limit=1, after=items.data[0].id)
    assert [i.content[0].text for i in page.data] == ["second"] and page.has_more
    one = client.conversations.items.retrieve(items.data[1].id, conversation_id=conv.id)
    assert one.id == items.data[1].id
    after_delete = client.conversations.items.delete(items.data[1].id, conversation_id=conv.id)
    assert after_delete.id == conv.id
    assert [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc").data] == ["first", "reply"]
    kept = [i.id for i in client.conversations.items.list(conv.id, order="asc").data]
    again = {"type": "message", "role": "user", "content": "again", "id": items.data[0].id}
    for batch in ([again], [{**again, "id": "msg_twice"}, {**again, "id": "msg_twice"}]):  # an id it has; one id twice
        with pytest.raises(openai.BadRequestError) as err:
            client.conversations.items.create(conv.id, items=batch)
        assert err.value.body["code"] == "duplicate_item" and err.value.body["param"] == f"items[{len(batch) - 1}].id"
    with pytest.raises(openai.BadRequestError) as err:
        client.conversations.create(items=[{**again, "id": "msg_twice"}, {**again, "id": "msg_twice"}])
    assert err.value.body["code"] == "duplicate_item"
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc").data] == kept
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_responses_in_a_conversation(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[{"type": "message", "role": "developer", "content": "be terse"}])
    first = client.responses.create(model=MODEL, input="hello", conversation=conv.id)
    assert first.conversation.id == conv.id
    second = client.responses.create(model=MODEL, input="and? [sim:echo]", conversation={"id": conv.id})
    messages = json.loads(second.output_text)
    assert messages[0] == {"role": "system", "content": "be terse"}
    assert messages[1:] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "and? [sim:echo]"}]
    texts = [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc").data]
    assert texts == ["be terse", "hello", first.output_text, "and? [sim:echo]", second.output_text]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", conversation=conv.id, previous_response_id=first.id)
    assert err.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", conversation="conv_missing")
    assert err.value.body["code"] == "conversation_not_found"


def test_a_chain_from_a_conversation_response_continues_what_it_saw(client: openai.OpenAI) -> None:
    """previous_response_id on a response made in a conversation: the model sees the conversation's
    items before that response, then the response's own, then the chain; not what came later."""
    conv = client.conversations.create(items=[{"type": "message", "role": "developer", "content": "be terse"}])
    client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "my name is Ada"}])
    first = client.responses.create(model=MODEL, input="hello", conversation=conv.id)
    client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "later"}])
    second = client.responses.create(model=MODEL, input="and?", previous_response_id=first.id)
    third = client.responses.create(model=MODEL, input="what is my name? [sim:echo]", previous_response_id=second.id)
    assert json.loads(third.output_text) == [
        {"role": "system", "content": "be terse"}, {"role": "user", "content": "my name is Ada"},
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "what is my name? [sim:echo]"},
    ]
    # The response's own input items are still just its own.
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == ["hello"]
    client.conversations.delete(conv.id)  # the conversation gone, the chain keeps the responses' own items
    after = client.responses.create(model=MODEL, input="now? [sim:echo]", previous_response_id=first.id)
    assert json.loads(after.output_text) == [{"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": first.output_text},
                                             {"role": "user", "content": "now? [sim:echo]"}]


def test_a_chain_from_a_failed_or_background_conversation_response_sees_what_it_saw(client: openai.OpenAI) -> None:
    """The position kept is the conversation's end when the response was made: a response that failed
    (its items never appended) continues the conversation too, and an item added while one ran is not
    part of what it saw."""
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "seed"}])
    events = list(client.responses.create(model=MODEL, input="drop [sim:drop_after=2] [sim:tokens=9]",
                                          conversation=conv.id, stream=True))
    failed = events[-1].response
    assert failed.status == "failed"
    after = client.responses.create(model=MODEL, input="go [sim:echo]", previous_response_id=failed.id)
    assert [m["content"] for m in json.loads(after.output_text)][:2] == ["seed", "drop [sim:drop_after=2] [sim:tokens=9]"]
    running = client.responses.create(model=MODEL, input="slow [sim:ttft_ms=800]", conversation=conv.id, background=True)
    client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "meanwhile"}])
    done = wait_for(client, running.id, {"completed"})
    chained = client.responses.create(model=MODEL, input="next [sim:echo]", previous_response_id=running.id)
    assert json.loads(chained.output_text) == [
        {"role": "user", "content": "seed"}, {"role": "user", "content": "slow [sim:ttft_ms=800]"},
        {"role": "assistant", "content": done.output_text}, {"role": "user", "content": "next [sim:echo]"},
    ]


def test_item_reference_resolved_from_the_store(client: openai.OpenAI) -> None:
    earlier = client.responses.create(model=MODEL, input="remember this")
    reply = client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": earlier.output[0].id},
                                                          {"role": "user", "content": "what did you say? [sim:echo]"}])
    messages = json.loads(reply.output_text)
    assert messages[0] == {"role": "assistant", "content": earlier.output_text}


# -- background ------------------------------------------------------------------------


def test_background_response_completes_and_replays(client: openai.OpenAI) -> None:
    queued = client.responses.create(model=MODEL, input="slowly [sim:tokens=30] [sim:itl_ms=10]", background=True)
    assert queued.status == "queued" and queued.background is True
    done = wait_for(client, queued.id, {"completed"})
    assert len(done.output_text.split()) == 30
    events = [e.model_dump() for e in client.responses.retrieve(queued.id, stream=True)]
    final = check_stream(events)
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert final["output"][0]["content"][0]["text"] == done.output_text
    later = [e.model_dump() for e in client.responses.retrieve(queued.id, stream=True, starting_after=10)]
    assert [e["sequence_number"] for e in later] == list(range(11, len(events)))
    # A client that has seen the end (or asks past it) gets nothing more, not a second terminal event.
    for after in (len(events) - 1, len(events) + 100):
        assert list(client.responses.retrieve(queued.id, stream=True, starting_after=after)) == []


def test_background_stream_is_resumable(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="stream it [sim:tokens=40] [sim:itl_ms=10]", background=True, stream=True)
    events = iter(stream)
    first = [next(events).model_dump() for _ in range(5)]
    stream.close()  # the client goes away; the response goes on
    rid = first[0]["response"]["id"]
    with client.responses.stream(response_id=rid) as resumed:
        final = resumed.get_final_response()
    assert final.status == "completed" and len(final.output_text.split()) == 40


def test_cancel_stops_the_worker(client: openai.OpenAI, router: RouterProcess) -> None:
    queued = client.responses.create(model=MODEL, input="forever [sim:tokens=2000] [sim:itl_ms=20]", background=True)
    wait_for(client, queued.id, {"in_progress"})
    deadline = time.monotonic() + 10
    while running_on_workers(router) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.id == queued.id and cancelled.status == "cancelled"  # the answer waits for the stop
    final = wait_for(client, queued.id, {"cancelled"})
    assert final.status == "cancelled"
    deadline = time.monotonic() + 10
    while running_on_workers(router) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_on_workers(router) == 0, "the worker kept generating after cancel"
    events = [e.model_dump() for e in client.responses.retrieve(queued.id, stream=True)]
    assert events[-1]["type"] == "response.cancelled"
    again = client.responses.cancel(queued.id)  # cancelling twice is idempotent (OpenAI's background guide)
    assert again.status == "cancelled" and again.output == final.output
    finished = client.responses.create(model=MODEL, input="quick [sim:tokens=2]", background=True)
    wait_for(client, finished.id, {"completed"})
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(finished.id)  # it ended on its own: nothing to cancel
    assert err.value.body["code"] == "response_already_finished"
    assert client.responses.retrieve(finished.id).status == "completed"
    foreground = client.responses.create(model=MODEL, input="quick")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.retrieve(foreground.id, stream=True).close()


def test_deleting_a_running_background_response_stops_it_and_it_stays_deleted(
        client: openai.OpenAI, router: RouterProcess) -> None:
    """The run is stopped (the worker with it), and its last writes do not bring it back."""
    queued = client.responses.create(model=MODEL, input="long [sim:tokens=2000] [sim:itl_ms=10]", background=True)
    wait_for(client, queued.id, {"in_progress"})
    deleted = client.responses.delete(queued.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    deadline = time.monotonic() + 10
    while running_on_workers(router) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_on_workers(router) == 0, "the worker kept generating for a deleted response"
    # The run's own end: what the stopped run writes, it has written before it says so.
    wait_until(lambda: f"background response {queued.id} was deleted while it ran; stopped" in router.log(), 10,
               "the stopped run's end in the router's log")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="go on", previous_response_id=queued.id)


def test_a_turn_on_a_running_background_response_waits_for_it(client: openai.OpenAI) -> None:
    """Chaining on it while it runs would give the model its input without its output (and the
    next turns a history this one never saw): a 400 until it has finished, then the chain goes on."""
    queued = client.responses.create(model=MODEL, input="first [sim:tokens=30] [sim:itl_ms=10]", background=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="too soon", previous_response_id=queued.id)
    assert err.value.body["code"] == "previous_response_in_progress" and err.value.body["param"] == "previous_response_id"
    done = wait_for(client, queued.id, {"completed"})
    after = client.responses.create(model=MODEL, input="now [sim:echo]", previous_response_id=queued.id)
    assert json.loads(after.output_text)[1] == {"role": "assistant", "content": done.output_text}


def test_background_failure_is_recorded(client: openai.OpenAI) -> None:
    queued = client.responses.create(model=MODEL, input="boom [sim:drop_after=2] [sim:tokens=10]", background=True)
    failed = wait_for(client, queued.id, {"failed"})
    assert failed.error.code == "server_error" and failed.error.message
    replayed = [e.model_dump() for e in client.responses.retrieve(queued.id, stream=True)]
    assert [e["type"] for e in replayed[-2:]] == ["error", "response.failed"]
    assert replayed[-2]["code"] == "upstream_stream_broken"  # the log keeps what broke
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True, store=False)


# -- isolation ---------------------------------------------------------------------------


def test_every_id_endpoint_is_scoped_to_its_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from harness import sim_pool_toml, start_router

    keys = '[auth]\nkeys = [{ name = "a", key = "sk-aaaa-aaaa" }, { name = "b", key = "sk-bbbb-bbbb" }]\n'
    router = start_router(tmp_path, sim_pool_toml(replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n' + keys)
    try:
        a = openai.OpenAI(base_url=router.base_url + "/v1", api_key="sk-aaaa-aaaa", max_retries=0)
        b = httpx.Client(base_url=router.base_url + "/v1", headers={"authorization": "Bearer sk-bbbb-bbbb"})
        response = a.responses.create(model=MODEL, input="mine [sim:tokens=200] [sim:itl_ms=20]", background=True)
        conv = a.conversations.create(items=[{"type": "message", "role": "user", "content": "secret"}])
        item = a.conversations.items.list(conv.id).data[0]
        for method, path in [
            ("GET", f"/responses/{response.id}"), ("GET", f"/responses/{response.id}?stream=true"),
            ("GET", f"/responses/{response.id}/input_items"), ("POST", f"/responses/{response.id}/cancel"),
            ("DELETE", f"/responses/{response.id}"), ("GET", f"/conversations/{conv.id}"),
            ("POST", f"/conversations/{conv.id}"), ("DELETE", f"/conversations/{conv.id}"),
            ("GET", f"/conversations/{conv.id}/items"), ("POST", f"/conversations/{conv.id}/items"),
            ("GET", f"/conversations/{conv.id}/items/{item.id}"), ("DELETE", f"/conversations/{conv.id}/items/{item.id}"),
        ]:
            body = {"metadata": {}} if method == "POST" and path.endswith(conv.id) else (
                {"items": [{"role": "user", "content": "x"}]} if method == "POST" and path.endswith("/items") else None)
            resp = b.request(method, path, json=body)
            assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        resp = b.post("/responses", json={"model": MODEL, "input": "x", "conversation": conv.id})
        assert resp.status_code == 404
        resp = b.post("/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": item.id}]})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "item_not_found"
        # Nothing b tried changed a's state.
        assert a.responses.retrieve(response.id).status in ("queued", "in_progress", "completed")
        assert [i.id for i in a.conversations.items.list(conv.id).data] == [item.id]
    finally:
        assert router.stop() == 0


def test_a_stream_deleted_while_it_runs_ends_and_stays_deleted(client: openai.OpenAI) -> None:
    """On SQLite as on PostgreSQL (tests/e2e/test_e2e_replicas.py): a stored stream is retrievable as it
    runs; deleted meanwhile, it streams to its end and its last put writes nothing back."""
    with client.responses.stream(model=MODEL, input="[sim:tokens=40] [sim:itl_ms=20]") as stream:
        rid = next(e for e in stream if e.type == "response.created").response.id
        assert client.responses.retrieve(rid).status == "in_progress"
        client.responses.delete(rid)
        final = stream.get_final_response()
    assert final.status == "completed" and len(final.output_text.split()) == 40
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
