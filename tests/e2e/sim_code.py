"""The sim worker (backends/sim/) with code_interpreter calls whose code the prompt gives.

``[sim:call=python]`` makes the sim call the router's ``python`` tool with a code argument it
derives from the schema (a bare word). Here a last user message holding ``CODE:`` sends what
follows it as the code instead, so a test through a real router decides what the sandbox runs.
Run as ``python -m tests.e2e.sim_code --port N`` (the sim's own options).
"""

from __future__ import annotations

from typing import Any

import backends.sim as sim
import backends.sim.plan as sim_plan
from backends.sim.script import message_text

MARK = "CODE:"
_build = sim_plan.build_script


def build_script(engine: str, body: dict, messages: list[dict], markers: dict[str, str | None], opts: Any,
                 default_tokens: int, limit: int) -> Any:
    """The sim's script, the ``python`` tool's schema pinned to the prompt's code (``const`` is what the sim sends)."""
    text = message_text(messages[-1]) if messages[-1].get("role") == "user" else ""
    if MARK in text and "python" in opts.tools:
        code = text.split(MARK, 1)[1]
        opts.tools["python"] = {"type": "object", "properties": {"code": {"const": code}}, "required": ["code"]}
    return _build(engine, body, messages, markers, opts, default_tokens, limit)


sim_plan.build_script = build_script  # plan_request's lookup

if __name__ == "__main__":
    sim.main()
