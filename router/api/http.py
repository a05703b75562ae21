"""Small HTTP helpers shared by the routes: JSON out, bounded JSON in, the error shape."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Iterator
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from router.api import access
from router.protocol.errors import APIError, InvalidRequest, PayloadTooLarge
from router.protocol.requests import UNSUPPORTED

try:  # zstd is what Codex CLI compresses its request bodies with
    import zstandard
except ImportError:  # without the package, zstd bodies are answered 415
    zstandard = None  # type: ignore[assignment]

M = TypeVar("M", bound=BaseModel)


class Body:
    """A whole answer (JSON, or bytes relayed from a worker) as a bare ASGI app.

    The hot routes' answers skip Starlette's Response (its header handling is
    ~5 us a request, measured here); the HTTP protocol (router/api/server.py)
    writes a Body it gets from a hot route itself, head and body in one write.
    """

    __slots__ = ("body", "status_code", "content_type", "headers")

    def __init__(self, body: bytes, status: int = 200, content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.body = body
        self.status_code = status
        self.content_type = content_type
        self.headers = headers

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """Content type, length and the extra headers, as the ASGI spec spells them."""
        raw = [(b"content-type", self.content_type.encode("latin-1")), (b"content-length", b"%d" % len(self.body))]
        if self.headers:
            raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        return raw

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers()})
        await send({"type": "http.response.body", "body": self.body})


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Body:
    return Body(orjson.dumps(content), status, headers=headers)


def error_body(error: APIError, headers: dict[str, str] | None = None) -> Body:
    """The error as the request's answer (its code goes on the request's access line)."""
    access.failed(error)
    if error.headers:
        headers = {**error.headers, **headers} if headers else error.headers
    return Body(orjson.dumps(error.body()), error.status, headers=headers)


def error_response(error: APIError) -> Response:
    """A Starlette Response, which the WebSocket handshake's denial also accepts."""
    access.failed(error)
    return Response(orjson.dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers)


Headers = list[tuple[bytes, bytes]]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, decompressed (see ``decode_request``), refused with 413 as soon as it is known to exceed ``limit``."""
    return await decode_request(request.scope["headers"], await read_raw(request, limit), limit)


async def read_raw(request: Request, limit: int) -> bytes:
    """The body as sent (still compressed), refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    if declared_length(request.scope["headers"]) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def declared_length(headers: Headers) -> int:
    """The Content-Length header's value; -1 when absent or not a number."""
    for name, value in headers:  # raw scope headers: no Headers object per request
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return -1


async def decode_request(headers: Headers, body: bytes, limit: int) -> bytes:
    """A body sent with ``Content-Encoding`` (gzip, deflate, zstd), decompressed.

    ``limit`` holds for the decompressed size too, and decompression stops as
    soon as the output passes it (no zip bomb fills memory).
    """
    encoding = next((value for name, value in headers if name == b"content-encoding"), None)
    if encoding is None:
        return body
    encodings = content_encodings(encoding.decode("latin-1"))
    if not encodings or not body:
        return body
    if len(body) > _INLINE_DECODE_BYTES:  # large bodies decompress off the event loop
        return await asyncio.to_thread(decode_body, body, encodings, limit)
    return decode_body(body, encodings, limit)


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")


# Content codings of request bodies (RFC 9110 8.4). Codex CLI sends zstd; gzip and deflate
# are what other HTTP clients send. "x-gzip" is gzip's old name.
SUPPORTED_ENCODINGS = ("gzip", "deflate", "zstd")
_ALIASES = {"x-gzip": "gzip"}
_INLINE_DECODE_BYTES = 256 * 1024
_OUT_CHUNK = 64 * 1024  # zlib output per step
_ZSTD_IN_CHUNK = 256  # zstd input per step: one step can produce at most ~8 MiB (RLE blocks)
_ZSTD_MAX_WINDOW = 8 * 1024 * 1024  # RFC 8878 section 3: the "zstd" content coding's window limit
_DECODE_ERRORS: tuple[type[Exception], ...] = (zlib.error, ValueError) + (
    (zstandard.ZstdError,) if zstandard is not None else ())


def content_encodings(header: str | None) -> list[str]:
    """The codings of a Content-Encoding header in the order they were applied; identity
    dropped. An unknown coding is 415 (RFC 9110 15.5.16) in the OpenAI error shape."""
    if header is None:
        return []
    out = []
    for raw in header.split(","):
        name = raw.strip().lower()
        name = _ALIASES.get(name, name)
        if name in ("", "identity"):
            continue
        if name not in SUPPORTED_ENCODINGS or (name == "zstd" and zstandard is None):
            supported = ", ".join(e for e in SUPPORTED_ENCODINGS if e != "zstd" or zstandard is not None)
            raise APIError(f"Unsupported Content-Encoding {raw.strip()!r}; supported: {supported}.", status=415,
                           type="invalid_request_error", param="Content-Encoding", code="unsupported_content_encoding")
        out.append(name)
    return out


