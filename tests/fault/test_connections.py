"""Clients that never finish their requests, against a real router process.

A stalled connection (half a request line, half the headers, half a body, a
header line dripped every half second) is closed by its deadline with 408,
while everyone else is served; past the cap on open connections the one that
waited longest for its client makes room, and with every connection busy a new
one gets a clear 503. The router runs with few file descriptors in one test, so
stalled connections that were never closed would exhaust them (accept fails and
nobody is served): the cap must hold below them.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"
BODY = json.dumps({"model": MODEL, "input": "hello"}).encode()


def _pool() -> str:
    return sim_pool_toml(model=MODEL, replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'


def _connect(router: RouterProcess, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
    if first:
        sock.sendall(first)
    return sock


STALLS = {
    "silent": b"",
    "half a request line": b"POST /v1/resp",
    "half the headers": b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Ty",
    "half a hot body": b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10],
    "half another body": b"POST /v1/conversations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"items\"",
}


def _closed_by_router(socks: dict[socket.socket, str], within_s: float) -> dict[str, list[bytes]]:
    """Read every socket to its end (the router's close); what each kind got. Fails on any left open."""
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        got[sock] = b""
    deadline = time.monotonic() + within_s
    open_ = set(socks)
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            sock = key.fileobj
            try:
                data = sock.recv(65536)  # type: ignore[union-attr]
            except ConnectionResetError:
                data = b""
            if data:
                got[sock] += data  # type: ignore[index]
                continue
            sel.unregister(sock)
            open_.discard(sock)  # type: ignore[arg-type]
    sel.close()
    assert not open_, f"{len(open_)} of {len(socks)} stalled connections still open after {within_s} s: " \
                      f"{sorted({socks[s] for s in open_})}"
    by_kind: dict[str, list[bytes]] = {}
    for sock, data in got.items():
        by_kind.setdefault(socks[sock], []).append(data)
    return by_kind


def _drip(router: RouterProcess, stop: threading.Event, result: dict[str, object]) -> None:
    """A head that never ends: one header line every half second, until the router closes it."""
    sock = _connect(router, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    sock.settimeout(0.5)
    answer = b""
    try:
        for i in range(200):
            if stop.is_set():
                return
            try:
                sock.sendall(b"X-Drip-%d: y\r\n" % i)
            except OSError:
                break
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            answer += data
        result["closed"] = True
        result["answer"] = answer
    finally:
        sock.close()


@pytest.fixture
def stalled_router(tmp_path: Path) -> Iterator[RouterProcess]:
    router = start_router(tmp_path, _pool(), server="header_timeout_s = 2\nbody_timeout_s = 3\n")
    yield router
    router.stop()


def test_stalled_connections_are_closed_by_their_deadlines(stalled_router: RouterProcess) -> None:
    router = stalled_router
    socks: dict[socket.socket, str] = {}
    stop = threading.Event()
    drip: dict[str, object] = {}
    dripper = threading.Thread(target=_drip, args=(router, stop, drip), daemon=True)
    try:
        dripper.start()
        for _ in range(400):  # 2,000 stalled connections in all
            for kind, first in STALLS.items():
                socks[_connect(router, first)] = kind
        # Everyone else is served meanwhile, over new connections.
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
        assert client.responses.create(model=MODEL, input="still there?").status == "completed"
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")

        by_kind = _closed_by_router(socks, within_s=30)
        for kind, answers in by_kind.items():
            for data in answers:
                assert data.startswith(b"HTTP/1.1 408 "), (kind, data[:200])
                body = json.loads(data.split(b"\r\n\r\n", 1)[1])
                assert body["error"]["code"] == "request_timeout", (kind, body)
                assert ("body" if "body" in kind else "head") in body["error"]["message"]
        dripper.join(timeout=30)
        assert drip.get("closed") is True, "the dripped head was never cut off"
        assert bytes(drip["answer"]).startswith(b"HTTP/1.1 408 ")  # type: ignore[arg-type]
    finally:
        stop.set()
        for sock in socks:
            sock.close()
    # The router still serves after the attack.
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
    assert client.responses.create(model=MODEL, input="and now?").status == "completed"


def test_a_request_in_time_is_not_cut(stalled_router: RouterProcess) -> None:
    """A body sent in pieces within the deadline is answered; an idle keep-alive connection serves a
    second request after a pause (the head's term starts with its first byte, not at the previous answer)."""
    router = stalled_router
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        head = b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        sock.sendall(head % len(BODY) + BODY[:5])
        time.sleep(1)  # a pause inside the body, within the deadline: the pause is what is tested
        sock.sendall(BODY[5:])
        first = _read_answer(sock)
        assert first.startswith(b"HTTP/1.1 200 "), first[:200]
        time.sleep(1.5)  # idle (the idle time is what is tested), under uvicorn's keep-alive (5 s), then a new request
        sock.sendall(head % len(BODY) + BODY)
        assert _read_answer(sock).startswith(b"HTTP/1.1 200 ")


def _read_answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest


def test_stalled_connections_cannot_exhaust_file_descriptors(tmp_path: Path) -> None:
    """256 descriptors: 600 stalled connections would take them all; the cap (96 here) makes
    each new connection push out the one that waited longest, and everyone is served."""
    router = start_router(tmp_path, _pool(), server="header_timeout_s = 60\n", nofile=256)
    socks: dict[socket.socket, str] = {}
    try:
        assert "at most 96 connections" in router.log()
        for _ in range(600):
            socks[_connect(router, STALLS["half the headers"])] = "half the headers"
        for _ in range(5):
            client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
            assert client.responses.create(model=MODEL, input="served?").status == "completed"
        # All but the newest (at most the cap) were closed to make room, each told why.
        sel = selectors.DefaultSelector()
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        deadline, closed, answers = time.monotonic() + 30, set(), []
        while len(closed) < 600 - 96 and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                sock = key.fileobj
                data = sock.recv(65536)  # type: ignore[union-attr]
                if data:
                    answers.append(data)
                else:
                    sel.unregister(sock)
                    closed.add(sock)
        sel.close()
        assert len(closed) >= 600 - 96, f"only {len(closed)} stalled connections were closed"
        assert answers and all(a.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in a for a in answers)
    finally:
        for sock in socks:
            sock.close()
        router.stop()


def test_past_the_cap_with_every_connection_busy_a_new_one_is_refused(tmp_path: Path) -> None:
    router = start_router(tmp_path, _pool(), server="max_connections = 3\n")
    streams: list[socket.socket] = []
    try:
        body = json.dumps({"model": MODEL, "input": "[sim:tokens=400] [sim:itl_ms=50]", "stream": True}).encode()
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
            sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")  # streaming: busy, not waiting for its client
            streams.append(sock)
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 503 "), data[:200]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for sock in streams:
            sock.close()
    # Once the streams are gone, the router serves again.
    deadline = time.monotonic() + 10
    while True:
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = sock.recv(65536)
        if data.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    router.stop()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
