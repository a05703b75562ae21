"""The floor for item 3: a TCP byte relay in front of the sim, the least a Python proxy can do.

    python -m bench.relay --port P --upstream-port Q

Each client connection gets its own connection to the sim; bytes go both ways
unparsed, one read and one write per upstream token, with flow control (a
side whose peer backs up stops being read). Same interpreter, same event loop
(uvloop) as the router, so its CPU per streamed token is the physical limit
the router's figure is read against: whatever the router spends above it is
parsing, translation and framing.
"""

from __future__ import annotations

import argparse
import asyncio


class Side(asyncio.Protocol):
    """One end of a relayed pair; what it reads goes to ``peer``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Side | None = None
        self.pending: list[bytes] = []  # read before the peer's connection was made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
            return
        peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class Downstream(Side):
    """The client's side: connects to the sim when the client connects."""

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.loop = loop
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, up = await self.loop.create_connection(Side, *self.upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        up.peer, self.peer = self, up  # type: ignore[attr-defined]
        for data in self.pending:
            up.transport.write(data)  # type: ignore[attr-defined]
        self.pending.clear()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(loop, upstream), "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument("--upstream-host", default="127.0.0.1")
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args.port, (args.upstream_host, args.upstream_port)))


if __name__ == "__main__":
    main()
