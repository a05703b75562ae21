"""The HTTP wire to workers: aiohttp, one ClientSession per pool.

aiohttp, not httpx: measured here, httpcore's pool scans every connection
per request and costs ~10x more CPU per proxied request. Nothing here knows
about Responses; errors are typed by what the router must do with them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson


class WorkerError(Exception):
    """Base of everything a worker call can fail with."""


class WorkerUnavailable(WorkerError):
    """No answer at all (refused, reset before headers, connect timeout): safe to retry elsewhere."""


class WorkerHTTPError(WorkerError):
    """The worker answered with an error status."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"worker answered {status}")
        self.status = status
        self.body = body

    @property
    def message(self) -> str:
        body = self.body
        if isinstance(body, dict):
            err = body.get("error", body)
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return err["message"]
        return str(body)[:500] or f"worker answered {self.status}"


class WorkerStreamBroken(WorkerError):
    """The answer started and then broke off (connection lost, read timeout, bad frame)."""


class WorkerStreamError(WorkerStreamBroken):
    """The worker said so itself, after its 200: a ``data: {"error": ...}`` frame (vLLM, SGLang)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class WorkerClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, json_serialize=lambda o: orjson.dumps(o).decode()
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "WorkerClient.start() was not awaited"
        return self._session

    async def get(self, url: str, *, timeout_s: float = 2.0) -> tuple[int, bytes]:
        """A short GET (health checks, model lists); raises WorkerUnavailable when unreachable."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise WorkerUnavailable(f"{url}: {exc!r}") from exc

    async def post_json(self, url: str, body: dict[str, Any]) -> Any:
        """POST and return the decoded JSON answer; error statuses raise WorkerHTTPError."""
        try:
            resp = await self.session.post(url, data=orjson.dumps(body), headers=_JSON)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _send_error(url, exc) from exc
        async with resp:
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise WorkerStreamBroken(f"{url}: {exc!r}") from exc
            if resp.status >= 400:
                raise WorkerHTTPError(resp.status, _decode(raw))
            try:
                return orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise WorkerStreamBroken(f"{url}: answer is not JSON") from exc

    async def open_sse(self, url: str, body: dict[str, Any]) -> SSEStream:
        """POST and return the open event stream once the worker has answered 200."""
        try:
            resp = await self.session.post(url, data=orjson.dumps(body), headers=_SSE)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _send_error(url, exc) from exc
        if resp.status >= 400:
            async with resp:
                try:
                    raw = await resp.read()
                except (aiohttp.ClientError, TimeoutError, OSError):
                    raw = b""
            raise WorkerHTTPError(resp.status, _decode(raw))
        return SSEStream(resp)


    async def relay(self, url: str, data: bytes) -> RawAnswer:
        """POST bytes as they came and hand back the answer unparsed (passthrough routes)."""
        try:
            resp = await self.session.post(url, data=data, headers=_JSON)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _send_error(url, exc) from exc
        return RawAnswer(resp)


class RawAnswer:
    """A worker's answer relayed byte for byte: status, content type, body chunks as they arrive."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")
        self._resp = resp

    async def read(self) -> bytes:
        async with self._resp:
            try:
                return await self._resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise WorkerStreamBroken(repr(exc)) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; a broken connection just ends it (the client sees a cut stream, as from the worker)."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError, OSError):
            return
        finally:
            self._resp.close()


class SSEStream:
    """An open ``text/event-stream`` answer, read as batches of decoded ``data:`` payloads.

    One batch per network read, so the events made from it leave in one write.
    Ends cleanly only on ``data: [DONE]``; anything else is WorkerStreamBroken.
    """

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    async def batches(self) -> AsyncIterator[list[Any]]:
        resp = self._resp
        buffer = b""
        try:
            async for chunk in resp.content.iter_any():
                buffer += chunk
                if b"\n\n" not in buffer:
                    continue
                frames = buffer.split(b"\n\n")
                buffer = frames.pop()
                batch = []
                for frame in frames:
                    payload = _data(frame)
                    if payload is None:
                        continue
                    if payload == b"[DONE]":
                        if batch:
                            yield batch
                        return
                    frame = orjson.loads(payload)
                    if type(frame) is dict and "error" in frame and "choices" not in frame:
                        if batch:
                            yield batch
                        raise WorkerStreamError(_error_message(frame["error"]))
                    batch.append(frame)
                if batch:
                    yield batch
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            raise WorkerStreamBroken(repr(exc)) from exc
        finally:
            resp.release() if resp.content.at_eof() else resp.close()
        raise WorkerStreamBroken("the worker closed the stream before [DONE]")

    def close(self) -> None:
        self._resp.close()


def _send_error(url: str, exc: BaseException) -> WorkerError:
    """Could not connect: the worker is unavailable. Connected, then lost: it may have started the work."""
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return WorkerUnavailable(f"{url}: {exc!r}")
    return WorkerStreamBroken(f"{url}: {exc!r}")


def _data(frame: bytes) -> bytes | None:
    """The data of one SSE frame (multi-line data joined by newlines), or None."""
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


_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "application/json", "Accept": "text/event-stream"}
