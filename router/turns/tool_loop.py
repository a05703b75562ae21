"""The tools stage: the calls a model turn makes to tools the router runs (MCP, web search, code
interpreter), run concurrently between turns, within the request's budgets.

A turn whose calls are all the router's leads to another turn with their
results; a call for the client (a function, an approval request) ends the
response, as does ``max_tool_calls`` or the router's ``max_turns``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router import telemetry
from router.protocol.items import Item
from router.protocol.tools import ToolSet
from router.tools.registry import Browsing, RouterTools, gather_outcomes
from router.turns.assembler import Assembler, Event
from router.turns.meters import Meters
from router.turns.prelude import Prelude
from router.turns.tool_items import RouterCallItem

ROUTER_RUN = ("mcp", "web_search", "code_interpreter")


@dataclass(eq=False)
class ToolLoop:
    """One response's router-run tool calls: whether it may loop, how far, and running them."""

    tools: ToolSet
    router_tools: RouterTools | None
    prelude: Prelude | None  # MCP listings and approved calls, run before the first turn
    owner: str
    max_tool_calls: int | None
    metrics: Meters | None = None  # tool_calls_total, tool_call_duration_seconds
    _calls_run: int = 0
    loops: bool = field(init=False)  # whether the router may run tools between turns (else one plain worker call does)

    def __post_init__(self) -> None:
        offered = self.tools.offered
        self.loops = self.prelude is not None or (bool(offered) and any(t.kind in ROUTER_RUN for t in offered))

    @property
    def max_turns(self) -> int:
        return self.router_tools.max_turns if self.router_tools is not None and self.loops else 1

    def over_budget(self, more: int) -> bool:
        cap = self.max_tool_calls
        return cap is not None and self._calls_run + more > cap

    async def run(self, calls: list[RouterCallItem], asm: Assembler, turn_start: int, prompt_items: list[Item]) -> list[Event]:
        """Run this turn's router calls; the model's turn (``asm.output`` from ``turn_start``) and the
        results join ``prompt_items``. Returns the events that finish the calls."""
        assert self.router_tools is not None
        servers = self.prelude.servers if self.prelude is not None else {}
        timed = self.metrics.tool_call if self.metrics is not None else None
        outcomes = await gather_outcomes(calls, self.router_tools, servers, Browsing.from_items(prompt_items), owner=self.owner,
                                         timed=timed, around=_tool_span if telemetry.tracing() else None)
        events: list[Event] = []
        by_id: dict[str, str] = {}
        for call, outcome in zip(calls, outcomes):
            sources = [{"type": "url", "url": s["url"]} for s in outcome.sources or ()] if outcome.sources is not None else None
            call.finish(events, output=outcome.output, error=outcome.error, outputs=outcome.outputs, sources=sources)
            for source in outcome.sources or ():
                asm.sources[source["url"]] = source.get("title") or source["url"]
            by_id[call.item["id"]] = outcome.prompt_text
        self._calls_run += len(calls)
        for item in asm.output[turn_start:]:
            text = by_id.get(item["id"])
            prompt_items.append({**item, "_output": text} if text is not None else item)
        return events

    def unrunnable_call(self, output: list[Item]) -> str | None:
        """A call to a built-in tool (harmony's browser.*, python, container.*) that nothing here can run."""
        for item in output:
            name = item.get("name", "")
            if item["type"] == "function_call" and self.tools.lookup(name) is None and ("." in name or name == "python"):
                return "tool_not_available"
        return None


def _tool_span(kind: str) -> Any:
    return telemetry.span("tool call", **{"router.tool": kind})
