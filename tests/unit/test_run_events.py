"""A foreground run's events as its answer reads them (router/turns/leases.py ``RunEvents``): an
answer that ends before its first read still ends the run, so its worker is not held forever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from router.api.sse import StreamBody
from router.turns.leases import Leases


class Run:
    """Stands for a ResponseRun: its events generator closes its worker stream when it ends
    (as ResponseRun.events does in its ``finally``); ``cancelled`` records how it ended."""

    def __init__(self) -> None:
        self.req = SimpleNamespace(store=False)
        self.ends: list[str] = []
        self.stream_open = True

    async def events(self) -> AsyncGenerator[list[dict[str, Any]], None]:
        try:
            yield [{"type": "response.created"}]
            yield [{"type": "response.completed"}]
        finally:
            self.stream_open = False

    async def cancelled(self) -> list[dict[str, Any]]:
        self.stream_open = False
        self.ends.append("cancelled")
        return []


def stream(run: Run) -> Any:
    return Leases(store=None).stream(run)  # type: ignore[arg-type]


def test_closed_before_its_first_read_the_run_ends_cancelled() -> None:
    run = Run()
    asyncio.run(stream(run).aclose())
    assert run.ends == ["cancelled"] and not run.stream_open


def test_read_to_its_end_it_is_not_cancelled_after() -> None:
    run = Run()

    async def main() -> list[str]:
        events = stream(run)
        types = [e["type"] async for batch in events for e in batch]
        await events.aclose()
        return types

    assert asyncio.run(main()) == ["response.created", "response.completed"]
    assert run.ends == [] and not run.stream_open


@pytest.mark.parametrize("failure", [OSError("connection reset"), asyncio.CancelledError()])
def test_an_answer_whose_head_cannot_go_out_ends_the_run(failure: BaseException) -> None:
    """The client is gone as the head goes out: the SSE answer closes its source unread."""
    run = Run()

    async def main() -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                raise failure

        with pytest.raises(type(failure)):
            await StreamBody(stream(run))({"type": "http"}, receive, send)

    asyncio.run(main())
    assert run.ends == ["cancelled"] and not run.stream_open
