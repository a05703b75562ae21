"""The response head waits for the body, so a plain answer leaves in one write."""

from __future__ import annotations

import asyncio

from router.api.coalesce import HeadHoldingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: object = None) -> str:
        return f"info:{name}"


def test_head_and_body_leave_together_and_bodies_never_wait() -> None:
    async def main() -> None:
        fake = FakeTransport()
        t = HeadHoldingTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        assert fake.writes == []
        t.write(b"{}")
        assert fake.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        t.write(b"data: 1\n\n")  # a stream chunk goes at once
        assert fake.writes[-1] == b"data: 1\n\n"
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # no body follows: released at the end of the iteration
        assert len(fake.writes) == 2
        await asyncio.sleep(0)  # one turn of the loop: the release's term is what is tested
        assert fake.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n"
        assert t.get_extra_info("peername") == "info:peername"

    asyncio.run(main())


def test_close_sends_a_held_head_and_abort_drops_it() -> None:
    async def main() -> None:
        fake = FakeTransport()
        t = HeadHoldingTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        t.close()
        assert fake.writes == [b"HTTP/1.1 400 Bad Request\r\n\r\n"] and fake.closed
        other = FakeTransport()
        t2 = HeadHoldingTransport(other, asyncio.get_running_loop())  # type: ignore[arg-type]
        t2.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t2.abort()
        await asyncio.sleep(0)  # one turn of the loop: by then a held head would have gone out
        assert other.writes == [] and other.aborted

    asyncio.run(main())


def test_every_transport_method_is_there() -> None:
    """uvicorn and the WebSocket upgrade use the asyncio.Transport interface; all of it is delegated."""
    public = {n for n in dir(asyncio.Transport) if not n.startswith("_")}
    assert public <= set(dir(HeadHoldingTransport))
