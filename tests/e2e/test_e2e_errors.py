"""Bad input, dead and broken workers: the right status, the OpenAI error shape, and an intact store."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from harness import RouterProcess, free_port, sim_pool_toml, start_router
from tests.conftest import MODEL
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e

KEY_A = "sk-test-key-a-123456"
KEY_B = "sk-test-key-b-654321"
KEY_C = "sk-test-key-c-hashed"  # configured by its sha256 only
KEY_D = "sk-test-key-d-from-env"  # configured by an environment variable


def assert_error(resp: httpx.Response, status: int, *, code: str | None = None, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def http(router: RouterProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A router with API keys, a 64 KiB body limit, and a model whose only worker is dead."""
    dead = f"http://127.0.0.1:{free_port()}"
    body = (
        sim_pool_toml(replicas=1)
        + f'\n[[pools]]\nname = "dead"\nengine = "vllm"\nmodel = "m"\nurls = ["{dead}"]\nhealth_interval_s = 0.5\n'
        + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n[[models]]\nname = "dead-model"\npool = "dead"\n'
        + f'\n[auth]\nkeys = [{{ name = "a", key = "{KEY_A}" }}, {{ name = "b", key = "{KEY_B}" }},'
        + f' {{ name = "c", key_sha256 = "{hashlib.sha256(KEY_C.encode()).hexdigest()}" }},'
        + ' { name = "d", key_env = "RR_TEST_KEY_D" }]\n'
    )
    os.environ["RR_TEST_KEY_D"] = KEY_D  # the router process inherits it
    proc = start_router(tmp_path_factory.mktemp("strict"), body, server="max_body_bytes = 65536")
    yield proc
    assert proc.stop() == 0, proc.log()


def stored_statuses(router: RouterProcess) -> dict[str, str]:
    """Read the router's SQLite file directly: what is really stored, not what the API says."""
    with sqlite3.connect(f"file:{router.dir / 'responses.db'}?mode=ro", uri=True) as db:
        return dict(db.execute("SELECT id, status FROM responses"))


