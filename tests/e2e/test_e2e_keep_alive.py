"""Kept-alive connections through a real router process: the router keeps an idle connection
longer than clients keep theirs, and says how long in ``Keep-Alive: timeout=N``.

httpx, and with it the openai SDK, reuses an idle connection for 5 s. A router that closed its
idle connections after 5 s too would close some just as a client sent a request on one, and
that request would get no answer."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

CONFIG = sim_pool_toml(replicas=1) + """
[[models]]
name = "m"
pool = "sim"
"""
CLIENT_EXPIRY_S = httpx.Limits().keepalive_expiry  # what the openai SDK keeps too: 5 s


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    proc = start_router(tmp_path_factory.mktemp("keep-alive"), CONFIG)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _get(conn: socket.socket, path: str = "/health") -> bytes:
    """One request on ``conn``; its answer's head (the body of /health is small and read whole)."""
    conn.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"closed with no answer after {data!r}"
        data += chunk
    return data


def test_every_answer_says_how_long_an_idle_connection_is_kept(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0)
    created = client.responses.with_raw_response.create(model="m", input="hi")
    with client.responses.with_streaming_response.create(model="m", input="hi", stream=True) as streamed:
        streamed.read()
    heads = [created.headers, streamed.headers, httpx.get(router.base_url + "/v1/models").headers]
    timeouts = {head.get("keep-alive") for head in heads}
    assert timeouts == {"timeout=75"}, timeouts
    assert 75 > CLIENT_EXPIRY_S


def test_a_connection_idle_past_the_clients_expiry_still_answers(router: RouterProcess) -> None:
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as conn:
        assert _get(conn).startswith(b"HTTP/1.1 200")
        time.sleep(CLIENT_EXPIRY_S + 1)  # the idle time itself is what is tested
        assert _get(conn).startswith(b"HTTP/1.1 200")


def test_keep_alive_s_closes_an_idle_connection_and_is_said(tmp_path: Path) -> None:
    proc = start_router(tmp_path, CONFIG, server="keep_alive_s = 1\n")
    try:
        with socket.create_connection(("127.0.0.1", proc.port), timeout=30) as conn:
            head = _get(conn)
            assert b"\r\nkeep-alive: timeout=1\r\n" in head, head
            while conn.recv(65536):  # the rest of the body, then the router's close (a timeout raises)
                pass
    finally:
        assert proc.stop() == 0
