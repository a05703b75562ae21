"""WebSocket mode end to end: a router process with sim workers, driven by the openai SDK's
``client.responses.connect()`` and by a raw ``websockets`` client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from harness import RouterProcess, sim_pool_toml, start_router
from tests.conftest import MODEL
from tests.support.streamrules import check_stream, text_of
from tests.support.waits import tcp_connections, wait_until

pytestmark = pytest.mark.e2e

KEY = "sk-test-websocket-123456"
MAX_AGE_S = 4.0  # every connection in this module but the max-age test's ends well before this
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def wsrouter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A router with an API key and a short maximum WebSocket connection age."""
    body = (
        sim_pool_toml(replicas=1)
        + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
        + f'\n[auth]\nkeys = [{{ name = "ws", key = "{KEY}" }}]\n'
    )
    proc = start_router(tmp_path_factory.mktemp("wsrouter"), body, server=f"websocket_max_age_s = {MAX_AGE_S}")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def sdk(wsrouter: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=wsrouter.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def ws_url(router: RouterProcess) -> str:
    return f"ws://127.0.0.1:{router.port}/v1/responses"


def raw(router: RouterProcess, key: str | None = KEY) -> ClientConnection:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return connect(ws_url(router), additional_headers=headers, open_timeout=10, close_timeout=5)


def send(ws: ClientConnection, **event: Any) -> None:
    ws.send(json.dumps({"type": "response.create", **event}))


def recv(ws: ClientConnection, timeout: float = 10) -> dict[str, Any]:
    frame = ws.recv(timeout=timeout)
    assert isinstance(frame, str), "events are text frames"
    return json.loads(frame)


def one_response(ws: ClientConnection) -> list[dict[str, Any]]:
    """Frames up to a terminal event, or a lone error (refused before the response began)."""
    events = []
    while True:
        event = recv(ws)
        events.append(event)
        if event["type"] in TERMINAL:
            return events
        if event["type"] == "error" and len(events) == 1:
            return events


def assert_ws_error(event: dict[str, Any], *, code: str, status: int | None = None, param: str | None = None) -> dict:
    """The SDK's ResponseWsError shape: nested ``error`` with type, code, message, param."""
    assert event["type"] == "error", event
    error = event["error"]
    assert {"type", "code", "message", "param"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == code, error
    if status is not None:
        assert event["status"] == status, event
    if param is not None:
        assert error["param"] == param, error
    return error


def completed(ws: ClientConnection, **event: Any) -> dict[str, Any]:
    send(ws, **event)
    events = one_response(ws)
    response = check_stream(events)
    assert events[-1]["type"] == "response.completed", events[-1]
    return response


# -- the SDK's client ------------------------------------------------------------


def sdk_events(conn: Any) -> list[dict[str, Any]]:
    events = []
    for event in conn:
        events.append(event.to_dict())
        if event.type in TERMINAL or (event.type == "error" and len(events) == 1):
            break
    return events


def test_sdk_single_response(sdk: openai.OpenAI) -> None:
    with sdk.responses.connect() as conn:
        conn.response.create(model=MODEL, input="say something [sim:tokens=5]")
        events = sdk_events(conn)
    response = check_stream(events)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    assert response["status"] == "completed" and len(text_of(response).split()) == 5
    assert "stream_id" not in events[0]
    # Stored like any other response; POST /v1/responses still answers on the same path.
    assert sdk.responses.retrieve(response["id"]).status == "completed"
    assert sdk.responses.create(model=MODEL, input="over http [sim:tokens=2]").status == "completed"


def test_sdk_sequential_and_store_false_continuation(sdk: openai.OpenAI) -> None:
    with sdk.responses.connect() as conn:
        conn.response.create(model=MODEL, input="the code word is zebra [sim:tokens=4]", store=False)
        first = check_stream(sdk_events(conn))
        conn.response.create(model=MODEL, input="[sim:echo]", store=False, previous_response_id=first["id"])
        second = check_stream(sdk_events(conn))
        conn.response.create(model=MODEL, input="and again [sim:echo]", store=False, previous_response_id=second["id"])
        third = check_stream(sdk_events(conn))
    assert first["status"] == second["status"] == third["status"] == "completed"
    assert len({first["id"], second["id"], third["id"]}) == 3
    echoed = text_of(second)
    assert "the code word is zebra" in echoed and text_of(first) in echoed
    assert "zebra" in text_of(third) and "[sim:echo]" in text_of(third)
    with pytest.raises(openai.NotFoundError):  # store: false stays on the connection
        sdk.responses.retrieve(first["id"])


def test_sdk_session_lanes(sdk: openai.OpenAI) -> None:
    """The SDK's lane helper: stream_id is echoed, so each lane gets its own response."""
    from openai.lib.responses_websocket import (
        ResponsesWebSocketLimits,
        ResponsesWebSocketSession,
    )

    limits = ResponsesWebSocketLimits(max_lanes=4, max_events_per_lane=256, max_events=512,
                                      max_bytes_per_lane=1 << 22, max_bytes=1 << 23)
    with sdk.responses.connect() as conn, ResponsesWebSocketSession(conn, limits=limits) as session:
        lane_a, lane_b = session.lane("a"), session.lane("b")
        lane_a.send({"type": "response.create", "model": MODEL, "input": "slow [sim:tokens=6] [sim:itl_ms=50]"})
        lane_b.send({"type": "response.create", "model": MODEL, "input": "fast [sim:tokens=3]"})
        b = lane_b.get_final_response()
        a = lane_a.get_final_response()
    assert a.status == b.status == "completed"
    assert len(a.output_text.split()) == 6 and len(b.output_text.split()) == 3


def test_sdk_auth_failure(wsrouter: RouterProcess) -> None:
    bad = openai.OpenAI(base_url=wsrouter.base_url + "/v1", api_key="sk-wrong-key-000000", max_retries=0)
    with pytest.raises(InvalidStatus) as info, bad.responses.connect():
        pass
    assert info.value.response.status_code == 401
    assert json.loads(info.value.response.body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(InvalidStatus) as info:
        raw(wsrouter, key=None)
    assert info.value.response.status_code == 401
    assert json.loads(info.value.response.body)["error"]["code"] == "missing_api_key"
    # A refusal is an answer, not an error of the router's: nothing at ERROR for anyone knocking.
    assert "without completing handshake" not in wsrouter.log()


def test_sdk_max_connection_age(sdk: openai.OpenAI) -> None:
    """At the maximum age the running response finishes, then an error event and a 1000 close."""
    start = time.monotonic()
    with sdk.responses.connect() as conn:
        time.sleep(max(0.0, MAX_AGE_S - 1.0 - (time.monotonic() - start)))  # the connection's age is what is tested
        conn.response.create(model=MODEL, input="long one [sim:tokens=20] [sim:itl_ms=100]")  # runs past the age
        events = [e.to_dict() for e in conn]  # ends cleanly: the close is a normal one
        close_code, close_reason = conn._connection.close_code, conn._connection.close_reason
    elapsed = time.monotonic() - start
    assert elapsed >= MAX_AGE_S
    response = check_stream(events[:-1])
    assert response["status"] == "completed" and len(text_of(response).split()) == 20
    assert_ws_error(events[-1], code="websocket_connection_limit_reached")
    assert close_code == 1000 and "maximum connection age" in (close_reason or "")


# -- a raw client ----------------------------------------------------------------


def test_raw_sequential_responses_and_stream_id(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        ids = [completed(ws, model=MODEL, input=f"turn {i} [sim:tokens=3]")["id"] for i in range(3)]
        assert len(set(ids)) == 3
        # Two creates sent back to back on one lane run one after the other, never interleaved.
        send(ws, model=MODEL, input="queued one [sim:tokens=4]", stream_id="lane-1")
        send(ws, model=MODEL, input="queued two [sim:tokens=2]", stream_id="lane-1")
        first, second = one_response(ws), one_response(ws)
        for events in (first, second):
            check_stream(events)
            assert {e["stream_id"] for e in events} == {"lane-1"}
        assert len(text_of(first[-1]["response"]).split()) == 4
        assert len(text_of(second[-1]["response"]).split()) == 2


def test_raw_reconnect_is_previous_response_not_found(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        kept = completed(ws, model=MODEL, input="on the first connection [sim:tokens=3]", store=False)
        assert completed(ws, model=MODEL, input="continue", store=False, previous_response_id=kept["id"])
    with raw(wsrouter) as ws:
        send(ws, model=MODEL, input="continue", previous_response_id=kept["id"], stream_id="s1")
        [event] = one_response(ws)
        assert_ws_error(event, code="previous_response_not_found", status=404, param="previous_response_id")
        assert event["stream_id"] == "s1"
        send(ws, model=MODEL, input="continue", previous_response_id="resp_does_not_exist")
        assert_ws_error(one_response(ws)[0], code="previous_response_not_found")
        assert completed(ws, model=MODEL, input="still usable [sim:tokens=2]")["status"] == "completed"


def test_raw_failed_continuation_evicts(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        asked = completed(ws, model=MODEL, input="weather? [sim:call=get_weather]", tools=[WEATHER], store=False)
        [call] = [i for i in asked["output"] if i["type"] == "function_call"]
        answer = [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
        good = completed(ws, model=MODEL, input=answer, tools=[WEATHER], store=False, previous_response_id=asked["id"])
        assert "sunny" in text_of(good)
        wrong = [{"type": "function_call_output", "call_id": "call_unknown", "output": "rain"}]
        send(ws, model=MODEL, input=wrong, tools=[WEATHER], store=False, previous_response_id=asked["id"])
        assert_ws_error(one_response(ws)[0], code="tool_call_not_found", status=400)
        # The failed continuation evicted the response it continued from ...
        send(ws, model=MODEL, input=answer, tools=[WEATHER], store=False, previous_response_id=asked["id"])
        assert_ws_error(one_response(ws)[0], code="previous_response_not_found", status=404)
        # ... but not the others.
        after = completed(ws, model=MODEL, input="thanks [sim:echo]", store=False, previous_response_id=good["id"])
        assert "sunny" in text_of(after)


def test_raw_generate_false(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        send(ws, model=MODEL, input="prepared context: the animal is an okapi", store=False, generate=False,
             stream_id="prep")
        events = one_response(ws)
        assert [e["type"] for e in events] == ["response.created", "response.completed"]
        assert {e["stream_id"] for e in events} == {"prep"}
        prepared = check_stream(events)
        assert prepared["output"] == [] and prepared["status"] == "completed"
        follow = completed(ws, model=MODEL, input="which animal? [sim:echo]", store=False,
                           previous_response_id=prepared["id"])
        assert "okapi" in text_of(follow)


def test_raw_worker_failure_then_good_response(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        send(ws, model=MODEL, input="break [sim:tokens=30] [sim:drop_after=2]")
        events = one_response(ws)
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
        error = assert_ws_error(events[-2], code="upstream_stream_broken")
        assert error["type"] == "server_error"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["response"]["status"] == "failed"
        assert completed(ws, model=MODEL, input="fine now [sim:tokens=3]")["status"] == "completed"


def test_raw_malformed_frames(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        ws.send("this is not json")
        assert_ws_error(recv(ws), code="invalid_json", status=400)
        ws.send("[1, 2]")
        assert_ws_error(recv(ws), code="invalid_json")
        ws.send(json.dumps({"model": MODEL}))
        assert_ws_error(recv(ws), code="missing_required_parameter", param="type")
        ws.send(json.dumps({"type": "session.update"}))
        assert_ws_error(recv(ws), code="unknown_event_type", param="type")
        send(ws, model=MODEL, input="hi", bogus=1)
        assert_ws_error(recv(ws), code="unknown_parameter", param="bogus")
        send(ws, model=MODEL, input="hi", background=True)
        assert_ws_error(recv(ws), code="unsupported_parameter", param="background")
        send(ws, model="no-such-model", input="hi")
        assert_ws_error(recv(ws), code="model_not_found", status=404)
        send(ws, input="hi")
        assert_ws_error(recv(ws), code="missing_required_parameter", param="model")
        # stream: false is ignored (streaming is implied); the connection is still fine.
        assert completed(ws, model=MODEL, input="ok [sim:tokens=2]", stream=False)["status"] == "completed"


def test_http_get_on_the_path_is_not_a_websocket(wsrouter: RouterProcess) -> None:
    resp = httpx.get(wsrouter.base_url + "/v1/responses", headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 405
    assert resp.json()["error"]["code"] == "method_not_allowed"


def worker_in_flight(router: RouterProcess) -> float:
    text = httpx.get(router.base_url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if "worker_in_flight{" in line)


def test_client_leaving_mid_response_releases_the_worker(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as ws:
        send(ws, model=MODEL, input="long [sim:tokens=200] [sim:itl_ms=20]")
        assert recv(ws)["type"] == "response.created"
        assert recv(ws)["type"] == "response.in_progress"
        assert worker_in_flight(wsrouter) == 1
    deadline = time.monotonic() + 5
    while worker_in_flight(wsrouter) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_in_flight(wsrouter) == 0
    with raw(wsrouter) as ws:
        assert completed(ws, model=MODEL, input="next [sim:tokens=2]")["status"] == "completed"
        ws.close()
        with pytest.raises(ConnectionClosedOK):
            ws.recv(timeout=1)


def test_slow_reader_holds_up_only_its_own_connection(wsrouter: RouterProcess) -> None:
    with raw(wsrouter) as slow, raw(wsrouter) as fast:
        send(slow, model=MODEL, input="a lot [sim:tokens=3000]")
        # slow reads nothing yet: its frames wait in the buffers, then the router's sends to it wait
        ours = slow.socket.getsockname()[1]
        wait_until(lambda: any(local == wsrouter.port and remote == ours and tx for local, remote, tx, _ in tcp_connections()),
                   10, "the router's sends to the slow reader waiting (bytes in its socket's send queue)")
        # fast is answered while slow's 3000 tokens sit unread (no timing bound: that would be flaky)
        assert completed(fast, model=MODEL, input="quick [sim:tokens=3]")["status"] == "completed"
        events = one_response(slow)
        assert events[-1]["type"] == "response.completed"
        assert len(text_of(check_stream(events)).split()) == 3000


def test_a_stored_response_is_there_while_it_streams(wsrouter: RouterProcess, sdk: openai.OpenAI) -> None:
    """As on HTTP: a ``store: true`` response made over the WebSocket is stored ``in_progress`` from
    its first event, so another client sees it while it streams, then ``completed``."""
    with raw(wsrouter) as ws:
        send(ws, model=MODEL, input="[sim:tokens=40] [sim:itl_ms=20]", store=True)
        created = recv(ws)
        assert created["type"] == "response.created"
        rid = created["response"]["id"]
        running = sdk.responses.retrieve(rid)
        # No output yet, or a checkpoint's (each second): what it had then, its message incomplete.
        assert running.status == "in_progress" and all(item.status == "incomplete" for item in running.output)
        events = [created] + one_response(ws)
    check_stream(events)
    stored = sdk.responses.retrieve(rid)
    assert stored.status == "completed" and stored.output_text == text_of(events[-1]["response"])
