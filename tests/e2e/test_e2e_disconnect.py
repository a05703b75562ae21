"""A client that leaves mid-stream: the worker's generation stops, and the router goes on serving."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from harness import RouterProcess
from tests.conftest import MODEL
from tests.support.waits import running_on_workers, tcp_connections, wait_until, worker_urls

pytestmark = pytest.mark.e2e


def _until_idle(router: RouterProcess, deadline_s: float = 15.0) -> int:
    """Polls the workers' own gauge until nothing runs (or the deadline); returns the last reading."""
    end = time.monotonic() + deadline_s
    running = running_on_workers(router)
    while running and time.monotonic() < end:
        time.sleep(0.05)
        running = running_on_workers(router)
    return running


def test_leaving_a_responses_stream_stops_the_worker(router: RouterProcess, client: openai.OpenAI) -> None:
    assert _until_idle(router) == 0
    stream = client.responses.create(model=MODEL, input="[sim:tokens=20000] [sim:itl_ms=2]", stream=True)
    deltas = 0
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas += 1
            if deltas == 5:
                break
    assert deltas == 5 and running_on_workers(router) == 1
    stream.close()
    assert _until_idle(router) == 0
    after = client.responses.create(model=MODEL, input="[sim:tokens=3] still here")
    assert after.status == "completed" and len(after.output_text.split()) == 3


def test_a_stream_its_client_leaves_is_stored_as_cancelled_with_what_it_had(
        router: RouterProcess, client: openai.OpenAI) -> None:
    """The client saw the id in response.created: retrieving it, or chaining on it, is not a 404.
    The partial answer is kept (its message ``incomplete``); a conversation gets nothing of it."""
    conversation = client.conversations.create()
    for conv in (None, conversation.id):
        extra = {"conversation": conv} if conv else {}
        stream = client.responses.create(model=MODEL, input="[sim:tokens=20000] [sim:itl_ms=2]", stream=True, **extra)
        rid, seen = None, ""
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
            elif event.type == "response.output_text.delta":
                seen += event.delta
                if len(seen.split()) >= 5:
                    break
        stream.close()
        assert rid is not None
        stored = _settled(client, rid)  # the router stores it once it sees the client gone
        assert stored is not None and stored.status == "cancelled", stored
        message = stored.output[0]
        assert message.type == "message" and message.status == "incomplete"
        assert stored.output_text.startswith(seen) and len(stored.output_text) >= len(seen)
        items = client.responses.input_items.list(rid)
        assert [i.type for i in items.data] == ["message"]
        if conv is None:
            after = client.responses.create(model=MODEL, input="[sim:tokens=2] go on", previous_response_id=rid)
            assert after.status == "completed" and after.previous_response_id == rid
        else:
            assert client.conversations.items.list(conv).data == []
    assert _until_idle(router) == 0


def _settled(client: openai.OpenAI, rid: str, deadline_s: float = 15.0) -> Any:
    """The stored response once it exists and is no longer in progress (None at the deadline)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            stored = client.responses.retrieve(rid)
        except openai.NotFoundError:
            stored = None
        if stored is not None and stored.status != "in_progress":
            return stored
        time.sleep(0.05)
    return None


def test_leaving_a_passthrough_stream_stops_the_worker(router: RouterProcess) -> None:
    assert _until_idle(router) == 0
    body = {"model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "[sim:tokens=20000] [sim:itl_ms=2]"}]}
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()  # held: closing this generator would close the connection
            frames = 0
            while frames < 5:
                frames += next(lines).startswith("data: {")
            assert running_on_workers(router) == 1
        assert _until_idle(router) == 0
        done = http.post("/v1/chat/completions", json={**body, "stream": False,
                                                        "messages": [{"role": "user", "content": "[sim:tokens=2] hi"}]})
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "stop"


def test_a_slow_reader_gets_the_whole_stream(router: RouterProcess) -> None:
    """Past the socket's high-water mark, chunks wait for the client instead of piling up; nothing is lost."""
    body = {"model": MODEL, "stream": True, "input": "[sim:tokens=3000] [sim:itl_ms=0]"}
    with httpx.Client(base_url=router.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            raw = b""
            for i, chunk in enumerate(resp.iter_raw(4096)):
                raw += chunk
                if i < 40:
                    time.sleep(0.02)  # the router's writes back up meanwhile
    _assert_whole_stream(raw, words=3000)


def test_a_reader_that_stops_reading_holds_up_the_worker_and_loses_nothing(router: RouterProcess) -> None:
    """A small receive window and no reads for a while: the router's socket backs up, its direct
    writes refuse, the worker's stream is paused, and the events then leave in order, all of them."""
    # 4,000 tokens with 20 top logprobs each: ~8 MB of events, more than the socket buffers hold
    body = json.dumps({"model": MODEL, "stream": True, "input": "[sim:tokens=4000] [sim:itl_ms=0]", "top_logprobs": 20,
                       "include": ["message.output_text.logprobs"]}).encode()
    host, port = router.base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_until(lambda: _backed_up(router, sock), 30, "the router's writes backed up and its worker's stream paused")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # a 4 KB window would crawl (ack delays)
    raw = b""
    sock.settimeout(60)
    while chunk := sock.recv(1 << 16):
        raw += chunk
    sock.close()
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    _assert_whole_stream(_dechunk(chunked), words=4000)


def _backed_up(router: RouterProcess, client: socket.socket) -> bool:
    """The router holds bytes for ``client`` that it cannot send (the window is full), and it has
    stopped reading its worker: bytes wait, unread, on its connection to a worker (the kernel's queues)."""
    ours = client.getsockname()[1]
    workers = {int(url.rsplit(":", 1)[1]) for url in worker_urls(router)}
    connections = tcp_connections()
    to_client = any(local == router.port and remote == ours and tx for local, remote, tx, _ in connections)
    from_worker = any(remote in workers and rx for _, remote, _, rx in connections)
    return to_client and from_worker


def _assert_whole_stream(raw: bytes, *, words: int) -> None:
    """Every event, in sequence, ending completed with all the text its deltas carried."""
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames[:-1]]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]
    assert final["type"] == "response.completed"
    assert text == final["response"]["output"][0]["content"][0]["text"] and len(text.split()) == words


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out += data[:size]
        data = data[size + 2:]
