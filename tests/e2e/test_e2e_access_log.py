"""The access log through a real router process: one line per request (and per WebSocket
``response.create``), as text or as JSON lines, naming what served it and never a key or a body."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

KEY = "sk-access-log-test-key-1"
SECRET = "PLUM-ORCHARD-7"  # in every request body: it must never reach the log
CONFIG = sim_pool_toml(replicas=1) + f"""
[auth]
keys = [{{name = "team-a", key = "{KEY}"}}]

[[models]]
name = "m"
pool = "sim"
"""


@pytest.fixture(scope="module", params=["text", "json"])
def router(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    fmt = request.param
    proc = start_router(tmp_path_factory.mktemp(f"access-{fmt}"), CONFIG, server=f'log_format = "{fmt}"\n')
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def access_lines(router: RouterProcess) -> list[dict[str, Any]]:
    """The access lines so far, as field dicts, whichever format the router writes."""
    out = []
    for line in router.log().splitlines():
        if router.log_path.parent.name.startswith("access-json"):
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record["logger"] == "router.access":
                out.append(record)
        elif " INFO router.access: " in line:
            rest = line.partition(" INFO router.access: ")[2]
            method, path, status, *pairs = (_unquote(token) for token in TOKEN.findall(rest))
            fields: dict[str, Any] = {"method": method, "path": path, "status": int(status)}
            fields.update(pair.split("=", 1) for pair in pairs)
            out.append(fields)
    return out


# A text line's token: bare, or a name= whose value is quoted as a JSON string (anything not plain ASCII).
TOKEN = re.compile(r'(?:[a-z_]+=)?"(?:[^"\\]|\\.)*"|\S+')


def _unquote(token: str) -> str:
    name, eq, value = token.partition("=") if not token.startswith('"') else ("", "", token)
    if value.startswith('"'):
        return name + eq + json.loads(value)
    return token


def line_for(router: RouterProcess, request_id: str) -> dict[str, Any]:
    """The one access line of ``request_id`` (written as its answer ended: waited for, briefly)."""
    deadline = time.monotonic() + 10
    while True:
        found = [f for f in access_lines(router) if f["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, (request_id, found, router.log()[-3000:])
            return found[0]
        time.sleep(0.05)


def test_each_request_has_one_line_naming_what_served_it(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY, max_retries=0)
    created = client.responses.with_raw_response.create(model="m", input=f"say hi {SECRET}")
    response = created.parse()
    line = line_for(router, created.headers["x-request-id"])
    assert line["method"] == "POST" and line["path"] == "/v1/responses" and int(line["status"]) == 200
    assert line["key"] == "team-a" and line["model"] == "m" and line["pool"] == "sim"
    assert line["worker"].startswith("http://127.0.0.1:") and line["response_id"] == response.id
    assert int(line["input_tokens"]) == response.usage.input_tokens and int(line["output_tokens"]) == response.usage.output_tokens
    assert float(line["ttfb_ms"]) <= float(line["duration_ms"]) and "error" not in line

    with client.responses.with_streaming_response.create(model="m", input=f"stream {SECRET}", stream=True) as streamed:
        request_id = streamed.headers["x-request-id"]
        events = [json.loads(raw[6:]) for raw in streamed.iter_lines() if raw.startswith("data: {")]
    final = events[-1]["response"]
    line = line_for(router, request_id)
    assert int(line["status"]) == 200 and line["response_id"] == final["id"] and line["response_status"] == "completed"
    assert int(line["output_tokens"]) == final["usage"]["output_tokens"]

    chat = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": SECRET}])
    line = line_for(router, chat.headers["x-request-id"])
    assert line["path"] == "/v1/chat/completions" and int(line["status"]) == 200
    assert line["model"] == "m" and line["pool"] == "sim" and line["worker"].startswith("http://")
    # The passthrough names where it went as a Responses answer does.
    assert (chat.headers["x-router-pool"], chat.headers["x-router-arm"], chat.headers["x-router-worker"]) == (
        "sim", "sim", line["worker"])


def test_errors_carry_their_code_and_nothing_of_the_request(router: RouterProcess) -> None:
    http = httpx.Client(base_url=router.base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    cases = [
        # (answer, status, the model named, the error code (None: the body's), whether a key was checked)
        (http.post("/v1/responses", json={"model": "m", "input": SECRET, "temperature": 9}), 400, None, None, True),
        (http.post("/v1/responses", json={"model": "nope", "input": SECRET}), 404, "nope", "model_not_found", True),
        (http.post("/v1/responses", json={"model": "m", "input": SECRET},
                   headers={"authorization": "Bearer sk-wrong-key-123"}), 401, None, "invalid_api_key", False),
        (http.get("/v1/no-such-route"), 404, None, "not_found", False),  # no route: no key asked for
        (http.post("/v1/responses", content=b"{" + b" " * (9 * 1024 * 1024) + b"}"), 413, None, None, False),
    ]
    for resp, status, model, code, keyed in cases:
        assert resp.status_code == status, resp.text
        line = line_for(router, resp.headers["x-request-id"])
        assert int(line["status"]) == status
        assert line["error"] == (code or resp.json()["error"]["code"] or resp.json()["error"]["type"]), (line, resp.text)
        assert line.get("model") == model
        assert line.get("key") == ("team-a" if keyed else None)  # a refused key names no one
    log = router.log()
    assert SECRET not in log and KEY not in log and "sk-wrong-key-123" not in log


def test_a_websocket_response_create_has_its_own_line(router: RouterProcess) -> None:
    url = router.base_url.replace("http://", "ws://") + "/v1/responses"
    with connect(url, additional_headers={"authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": f"over ws {SECRET}"}))
        while True:
            event = json.loads(ws.recv(timeout=30))
            if event["type"] in ("response.completed", "error"):
                break
    assert event["type"] == "response.completed", event
    rid = event["response"]["id"]
    deadline = time.monotonic() + 10
    while not [f for f in access_lines(router) if f.get("response_id") == rid] and time.monotonic() < deadline:
        time.sleep(0.05)
    (line,) = [f for f in access_lines(router) if f.get("response_id") == rid]
    assert line["method"] == "WS" and line["path"] == "/v1/responses" and int(line["status"]) == 200
    assert line["key"] == "team-a" and line["model"] == "m" and line["pool"] == "sim"


def test_no_request_can_write_a_line_of_its_own(router: RouterProcess) -> None:
    """A newline, CR, ESC or NUL in the path (no key needed) or in the model name is escaped, not
    written: every character a client sent comes back out of its one line, and nothing else."""
    forged = "\n2026-01-01 00:00:00,000 INFO router.access: GET /admin 200 key=root"
    for raw, sent in (("/v1/x%0aFORGED%0d%1b[2J%00%7f%c2%85%e2%80%a8", "/v1/x\nFORGED\r\x1b[2J\x00\x7f\x85\u2028"),
                      ("/v1/%22quoted%22%20and%5cslash", '/v1/"quoted" and\\slash')):
        with socket.create_connection(("127.0.0.1", router.port), timeout=30) as conn:
            conn.sendall(f"GET {raw} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
            head = conn.makefile("rb").read().decode(errors="replace")
        request_id = re.search(r"(?im)^x-request-id: (\S+)", head)[1]  # type: ignore[index]
        line = line_for(router, request_id)
        assert line["path"] == sent and int(line["status"]) == 404, line
    http = httpx.Client(base_url=router.base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    resp = http.post("/v1/responses", json={"model": "m" + forged + "\x1b]0;owned\x07", "input": "hi"})
    assert resp.status_code == 404
    line = line_for(router, resp.headers["x-request-id"])
    assert line["model"] == "m" + forged + "\x1b]0;owned\x07" and line["key"] == "team-a"
    text = router.log()
    assert not any(c in text for c in "\r\x1b\x00\x07\x7f\x85\u2028"), "a control character reached the log"
    lines = text.splitlines()
    assert sum("FORGED" in line for line in lines) == 1 and sum("key=root" in line for line in lines) == 1
    assert not [line for line in lines if line.startswith("2026-01-01")]


def test_a_line_is_bounded_whatever_the_request(router: RouterProcess) -> None:
    """A 60 KB path (no key) or a 900 KB model name is cut to a bound on the line, with a marker
    that says how much was cut."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as conn:
        conn.sendall(f"GET /v1/{'p' * 60_000} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        head = conn.makefile("rb").read().decode(errors="replace")
    path_line = line_for(router, re.search(r"(?im)^x-request-id: (\S+)", head)[1])  # type: ignore[index]
    http = httpx.Client(base_url=router.base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    resp = http.post("/v1/responses", json={"model": "q" * 900_000, "input": "hi"})
    assert resp.status_code == 404
    model_line = line_for(router, resp.headers["x-request-id"])
    assert path_line["path"].startswith("/v1/ppp") and path_line["path"].endswith(f"...[{60_004 - 1024} more]")
    assert model_line["model"].startswith("qqq") and model_line["model"].endswith(f"...[{900_000 - 1024} more]")
    assert max(len(line) for line in router.log().splitlines()) < 4096


def test_every_line_is_in_the_chosen_format(router: RouterProcess) -> None:
    """json: every line the router writes is one object (uvicorn's own too); text: an access line
    is the method, path and status, then name=value pairs."""
    lines = router.log().splitlines()
    if router.log_path.parent.name.startswith("access-json"):
        assert lines and all(isinstance(json.loads(line), dict) for line in lines), lines[:5]
        assert {json.loads(line)["logger"] for line in lines} >= {"router", "router.access"}
        return
    access = [line for line in lines if " INFO router.access: " in line]
    quoted = r'"(?:[^"\\\x00-\x1f]|\\.)*"'
    pattern = re.compile(rf'^\S+ \S+ INFO router\.access: (GET|POST|WS) (/\S*|{quoted}) \d{{3}}( [a-z_]+=({quoted}|[^\s"]+))+$')
    assert access and all(pattern.match(line) for line in access), [line for line in access if not pattern.match(line)]


def test_the_access_log_can_be_turned_off(tmp_path: Path) -> None:
    proc = start_router(tmp_path, CONFIG, server="access_log = false\n")
    try:
        resp = httpx.post(proc.base_url + "/v1/responses", json={"model": "m", "input": "hi"},
                          headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        assert resp.status_code == 200
    finally:
        assert proc.stop() == 0  # the router's exit: an access line, had there been one, is written by then
    assert "router.access" not in proc.log() and "serving models" in proc.log()
