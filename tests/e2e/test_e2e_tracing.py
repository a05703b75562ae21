"""OpenTelemetry traces through a real router process: the spans of a request nest under the
client's traceparent and reach an OTLP/HTTP collector, and the worker receives the trace context
of its worker-call span and the request's x-request-id."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from harness import RouterProcess, start_router
from tests.e2e.trace_fixtures import Collector, HeaderProxy
from tests.support.fake_search import FakeSearch
from tests.support.sim_proc import Sim

pytestmark = pytest.mark.e2e

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced() -> Iterator[dict[str, Any]]:
    sim = Sim()
    proxy = HeaderProxy(f"http://127.0.0.1:{sim.port}").start()
    collector = Collector().start()
    search = FakeSearch().start()
    try:
        yield {"proxy": proxy, "collector": collector, "search": search}
    finally:
        search.stop()
        collector.stop()
        proxy.stop()
        sim.stop()


@pytest.fixture(scope="module")
def router(traced: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    body = f"""
[telemetry]
otlp_endpoint = "{traced['collector'].url}"
service_name = "router-under-test"

[[pools]]
name = "sim"
engine = "sim"
model = "sim-model"
urls = ["{traced['proxy'].url}"]

[[models]]
name = "m"
pool = "sim"

[tools.web_search]
url = "{traced['search'].search_url}"
"""
    proc = start_router(tmp_path_factory.mktemp("tracing"), body)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def spans_of(collector: Collector, trace_id: str, names: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The trace's spans by name, once every one of ``names`` has arrived."""
    deadline = time.monotonic() + 15
    while True:
        found: dict[str, list[dict[str, Any]]] = {}
        for span in collector.spans:
            if span["trace_id"] == trace_id:
                found.setdefault(span["name"], []).append(span)
        if names <= set(found) or time.monotonic() > deadline:
            assert names <= set(found), (sorted(found), names)
            return found
        time.sleep(0.1)


def test_a_response_is_one_trace_under_the_clients_span(router: RouterProcess, traced: dict[str, Any]) -> None:
    proxy, collector = traced["proxy"], traced["collector"]
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0,
                           default_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    raw = client.responses.with_raw_response.create(model="m", input="look up fish [sim:call=web_search]",
                                                    tools=[{"type": "web_search"}])
    response = raw.parse()
    assert [item.type for item in response.output] == ["web_search_call", "message"]
    spans = spans_of(collector, CLIENT_TRACE, {"POST /v1/responses", "prepare", "route", "worker call", "tool call", "persist"})

    (root,) = spans["POST /v1/responses"]
    assert root["parent_id"] == CLIENT_SPAN and root["service"] == "router-under-test"
    assert root["attributes"]["http.response.status_code"] == 200
    assert root["attributes"]["router.request_id"] == raw.headers["x-request-id"]
    assert root["attributes"]["router.response_id"] == response.id and root["attributes"]["router.pool"] == "sim"
    (prepare,) = spans["prepare"]
    (route,) = spans["route"]
    assert prepare["parent_id"] == root["span_id"] and route["parent_id"] == prepare["span_id"]
    assert route["attributes"]["router.arm"] == "sim"
    calls = spans["worker call"]
    assert len(calls) == 2  # the turn that calls the tool, and the one that answers with its result
    assert all(c["parent_id"] == root["span_id"] and c["attributes"]["router.worker"] == proxy.url for c in calls)
    (tool,) = spans["tool call"]
    assert tool["parent_id"] == root["span_id"] and tool["attributes"]["router.tool"] == "web_search"
    assert all(p["parent_id"] == root["span_id"] for p in spans["persist"])

    # The worker heard each call's own span as its parent, and the request's id.
    sent = [headers for path, headers in proxy.seen if path == "/v1/chat/completions"][-2:]
    assert [h["traceparent"] for h in sent] == [f"00-{CLIENT_TRACE}-{c['span_id']}-01" for c in calls]
    assert {h["x-request-id"] for h in sent} == {raw.headers["x-request-id"]}


