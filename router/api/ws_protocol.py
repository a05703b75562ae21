"""uvicorn's WebSocket protocol, without an ERROR line for every refused upgrade.

A WebSocket the router refuses (no key, a wrong one) gets the HTTP error itself
as a denial response (router/api/websocket.py). uvicorn's sans-I/O protocol
sends it, but its ``run_asgi`` then checks only ``handshake_complete``, which a
denial never sets, and logs "ASGI callable returned without completing
handshake." at ERROR: anyone could fill the router's log by knocking. Here a
denial whose body has gone out counts as an answered handshake.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class RouterWebSocketProtocol(WebSocketsSansIOProtocol):
    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True  # answered (refused): nothing is left to complete