def decode_body(body: bytes, encodings: list[str], limit: int) -> bytes:
    """Undo ``encodings`` (last applied first). Corrupt or truncated data is a 400; output
    over ``limit`` bytes is a 413, raised as soon as the output passes the limit."""
    for name in reversed(encodings):
        pieces = _zstd_pieces(body) if name == "zstd" else _zlib_pieces(body, name)
        parts: list[bytes] = []
        size = 0
        try:
            for piece in pieces:
                size += len(piece)
                if size > limit:
                    raise too_large(limit)
                parts.append(piece)
        except _DECODE_ERRORS as exc:
            raise _undecodable(name, str(exc)) from None
        body = b"".join(parts)
    return body


def _undecodable(name: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"The request body could not be decompressed as {name}: {why}", param="Content-Encoding",
                          code="invalid_content_encoding")


def _zlib_pieces(data: bytes, name: str) -> Iterator[bytes]:
    """gzip (every member of a multi-member file) or deflate: zlib-wrapped as RFC 9110 says,
    raw deflate as some clients send it; at most ``_OUT_CHUNK`` bytes per piece."""
    if name == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    else:
        zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and ((data[0] << 8) | data[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    rest = data
    while True:
        d = zlib.decompressobj(wbits)
        while not d.eof:
            piece = d.decompress(rest, _OUT_CHUNK)
            rest = d.unconsumed_tail
            if piece:
                yield piece
            elif not rest:
                raise ValueError("the compressed data ends too early")
        rest = d.unused_data
        if name != "gzip" or not rest:
            break
    if rest:
        raise ValueError("data follows the end of the compressed stream")


def _zstd_pieces(data: bytes) -> Iterator[bytes]:
    """One or more zstd frames, fed in small slices so one step's output stays bounded."""
    assert zstandard is not None
    decompressor = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
    d = decompressor.decompressobj()
    pos = 0
    while pos < len(data):
        piece = d.decompress(data[pos:pos + _ZSTD_IN_CHUNK])
        pos += _ZSTD_IN_CHUNK
        if piece:
            yield piece
        if d.eof:
            tail = d.unused_data + data[pos:]
            if not tail:
                return
            data, pos = tail, 0
            d = decompressor.decompressobj()
    if not d.eof:
        raise ValueError("the compressed data ends too early")


def parse_model(model: type[M], body: bytes) -> M:
    """Validate a JSON body; every failure is a 400 that names the parameter."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    if b"NaN" in body or b"Infinity" in body:  # most bodies: two scans, and no second parse
        _no_constants(body)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"We could not parse the JSON body of your request: {name} is not a JSON value.",
                         code="invalid_json")


def _no_constants(body: bytes) -> None:
    """Refuse ``NaN`` and ``Infinity``, which JSON does not have. The model's parser takes
    them into free-form fields (a tool's schema, an item's extra fields), and they would
    reach the worker, and the store, as null. Anything else wrong is left to the model's
    parser, which names it."""
    try:
        orjson.loads(body)  # strict JSON, and ~5x faster than json: most bodies that hold the words end here
        return
    except orjson.JSONDecodeError:
        pass
    try:
        json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return  # not JSON at all, or too deep: the model's parser names what is wrong


def validation_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return InvalidRequest(
            "We could not parse the JSON body of your request: " + str((err.get("ctx") or {}).get("error", "invalid JSON")),
            code="invalid_json",
        )
    if kind == "model_type":
        return InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    param = _param(err["loc"])
    if kind == "extra_forbidden":
        if param in UNSUPPORTED:  # the SDK's name for a service of OpenAI's own
            return InvalidRequest(f"{UNSUPPORTED[param]} is not available here", param=param, code="unsupported_parameter")
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    ctx_error = (err.get("ctx") or {}).get("error")
    message = str(ctx_error) if ctx_error is not None else err["msg"]
    return InvalidRequest(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def _param(loc: tuple[int | str, ...]) -> str:
    # pydantic puts union branch names in loc ("str", "list[any]"); they mean nothing to a client.
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = part
        elif part not in ("str", "list[any]", "dict[str,any]") and not part.startswith("function-after["):
            out += f".{part}"
    return out


def int_param(raw: str, name: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer from {low} to {high}.", param=name, code="invalid_value")
    return value


def order_param(raw: str) -> Any:
    if raw not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
    return raw


def list_page(page: Any) -> dict[str, Any]:
    """A store ItemPage as the API's list object."""
    data = page.data
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }
