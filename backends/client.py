"""The HTTP wire to workers, one WorkerClient per pool.

Every call (JSON, SSE, byte relays, and the GETs of health checks and metrics
scrapes) goes over backends/wire.py, a lean keep-alive client. Not httpx: measured here,
httpcore's pool scans every connection per request and costs ~10x more CPU
per proxied request. Nothing here knows about Responses; errors are typed by
what the router must do with them (backends/errors.py).

One TLS context per pool (``tls_context``: its CA bundle and client certificate), so a
health check trusts exactly what a model call trusts.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from backends.errors import (
    WorkerAnswerTooLarge,
    WorkerError,
    WorkerHTTPError,
    WorkerIdleClosed,
    WorkerStreamBroken,
    WorkerStreamError,
    WorkerUnavailable,
)
from backends.wire import COMPLETE, Connection, WireLimits
from backends.wire_targets import Wire

__all__ = ["RawAnswer", "SSEStream", "TLSError", "WireLimits", "WorkerClient", "WorkerError", "WorkerHTTPError",
           "WorkerStreamBroken", "WorkerStreamError", "WorkerUnavailable", "tls_context"]


class TLSError(ValueError):
    """A TLS file that cannot be used; ``key`` names the setting (tls_ca_file, tls_cert_file, tls_key_file)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def tls_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """The context https workers are called with: certificates checked against ``ca_file`` (PEM;
    None: the system's trust store) and their host names; the router's own certificate and key
    (``cert_file`` may hold both) for workers that ask for one. TLSError says which file is wrong."""
    ctx = ssl.create_default_context()
    if ca_file is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks certificates and host names, as the default
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except OSError as exc:
            raise TLSError("tls_ca_file", _tls_reason(ca_file, exc, "no PEM certificate in it")) from None
    if cert_file is not None:
        def no_passphrase() -> bytes:  # else OpenSSL would ask for one on the terminal, and start-up would wait
            raise TLSError("tls_key_file" if key_file is not None else "tls_cert_file",
                           f"{key_file or cert_file}: the key is encrypted; give it unencrypted (there is no passphrase setting)")

        try:
            ctx.load_cert_chain(cert_file, key_file, password=no_passphrase)
        except TLSError:
            raise
        except OSError as exc:
            key = "tls_key_file" if key_file is not None and _unreadable(key_file) else "tls_cert_file"
            path = key_file if key == "tls_key_file" and key_file is not None else cert_file
            what = "the key does not match the certificate, or one of them is no PEM" if isinstance(exc, ssl.SSLError) else ""
            raise TLSError(key, _tls_reason(path, exc, what)) from None
    return ctx


def _unreadable(path: str) -> bool:
    try:
        with open(path, "rb"):
            return False
    except OSError:
        return True


def _tls_reason(path: str, exc: OSError, bad_pem: str) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"{path}: {bad_pem} ({exc.reason or exc})"
    return f"cannot read {path}: {exc.strerror or exc}"


class WorkerClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0,
                 limits: WireLimits | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.limits = limits or WireLimits()
        self.tls = tls  # https workers: None, the system's trust store
        self.wire = Wire(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, limits=self.limits, tls=tls)

    def forget(self, origin: str) -> None:
        """The worker at ``origin`` is out of service: close the model-call connections to it."""
        self.wire.forget(origin)

    async def close(self) -> None:
        self.wire.close()

    async def get(self, url: str, *, timeout_s: float = 2.0) -> tuple[int, bytes]:
        """A short GET (health checks, model lists); raises WorkerUnavailable when unreachable, or
        when no whole answer came within ``timeout_s``. A kept-alive connection the worker had
        closed is tried once more on a new one."""
        try:
            return await asyncio.wait_for(self._get(url), timeout_s)
        except TimeoutError:
            raise WorkerUnavailable(f"{url}: no answer within {timeout_s:g} s") from None
        except WorkerUnavailable:
            raise
        except WorkerError as exc:  # the connection broke, or the answer was too large
            raise WorkerUnavailable(f"{url}: {exc}") from exc

    async def _get(self, url: str) -> tuple[int, bytes]:
        try:
            conn = await self.wire.get(url)
        except WorkerIdleClosed:
            conn = await self.wire.get(url)
        return conn.status, await conn.read()

    async def post_json(self, url: str, body: dict[str, Any]) -> Any:
        """POST and return the decoded JSON answer; error statuses raise WorkerHTTPError."""
        conn = await self.wire.post(url, orjson.dumps(body), whole=True)
        raw = await conn.read()
        if conn.status >= 400:
            raise WorkerHTTPError(conn.status, _decode(raw))
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise WorkerStreamBroken(f"{url}: answer is not JSON") from exc

    async def open_sse(self, url: str, body: dict[str, Any]) -> SSEStream:
        """POST and return the open event stream once the worker has answered 200."""
        conn = await self.wire.post(url, orjson.dumps(body), sse=True)
        if conn.status >= 400:
            try:
                raw = await conn.read()
            except WorkerStreamBroken:
                raw = b""
            raise WorkerHTTPError(conn.status, _decode(raw))
        return SSEStream(conn, self.limits.max_frame_bytes)

    async def relay(self, url: str, data: bytes) -> RawAnswer:
        """POST bytes as they came and hand back the answer unparsed (passthrough routes)."""
        return RawAnswer(await self.wire.post(url, data))


class RawAnswer:
    """A worker's answer relayed byte for byte: status, content type, body chunks as they arrive."""

    def __init__(self, conn: Connection) -> None:
        self.status = conn.status
        self.content_type = conn.content_type
        self._conn = conn

    async def read(self) -> bytes:
        return await self._conn.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; a broken connection just ends it (the client sees a cut stream, as from the worker)."""
        try:
            async for chunk in self._conn.body_chunks():
                yield chunk
        except WorkerStreamBroken:
            return


class SSEStream:
    """An open ``text/event-stream`` answer, read as batches of decoded ``data:`` payloads.

    One batch per network read, so the events made from it leave in one write.
    Ends cleanly only on ``data: [DONE]``; anything else is WorkerStreamBroken.
    Two ways to read it: ``batches()`` (pull: the reader task wakes per read) and
    ``push()`` (each batch handed to a callback inside the connection's own
    ``data_received``: no task wake-up per read; measured, a quarter fewer
    instructions per streamed token).
    """

    def __init__(self, conn: Connection, max_frame_bytes: int = WireLimits.max_frame_bytes) -> None:
        self._conn = conn
        self._gen = conn.gen
        # The reads of a frame not yet ended, kept apart until one ends it: joined once then, so a
        # frame that comes in many reads costs its length, not its length times its reads.
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._max_frame = max_frame_bytes
        self._done = False  # [DONE] seen
        self._error: WorkerStreamError | None = None  # an error frame, raised after the frames before it
        # How a payload becomes a batch element: orjson.loads, or a reader's own decoder that gives
        # what orjson.loads would, or a stand-in of another type for a payload it knows cheaper
        # (router/dialects/chat_chunks.py: the text of a plain text chunk, as a str).
        self._decode: Callable[[bytes], Any] = orjson.loads

    def _frames(self, data: bytes) -> list[Any]:
        """The decoded payloads of the frames ``data`` completes, up to ``[DONE]`` or an error frame."""
        if data[:7] == b"data: {" and data.find(b"\n") == len(data) - 2 and data[-1] == 10 and not self._buffer:
            # A paced stream's every read: one whole frame of one data line that opens a JSON
            # object, decoded as it is. What does not decode takes the general way below, which
            # says why. Slices and an index, not bytes methods: this runs once per streamed token.
            try:
                decoded = self._decode(data[6:-2])
            except orjson.JSONDecodeError:
                pass
            else:
                if type(decoded) is dict and "error" in decoded and "choices" not in decoded:
                    self._error = WorkerStreamError(_error_message(decoded["error"]))
                    return []
                return [decoded]
        if not self._buffer and data[:6] == b"data: " and data.find(b"\n") == len(data) - 2 and data[-1:] == b"\n":
            # A paced stream's every read: one whole frame of one data line.
            payloads: list[bytes | None] = [data[6:-2].rstrip(b"\r")]
        else:
            pending = self._buffer
            if pending:
                if data.find(b"\n\n") < 0 and not (pending[-1][-1:] == b"\n" and data[:1] == b"\n"):
                    pending.append(data)  # the frame goes on: nothing to split yet
                    self._buffered += len(data)
                    self._check_frame(self._buffered)
                    return []
                pending.append(data)
                buffer = b"".join(pending)
            else:
                buffer = data
            frames = buffer.split(b"\n\n")
            rest = frames.pop()
            self._buffer = [rest] if rest else []
            self._buffered = len(rest)
            self._check_frame(max(self._buffered, *map(len, frames)) if frames else self._buffered)
            payloads = [_data(frame) for frame in frames]
        batch = []
        decode = self._decode
        for payload in payloads:
            if payload is None:
                continue
            if payload == b"[DONE]":
                self._done = True
                break
            try:
                decoded = decode(payload)
            except orjson.JSONDecodeError as exc:
                raise WorkerStreamBroken(repr(exc)) from exc
            if type(decoded) is dict and "error" in decoded and "choices" not in decoded:
                self._error = WorkerStreamError(_error_message(decoded["error"]))
                break
            batch.append(decoded)
        return batch

    def _check_frame(self, size: int) -> None:
        if size > self._max_frame:
            raise WorkerAnswerTooLarge(f"a frame of the stream passed max_frame_bytes ({self._max_frame})")

    async def batches(self, decode: Callable[[bytes], Any] | None = None) -> AsyncIterator[list[Any]]:
        """Each read's batch, read by the reader's task; ``decode`` as for ``push``."""
        self._decode = decode or orjson.loads
        conn = self._conn
        try:
            while True:
                if not conn.chunks:
                    if conn.state == COMPLETE:
                        break
                    await conn.wait()
                    continue
                batch = self._frames(conn.take())
                if batch:
                    yield batch
                if self._error is not None:
                    raise self._error
                if self._done:
                    return
        finally:
            conn.finish(self._gen, drain=self._done)
        raise WorkerStreamBroken("the worker closed the stream before [DONE]")

    async def push(self, on_batch: Callable[[list[Any]], bool],
                   decode: Callable[[bytes], Any] | None = None) -> AsyncIterator[None]:
        """Hand each batch to ``on_batch`` as it arrives, from the connection's ``data_received``.

        ``on_batch`` returns False when its consumer cannot take more now: reading
        stops and this yields once, so the consumer can catch up in its task;
        reading resumes when iteration goes on. Failures, ``on_batch``'s own
        included, are raised here, in the consumer's task. ``decode`` makes a
        payload a batch element (orjson.loads unless given; see ``_decode``).
        """
        self._decode = decode or orjson.loads
        conn = self._conn
        failure: BaseException | None = None
        held = False

        def feed(data: bytes) -> None:
            nonlocal failure, held
            try:
                batch = self._frames(data)
                if batch and not on_batch(batch):
                    held = True
                    conn.pause()
            except Exception as exc:  # noqa: BLE001 - raised again in the consumer's task
                failure = exc
                conn.sink = None
                conn.pause()
            if failure is not None or held or self._done or self._error is not None:
                conn.wake()

        try:
            if conn.chunks:  # bytes that came with the headers
                feed(conn.take())
            conn.sink = feed
            while True:
                if held:
                    held = False
                    yield
                    if failure is None and not self._done and self._error is None:
                        conn.resume()
                    continue
                if failure is not None:
                    raise failure
                if self._error is not None:
                    raise self._error
                if self._done:
                    return
                if conn.state == COMPLETE and not conn.chunks:
                    break
                await conn.wait()
        finally:
            conn.sink = None
            conn.finish(self._gen, drain=self._done)
        raise WorkerStreamBroken("the worker closed the stream before [DONE]")

    def close(self) -> None:
        self._conn.finish(self._gen)


def _data(frame: bytes) -> bytes | None:
    """The data of one SSE frame (multi-line data joined by newlines), or None."""
    if frame[:6] == b"data: " and frame.find(b"\n") < 0:  # one data line
        return frame[6:].rstrip(b"\r")
    lines = [line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return lines[0].rstrip(b"\r") if len(lines) == 1 else b"\n".join(line.rstrip(b"\r") for line in lines)


def _error_message(error: Any) -> str:
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return str(error)[:500]


def _decode(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")

