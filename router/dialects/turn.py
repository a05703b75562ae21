"""What the runner needs from a dialect, for one response: a request and a decoder.

Chat pools and harmony pools differ in what they send and how they read the
answer; the runner sees only this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from router.dialects.deltas import Delta
from router.protocol.items import Item


class DialectTurn(Protocol):
    path: str  # the worker endpoint to POST to

    @property
    def decode(self) -> Callable[[bytes], Any] | None:
        """How the stream's payloads are decoded, when the dialect knows a cheaper way than JSON for
        some of them (None: JSON). A plain text chunk may then come to ``chunk`` as its text, a str.
        Read-only: an attribute (ChatTurn) or a method (HarmonyTurn) both give it."""
        ...

    def request(self, items: list[Item], *, stream: bool) -> dict[str, Any]:
        """The worker's request body for one model turn over ``items``."""
        ...

    def chunk(self, payload: Any, /) -> list[Delta]:
        """One streamed frame of the worker's answer."""
        ...

    def completion(self, payload: dict[str, Any], /) -> list[Delta]:
        """A whole non-streamed answer: the same deltas a stream would give."""
        ...

    def end(self) -> list[Delta]:
        """The stream ended cleanly: flush whatever a decoder still holds."""
        ...