# -- malformed bodies --------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b"", None, "invalid_json"),
        (b'{"input": "hi"}', "model", "missing_required_parameter"),
        (b'{"model": "sim-chat", "input": "hi", "temperature": "hot"}', "temperature", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "temperature": 5}', "temperature", "invalid_value"),
        (b'{"model": "sim-chat", "input": 5}', "input", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "max_output_tokens": 0}', "max_output_tokens", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "surprise": 1}', "surprise", "unknown_parameter"),
        # The SDK's parameters for OpenAI's own services: refused by name, not as unknown.
        (b'{"model": "sim-chat", "input": "hi", "moderation": {"input": true}}', "moderation", "unsupported_parameter"),
        (b'{"model": "sim-chat", "input": "hi", "access_programs": {}}', "access_programs", "unsupported_parameter"),
        (b'{"model": "sim-chat", "input": "hi", "image": {"detail": "low"}}', "image", "unsupported_parameter"),
        (b'{"model": "sim-chat", "input": "hi", "metadata": {"k": 3}}', "metadata.k", "invalid_value"),
        (b'{"model": "sim-chat", "input": [{"role": "wizard", "content": "x"}]}', "input[0].role", None),
        (b'{"model": "sim-chat", "input": [{"role": "user", "content": 7}]}', "input[0].content", None),
        (b'{"model": "sim-chat", "input": [{"type": "computer_call_output", "call_id": "c"}]}', "input[0].type", "unsupported_item_type"),
        (b'{"model": "sim-chat", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]}', "input[0].content[0].type", "unsupported_content_type"),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "hologram"}]}', "tools[0].type", "unsupported_tool_type"),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "custom", "name": "c", "format": {"type": "grammar"}}]}', "tools[0].format",
         "unsupported_parameter"),
        (b'{"model": "sim-chat", "input": "hi", "tool_choice": {"type": "function", "name": "nope"}}', "tool_choice.name", None),
        (b'{"model": "sim-chat", "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}', "input", "tool_call_not_found"),
        (b'{"model": "sim-chat", "input": [{"type": "item_reference", "id": "msg_nope"}]}', "input[0].id", "item_not_found"),
        (b'{"model": "sim-chat", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}',
         "input[0].content[0].file_id", "unsupported_parameter"),
        (b'{"model": "sim-chat", "input": "hi", "include": ["everything"]}', "include[0]", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "text": {"format": {"type": "yaml"}}}', "text.format.type", None),
        (b'{"model": "sim-chat", "input": "hi", "text": {"format": {"type": "json_schema"}}}', "text.format.schema", None),
        (b'{"model": "sim-chat", "input": "hi", "background": true, "store": false}', "store", None),
        (b'{"model": "sim-chat", "input": "hi", "conversation": 5}', "conversation", None),
        (b'{"model": "sim-chat", "input": []}', "input", "empty_input"),
        (b'{"model": "sim-chat", "input": "hi", "stream": "yes"}', "stream", "invalid_value"),
        (b'{"model": "sim-chat", "input": [{"role": "user", "id": "msg_1", "content": "a"}, '
         b'{"role": "user", "id": "msg_1", "content": "b"}]}', "input[1].id", "duplicate_item"),
        (b'{"model": "sim-chat", "input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}, '
         b'{"role": "user", "content": "and now?"}]}', "input", "tool_output_not_found"),
        # Shapes that once reached code expecting another type (a 500), and enums taken as they came:
        (b'{"model": "sim-chat", "input": "hi", "max_output_tokens": 18446744073709551616}', "max_output_tokens", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "function", "name": "f", '
         b'"parameters": {"type": "object", "maximum": 100000000000000000000}}]}', "tools[0].parameters.maximum", "invalid_value"),
        (b'{"model": "sim-chat", "input": [{"type": [], "role": "user", "content": "hi"}]}', "input[0].type", "unsupported_item_type"),
        (b'{"model": "sim-chat", "input": [{"role": "user", "content": [{"type": "input_image", '
         b'"image_url": "https://x/y.png", "detail": 5}]}]}', "input[0].content[0].detail", None),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": {}, "name": "f"}]}', "tools[0].type", None),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": "x"}]}', "tools[0].tools", None),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "custom", "name": "c", "format": "x"}]}', "tools[0].format", None),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "function", "name": "f", "description": 5}]}', "tools[0].description", None),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "mcp", "server_label": "m", "require_approval": 5}]}',
         "tools[0].require_approval", None),
        (b'{"model": "sim-chat", "input": "hi", "tool_choice": {"type": []}}', "tool_choice.type", None),
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "function", "name": "f"}], '
         b'"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [5]}}', "tool_choice.tools", None),
        (b'{"model": "sim-chat", "input": "hi", "reasoning": {"effort": "ultra"}}', "reasoning.effort", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "reasoning": {"summary": 5}}', "reasoning.summary", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "text": {"verbosity": "extreme"}}', "text.verbosity", "invalid_value"),
        (b'{"model": "sim-chat", "input": "hi", "service_tier": "ultra"}', "service_tier", "invalid_value"),
        # Not JSON, though Python's json writes them (the SDK's default encoder does): they once reached the worker as null.
        (b'{"model": "sim-chat", "input": "hi", "tools": [{"type": "function", "name": "f", '
         b'"parameters": {"type": "object", "default": NaN}}]}', None, "invalid_json"),
        (b'{"model": "sim-chat", "input": [{"type": "mcp_call", "server_label": "m", "name": "n", "arguments": "{}", '
         b'"output": "x", "score": -Infinity}]}', None, "invalid_json"),
        (b'{"model": "sim-chat", "input": "hi", "temperature": Infinity}', None, "invalid_json"),
    ],
)
def test_malformed_bodies(http: httpx.Client, body: bytes, param: str | None, code: str | None) -> None:
    before = http.get("/health").json()
    resp = http.post("/v1/responses", content=body, headers={"content-type": "application/json"})
    assert_error(resp, 400, code=code, param=param)
    assert http.get("/health").json()["pools"][0]["healthy_workers"] == before["pools"][0]["healthy_workers"]


WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_a_chain_refuses_unanswered_calls_and_repeated_items(client: openai.OpenAI, router: RouterProcess) -> None:
    """As OpenAI does: a call of the previous response left without its output, or an item of the chain
    sent again, is a 400 naming it; nothing is stored for the refused turn, and the chain goes on."""
    asked = client.responses.create(model=MODEL, input="weather? [sim:call=get_weather]", tools=[WEATHER])
    call = asked.output[0]
    assert call.type == "function_call"
    before = stored_statuses(router)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="never mind", tools=[WEATHER], previous_response_id=asked.id)
    assert err.value.body["code"] == "tool_output_not_found" and err.value.body["param"] == "input"
    assert call.call_id in err.value.body["message"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}
    with pytest.raises(openai.BadRequestError) as err:  # the call again, beside previous_response_id
        client.responses.create(model=MODEL, input=[call.model_dump(exclude_none=True), output], tools=[WEATHER],
                                previous_response_id=asked.id)
    assert err.value.body["code"] == "duplicate_item" and err.value.body["param"] == "input[0].id"
    assert stored_statuses(router) == before
    answered = client.responses.create(model=MODEL, input=[output], tools=[WEATHER], previous_response_id=asked.id)
    assert answered.status == "completed" and answered.output_text


def test_null_means_the_default(client: openai.OpenAI) -> None:
    """The SDK types store, stream, background and parallel_tool_calls Optional: None is sent as null."""
    response = client.responses.create(model=MODEL, input="hi [sim:tokens=2]", store=None, stream=None, background=None,
                                       parallel_tool_calls=None)
    assert response.status == "completed" and response.background is False and response.parallel_tool_calls is True
    assert client.responses.retrieve(response.id).id == response.id  # stored: null store is the default, true


def test_metadata_limits(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", metadata={f"k{i}": "v" for i in range(17)})
    assert err.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", metadata={"k": "v" * 513})


def test_unknown_model_and_previous_response(http: httpx.Client, client: openai.OpenAI) -> None:
    resp = http.post("/v1/responses", json={"model": "no-such-model", "input": "hi"})
    assert_error(resp, 404, code="model_not_found", param="model")
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"})
    assert_error(resp, 404, code="previous_response_not_found", param="previous_response_id")
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert err.value.body["code"] == "previous_response_not_found"


def test_unknown_ids_and_routes(http: httpx.Client) -> None:
    assert_error(http.get("/v1/responses/resp_missing"), 404, code="response_not_found")
    assert_error(http.delete("/v1/responses/resp_missing"), 404, code="response_not_found")
    assert_error(http.get("/v1/responses/resp_missing/input_items"), 404, code="response_not_found")
    assert_error(http.get("/v1/nothing-here"), 404, code="not_found")
    assert_error(http.put("/v1/responses"), 405, code="method_not_allowed")
    slashed = http.post("/v1/responses/", json={"model": MODEL, "input": "hi"})  # no redirect, no Location from Host
    assert_error(slashed, 404, code="not_found")
    assert "location" not in slashed.headers


def test_conversation_items_are_checked_before_they_are_stored(http: httpx.Client, client: openai.OpenAI) -> None:
    """An output answering no call, an integer JSON cannot hold, an update without metadata: 400s,
    and the conversation keeps its items and metadata (each of these once got in, or wiped it)."""
    conv = client.conversations.create(items=[{"role": "user", "content": "first"}], metadata={"keep": "me"})
    orphan = {"type": "function_call_output", "call_id": "call_none", "output": "x"}
    assert_error(http.post("/v1/conversations", json={"items": [orphan]}), 400, code="tool_call_not_found",
                 param="items[0].call_id")
    assert_error(http.post(f"/v1/conversations/{conv.id}/items", json={"items": [orphan]}), 400,
                 code="tool_call_not_found", param="items[0].call_id")
    assert_error(http.post(f"/v1/conversations/{conv.id}/items", json={"items": [{"type": "mcp_call", "server_label": "m",
                 "name": "n", "arguments": "{}", "output": 2**70}]}), 400, code="invalid_value", param="items[0].output")
    assert_error(http.post(f"/v1/conversations/{conv.id}", json={}), 400, code="missing_required_parameter", param="metadata")
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    added = http.post(f"/v1/conversations/{conv.id}/items", json={"items": [call]})
    assert added.status_code == 200, added.text
    answered = http.post(f"/v1/conversations/{conv.id}/items", json={"items": [{**orphan, "call_id": "call_1"}]})
    assert answered.status_code == 200, answered.text  # it answers a call the conversation has
    assert client.conversations.retrieve(conv.id).metadata == {"keep": "me"}
    kinds = [i.type for i in client.conversations.items.list(conv.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_input_items_bad_query(http: httpx.Client, client: openai.OpenAI) -> None:
    rid = client.responses.create(model=MODEL, input="page me").id
    assert_error(http.get(f"/v1/responses/{rid}/input_items", params={"limit": 0}), 400, param="limit")
    assert_error(http.get(f"/v1/responses/{rid}/input_items", params={"limit": "lots"}), 400, param="limit")
    assert_error(http.get(f"/v1/responses/{rid}/input_items", params={"order": "up"}), 400, param="order")
    assert_error(http.get(f"/v1/responses/{rid}/input_items", params={"after": "msg_nope"}), 400, param="after")


def test_oversized_body(http: httpx.Client, strict: RouterProcess) -> None:
    big = b'{"model": "sim-chat", "input": "' + b"x" * 70_000 + b'"}'
    with httpx.Client(base_url=strict.base_url, headers={"authorization": f"Bearer {KEY_A}"}) as c:
        assert_error(c.post("/v1/responses", content=big), 413, code="request_too_large")
        # Without a Content-Length (chunked), the limit holds while reading.
        chunks = (big[i : i + 8192] for i in range(0, len(big), 8192))
        assert_error(c.post("/v1/responses", content=chunks), 413, code="request_too_large")
        ok = c.post("/v1/responses", json={"model": MODEL, "input": "small"})
        assert ok.status_code == 200, ok.text
    # urllib sends "Connection: close": the 413 must still arrive, not a reset while it sends
    # (the body is far larger than the sockets' buffers).
    huge = b'{"model": "sim-chat", "input": "' + b"x" * (8 << 20) + b'"}'
    request = urllib.request.Request(strict.base_url + "/v1/responses", data=huge, headers={
        "content-type": "application/json", "authorization": f"Bearer {KEY_A}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["code"] == "request_too_large"


# -- broken workers ----------------------------------------------------------


def test_worker_error_status(http: httpx.Client, client: openai.OpenAI, router: RouterProcess) -> None:
    anchor = client.responses.create(model=MODEL, input="before the failure")
    for stream in (False, True):
        resp = http.post("/v1/responses", json={"model": MODEL, "input": "fail [sim:status=500]", "stream": stream})
        error = assert_error(resp, 502, code="upstream_error")
        assert "500" in error["message"]
    failed = [rid for rid, status in stored_statuses(router).items() if status == "failed"]
    assert failed, "the failed response was not stored as failed"
    # Nothing else was disturbed: the earlier response and its chain still work.
    assert client.responses.retrieve(anchor.id).status == "completed"
    follow = client.responses.create(model=MODEL, input="after the failure", previous_response_id=anchor.id)
    assert follow.status == "completed"


def test_worker_rejects_request(http: httpx.Client) -> None:
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "bad [sim:status=400]"})
    assert_error(resp, 400, code="upstream_rejected")


def test_worker_drops_the_stream(client: openai.OpenAI, router: RouterProcess) -> None:
    events = [e.model_dump() for e in client.responses.create(model=MODEL, input="drop [sim:drop_after=3] [sim:tokens=20]", stream=True)]
    final = check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "upstream_stream_broken"
    # The Response's error has a code of OpenAI's closed set; the error event says precisely what broke.
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert final["error"]["message"] == events[-2]["message"]
    metrics = httpx.get(router.base_url + "/metrics").text  # the metrics count what broke, precisely
    assert any(line.startswith("responses_router_errors_total{") and 'kind="upstream_stream_broken"' in line
               for line in metrics.splitlines())
    stored = client.responses.retrieve(final["id"])
    assert stored.status == "failed"
    assert stored.output[0].status == "incomplete"
    assert len(stored.output_text.split()) == 3  # what was produced before the break is kept
    # The worker that dropped is still usable; the next request is served.
    assert client.responses.create(model=MODEL, input="after a drop").status == "completed"


def test_worker_drops_a_non_streamed_answer(http: httpx.Client) -> None:
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "drop [sim:drop_after=0]"})
    assert_error(resp, 502, code="upstream_error")


def test_no_healthy_worker(strict: RouterProcess) -> None:
    with httpx.Client(base_url=strict.base_url, headers={"authorization": f"Bearer {KEY_A}"}) as c:
        for stream in (False, True):
            resp = c.post("/v1/responses", json={"model": "dead-model", "input": "hi", "stream": stream})
            assert_error(resp, 503, code="no_healthy_worker")
        health = c.get("/health")
        assert health.status_code == 503
        dead = next(p for p in health.json()["pools"] if p["name"] == "dead")
        assert dead["status"] == "down" and dead["workers"][0]["last_error"]
        assert c.post("/v1/responses", json={"model": MODEL, "input": "still fine"}).status_code == 200
    assert "failed" in stored_statuses(strict).values()


# -- keys and isolation ------------------------------------------------------


def test_api_keys(strict: RouterProcess) -> None:
    with httpx.Client(base_url=strict.base_url) as c:
        assert_error(c.post("/v1/responses", json={"model": MODEL, "input": "hi"}), 401, code="missing_api_key")
        bad = {"authorization": "Bearer sk-wrong-key-000000"}
        assert_error(c.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bad), 401, code="invalid_api_key")
        assert_error(c.get("/v1/models", headers=bad), 401)
    a = openai.OpenAI(base_url=strict.base_url + "/v1", api_key=KEY_A, max_retries=0)
    b = openai.OpenAI(base_url=strict.base_url + "/v1", api_key=KEY_B, max_retries=0)
    mine = a.responses.create(model=MODEL, input="private to a")
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError) as err:
        b.responses.create(model=MODEL, input="steal", previous_response_id=mine.id)
    assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(mine.id)
    assert a.responses.retrieve(mine.id).output_text == mine.output_text  # b's attempts changed nothing
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.base_url + "/v1", api_key="sk-nobody-000000", max_retries=0).models.list()
    for key in (KEY_C, KEY_D):  # hashed and env-var keys work like plain ones, each its own owner
        other = openai.OpenAI(base_url=strict.base_url + "/v1", api_key=key, max_retries=0)
        assert other.responses.create(model=MODEL, input="hi").status == "completed"
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(mine.id)


# -- load ----------------------------------------------------------------------


def test_concurrent_requests_all_complete(client: openai.OpenAI) -> None:
    def one(i: int) -> str:
        if i % 2:
            return client.responses.create(model=MODEL, input=f"parallel {i}").status
        with client.responses.stream(model=MODEL, input=f"parallel {i}") as stream:
            return stream.get_final_response().status

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(48)))
    assert statuses == ["completed"] * 48


def test_words_that_look_like_json_constants_are_only_words(client: openai.OpenAI) -> None:
    """The NaN check reads values, not text: an input saying NaN and Infinity is answered."""
    made = client.responses.create(model=MODEL, input='NaN, "Infinity" and beyond')
    assert made.status == "completed"
    assert client.responses.input_items.list(made.id).data[0].content[0].text == 'NaN, "Infinity" and beyond'
