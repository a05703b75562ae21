"""A worker that answers as a broken or hostile engine would, on raw sockets.

``python -m tests.fault.hostile_worker PORT MODEL`` serves ``/health``, ``/v1/models``
and ``/v1/chat/completions`` as vLLM does, and the last user message, when it
starts with ``bad:``, says how to misbehave:

- ``bad:answer JSON``: a non-stream answer with this body (status 200).
- ``bad:frame JSON``: a stream whose second frame is this (then it stays open, silent).
- ``bad:huge_answer N``: a non-stream answer of N bytes (Content-Length), ``bad:huge_chunked N``
  the same without a length.
- ``bad:huge_frame N``: a stream frame of N bytes that never ends.
- ``bad:silent``: a stream's head, then nothing; ``bad:no_head``: nothing at all.
- ``bad:reset``: the request is read, then the connection is reset with nothing sent (an engine
  that crashes on it); ``GET /resets`` says how many such requests came.

Anything else gets a small ordinary answer, so the pool is healthy and serves.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys

PIECE = 64 * 1024
resets = 0  # bad:reset requests read


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, content_type.encode(), len(body))
            + body)


def _frame(payload: object) -> bytes:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _chunk(model: str, delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, model: str) -> None:
    try:
        while True:
            try:
                _method, path, body = await _read_request(reader)  # type: ignore[misc]
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if path == "/health":
                writer.write(_answer(200, b"{}"))
            elif path == "/resets":
                writer.write(_answer(200, json.dumps({"resets": resets}).encode()))
            elif path == "/v1/models":
                writer.write(_answer(200, json.dumps({"object": "list", "data": [
                    {"id": model, "object": "model", "max_model_len": 4096}]}).encode()))
            elif path == "/v1/chat/completions":
                if not await _chat(json.loads(body), writer, model):
                    return
            else:
                writer.write(_answer(404, b'{"error": {"message": "not found"}}'))
            await writer.drain()
    finally:
        writer.close()


async def _chat(request: dict[str, object], writer: asyncio.StreamWriter, model: str) -> bool:
    """Answer one chat call; False when the connection is to be left (or was left) as it is."""
    messages = request["messages"]
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")  # type: ignore[index, union-attr]
    text = last if isinstance(last, str) else "".join(p.get("text", "") for p in last)
    kind, _, arg = text[4:].partition(" ") if text.startswith("bad:") else ("", "", "")
    stream = bool(request.get("stream"))
    if kind == "reset":
        global resets
        resets += 1
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() resets
        writer.transport.abort()
        return False
    if kind == "answer":
        writer.write(_answer(200, arg.encode()))
        return True
    if kind in ("huge_answer", "huge_chunked"):
        size = int(arg)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        head += b"content-length: %d\r\n\r\n" % size if kind == "huge_answer" else b"transfer-encoding: chunked\r\n\r\n"
        writer.write(head)
        sent = 0
        while sent < size:
            piece = b" " * min(PIECE, size - sent)
            writer.write(piece if kind == "huge_answer" else b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
            try:
                await writer.drain()
            except ConnectionError:
                return False
        return False
    if kind == "no_head":
        await asyncio.sleep(3600)
        return False
    if not stream:
        writer.write(_answer(200, json.dumps({
            "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()))
        return True
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    if kind == "silent":
        await writer.drain()
        await asyncio.sleep(3600)
        return False
    writer.write(_frame(_chunk(model, {"role": "assistant", "content": ""})))
    if kind == "frame":
        data = b"data: " + arg.encode() + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()
        await asyncio.sleep(3600)  # the router must not wait for more
        return False
    if kind == "huge_frame":
        writer.write(b'10\r\ndata: {"text": "\r\n')
        for _ in range(int(arg) // PIECE):
            writer.write(b"%x\r\n%s\r\n" % (PIECE, b"a" * PIECE))
            try:
                await writer.drain()
            except ConnectionError:
                return False
        await asyncio.sleep(3600)
        return False
    writer.write(_frame(_chunk(model, {"content": "ok"})))
    writer.write(_frame({**_chunk(model, {}, "stop"), "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                                                  "total_tokens": 4}}))
    data = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    return True


async def main(port: int, model: str) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(r, w, model), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
