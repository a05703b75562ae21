"""Compressed request bodies: Content-Encoding gzip / deflate / zstd (what Codex CLI sends).

The limit on the body holds for the compressed and the decompressed size, and
decompression stops as soon as its output passes the limit; corrupt data is a
400 and an unknown coding a 415, both in the OpenAI error shape.
"""

from __future__ import annotations

import gzip
import os
import tracemalloc
import zlib

import httpx
import orjson
import pytest
import zstandard  # a runtime dependency
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from harness import RouterProcess
from router.api.http import content_encodings, decode_body, error_response, read_body
from router.protocol.errors import APIError
from tests.conftest import MODEL

LIMIT = 64 * 1024
BODY = orjson.dumps({"model": "m", "input": [{"role": "user", "content": "words " * 2000}]})


def zstd(data: bytes, **kw: object) -> bytes:
    return zstandard.ZstdCompressor(level=3, **kw).compress(data)


def zstd_streamed(data: bytes) -> bytes:
    """As Codex compresses (zstd::stream::encode_all): no content size in the frame header."""
    obj = zstandard.ZstdCompressor(level=3).compressobj()
    return obj.compress(data) + obj.flush()


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


ENCODED = {
    "gzip": gzip.compress(BODY),
    "x-gzip": gzip.compress(BODY),
    "deflate": zlib.compress(BODY),
    "zstd": zstd_streamed(BODY),
}


@pytest.fixture(scope="module")
def app() -> TestClient:
    """read_body behind a route, as the router's routes use it."""
    async def echo(request: Request) -> Response:
        try:
            body = await read_body(request, LIMIT)
        except APIError as exc:
            return error_response(exc)
        return Response(body, media_type="application/octet-stream")

    return TestClient(Starlette(routes=[Route("/echo", echo, methods=["POST"])]))


def assert_error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("encoding", sorted(ENCODED))
def test_each_coding_is_decompressed(app: TestClient, encoding: str) -> None:
    resp = app.post("/echo", content=ENCODED[encoding], headers={"content-encoding": encoding})
    assert resp.status_code == 200, resp.text
    assert resp.content == BODY


@pytest.mark.parametrize(("encoding", "data"), [
    ("deflate", raw_deflate(BODY)),  # deflate without the zlib wrapper, as some clients send it
    ("zstd", zstd(BODY)),  # a frame that states its content size
    ("zstd", zstd(BODY[:100]) + zstd(BODY[100:])),  # two frames
    ("gzip", gzip.compress(BODY[:100]) + gzip.compress(BODY[100:])),  # two gzip members
], ids=["raw-deflate", "zstd-sized", "zstd-frames", "gzip-members"])
def test_variants_decode(encoding: str, data: bytes) -> None:
    assert decode_body(data, [encoding], LIMIT) == BODY


def test_stacked_codings_are_undone_last_first(app: TestClient) -> None:
    data = zstd(gzip.compress(BODY))
    resp = app.post("/echo", content=data, headers={"content-encoding": "gzip, zstd"})
    assert resp.status_code == 200 and resp.content == BODY


def test_identity_and_no_header_pass_through(app: TestClient) -> None:
    assert app.post("/echo", content=BODY, headers={"content-encoding": "identity"}).content == BODY
    assert app.post("/echo", content=BODY).content == BODY
    assert content_encodings(" GZIP , identity") == ["gzip"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_corrupt_or_truncated_is_400(app: TestClient, encoding: str) -> None:
    good = ENCODED[encoding]
    for data in (good[: len(good) // 2], b"this is not compressed at all", good + b"trailing junk"):
        error = assert_error(app.post("/echo", content=data, headers={"content-encoding": encoding}), 400,
                             "invalid_content_encoding")
        assert encoding in error["message"] and error["param"] == "Content-Encoding"


def test_unknown_coding_is_415(app: TestClient) -> None:
    error = assert_error(app.post("/echo", content=BODY, headers={"content-encoding": "br"}), 415,
                         "unsupported_content_encoding")
    assert "gzip" in error["message"] and "zstd" in error["message"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_decompressed_size_is_limited(app: TestClient, encoding: str) -> None:
    big = b"a" * (LIMIT + 1)
    data = {"gzip": gzip.compress, "deflate": zlib.compress, "zstd": zstd_streamed}[encoding](big)
    assert len(data) < LIMIT
    assert_error(app.post("/echo", content=data, headers={"content-encoding": encoding}), 413, "request_too_large")
    exact = b"a" * LIMIT
    ok = {"gzip": gzip.compress, "deflate": zlib.compress, "zstd": zstd_streamed}[encoding](exact)
    assert app.post("/echo", content=ok, headers={"content-encoding": encoding}).content == exact


def test_compressed_size_is_limited_too(app: TestClient) -> None:
    data = gzip.compress(os.urandom(LIMIT + 1))  # random bytes do not compress
    assert len(data) > LIMIT
    assert_error(app.post("/echo", content=data, headers={"content-encoding": "gzip"}), 413, "request_too_large")


def bomb(encoding: str, size: int) -> bytes:
    """``size`` zero bytes in one gzip member / zstd frame (no content size stated)."""
    zeros = b"\0" * (1 << 20)
    c = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if encoding == "gzip" else \
        zstandard.ZstdCompressor(level=3).compressobj()
    return b"".join(c.compress(zeros) for _ in range(size >> 20)) + c.flush()


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_zip_bomb_stops_early_in_bounded_memory(encoding: str) -> None:
    """64 MiB of zeros in ~290 KiB (gzip) or ~2 KiB (zstd): refused at the 8 MiB limit
    without ever holding much more than the limit."""
    limit = 8 * 1024 * 1024
    data = bomb(encoding, 64 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(APIError) as info:
            decode_body(data, [encoding], limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 413
    assert peak < limit + 12 * 1024 * 1024, peak


def test_zstd_window_over_the_content_coding_limit_is_refused() -> None:
    """RFC 8878: the zstd content coding's window is at most 8 MiB; a frame asking for more
    (here 128 MiB) would make the decoder allocate it, so it is refused."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27, write_content_size=False)
    obj = zstandard.ZstdCompressor(compression_params=params).compressobj()
    data = obj.compress(b"x" * 1000) + obj.flush()
    assert zstandard.get_frame_parameters(data).window_size == 1 << 27
    with pytest.raises(APIError) as info:
        decode_body(data, ["zstd"], LIMIT)
    assert info.value.status == 400 and info.value.code == "invalid_content_encoding"


@pytest.mark.e2e
def test_router_accepts_compressed_responses_request(router: RouterProcess) -> None:
    """Through the real router: a zstd body (Codex's coding) and a gzip body create responses."""
    body = orjson.dumps({"model": MODEL, "input": "hi [sim:tokens=3]"})
    with httpx.Client(base_url=router.base_url, timeout=30) as http:
        for encoding, data in (("zstd", zstd_streamed(body)), ("gzip", gzip.compress(body))):
            resp = http.post("/v1/responses", content=data,
                             headers={"content-type": "application/json", "content-encoding": encoding})
            assert resp.status_code == 200, resp.text
            assert resp.json()["status"] == "completed"
        resp = http.post("/v1/responses", content=b"\x28\xb5\x2f\xfd garbage",
                         headers={"content-type": "application/json", "content-encoding": "zstd"})
        assert_error(resp, 400, "invalid_content_encoding")