def test_a_stream_and_the_passthrough_are_traced_too(router: RouterProcess, traced: dict[str, Any]) -> None:
    proxy, collector = traced["proxy"], traced["collector"]
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    with httpx.stream("POST", router.base_url + "/v1/responses", headers=headers, timeout=30,
                      json={"model": "m", "input": "stream [sim:tokens=20]", "stream": True}) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        body = "".join(resp.iter_text())
    assert "response.completed" in body
    spans = spans_of(collector, trace_id, {"POST /v1/responses", "worker call", "persist"})
    (call,) = spans["worker call"]
    (root,) = spans["POST /v1/responses"]
    assert call["parent_id"] == root["span_id"] and root["attributes"]["router.request_id"] == request_id
    (seen,) = [h for _, h in proxy.seen if h.get("x-request-id") == request_id]
    assert seen["traceparent"] == f"00-{trace_id}-{call['span_id']}-01"

    chat = httpx.post(router.base_url + "/v1/chat/completions", headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert chat.status_code == 200
    (relayed,) = [h for _, h in proxy.seen if h.get("x-request-id") == chat.headers["x-request-id"]]
    spans = spans_of(collector, trace_id, {"POST /v1/chat/completions"})
    (passthrough,) = spans["POST /v1/chat/completions"]
    assert passthrough["parent_id"] == "1" * 16 and passthrough["attributes"]["http.response.status_code"] == 200
    (relay,) = [s for s in spans["worker call"] if s["parent_id"] == passthrough["span_id"]]
    assert relayed["traceparent"] == f"00-{trace_id}-{relay['span_id']}-01"


def test_without_an_endpoint_workers_still_get_the_request_id(tmp_path: Any, traced: dict[str, Any]) -> None:
    proxy = traced["proxy"]
    body = f'[[pools]]\nname = "sim"\nengine = "sim"\nmodel = "sim-model"\nurls = ["{proxy.url}"]\n[[models]]\nname = "m"\npool = "sim"\n'
    proc = start_router(tmp_path, body)
    try:
        resp = httpx.post(proc.base_url + "/v1/responses", json={"model": "m", "input": "hi"},
                          headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, timeout=30)
        assert resp.status_code == 200
        (seen,) = [h for _, h in proxy.seen if h.get("x-request-id") == resp.headers["x-request-id"]]
        assert "traceparent" not in seen  # no tracing here: nothing to continue
    finally:
        assert proc.stop() == 0


def test_a_clients_request_id_is_the_worker_requests_id(tmp_path: Any) -> None:
    """vLLM takes a request's id from X-Request-Id before its body's ``request_id``: a client's
    ``request_id`` (an engine option) is sent in both, so the engine uses it; the router's own id
    stays the answer's. One that cannot be a header value is a 400 naming it."""
    sim = Sim("--engine", "vllm")
    proxy = HeaderProxy(f"http://127.0.0.1:{sim.port}").start()
    body = f'[[pools]]\nname = "vl"\nengine = "vllm"\nmodel = "sim-model"\nurls = ["{proxy.url}"]\n[[models]]\nname = "m"\npool = "vl"\n'
    proc = start_router(tmp_path, body)
    try:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)

        def last_sent() -> dict[str, str]:
            return [headers for path, headers in proxy.seen if path == "/v1/chat/completions"][-1]

        made = client.responses.with_raw_response.create(model="m", input="hi", extra_body={"request_id": "client-id-7"})
        assert made.parse().status == "completed"
        assert last_sent()["x-request-id"] == "client-id-7"
        assert made.headers["x-request-id"].startswith("req_")  # the router's own, on its answer
        streamed = client.responses.create(model="m", input="hi", stream=True, extra_body={"request_id": "client-id-8"})
        assert [e.type for e in streamed][-1] == "response.completed"
        assert last_sent()["x-request-id"] == "client-id-8"
        plain = client.responses.with_raw_response.create(model="m", input="hi")
        assert last_sent()["x-request-id"] == plain.headers["x-request-id"]  # without one: the router's
        for bad in ("two words", "line\r\nx-evil: 1", "caf\u00e9"):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model="m", input="hi", extra_body={"request_id": bad})
            assert caught.value.body["param"] == "request_id" and caught.value.body["code"] == "invalid_value"  # type: ignore[index]
        assert last_sent()["x-request-id"] == plain.headers["x-request-id"]  # nothing more was sent
    finally:
        assert proc.stop() == 0
        proxy.stop()
        sim.stop()
