"""A simulated vLLM / SGLang worker: the engine's HTTP API without a model.

Demos, tests and benchmarks drive the router end to end with it on machines
that cannot run an engine: `/health`, `/v1/models`, `/metrics` and
`/v1/chat/completions` in the engine's wire shapes. Output is derived from the
request; markers in the last user message script it (backends/sim/script.py):

- failures and timing: `[sim:status=CODE]`, `[sim:drop_after=K]` (close the
  connection after K tokens), `[sim:hang]`, `[sim:ttft_ms=N]`, `[sim:itl_ms=N]`;
- text: `[sim:tokens=N]` words, `[sim:echo]` (the messages as JSON),
  `[sim:echo=request]` (the body except `messages`, as JSON), `[sim:refuse]`
  (a refusal); a last message of role `tool` is answered "tool said: ...";
- tool calls (with `tools`): `[sim:call=NAME]`, `[sim:call=A,B]` (parallel),
  arguments valid for the tool's schema; `tool_choice` required/named/none;
  without a marker, the function the message mentions by a word of its name or
  description (backends/sim/tools.py);
- reasoning: `[sim:reason=N]` (the reasoning field), `[sim:think=N]`
  (`<think>...</think>` in the content);
- `[sim:cached=N]`: `usage.prompt_tokens_details.cached_tokens`, else with
  `--kv-cache-blocks N` the prefix cache's hit (backends/sim/cache.py).

`response_format` json_schema/json_object makes the content JSON valid for the
schema; `logprobs`/`top_logprobs` add deterministic logprobs. `--dialect harmony`
adds the engines' token-level generate APIs for gpt-oss (backends/sim/harmony.py).
"""

from __future__ import annotations

from backends.sim.cli import main, parse_args, parser
from backends.sim.config import SimConfig
from backends.sim.metrics import Stats, render_metrics
from backends.sim.schema import VOCAB
from backends.sim.script import count_prompt_tokens, generate_tokens, parse_markers
from backends.sim.server import SimWorker, build_app

# The modules, one job each: config (settings), cli (the command line), plan (validate and script
# one request; context: the context window's checks), script (the answer's content; schema: values
# valid for a schema; tools: the function a prompt mentions), bodies (the engines' JSON and chunk
# shapes), server (HTTP routes, slots, pacing), metrics (counters, Prometheus text), cache (the
# prefix cache), harmony (generate APIs; harmony_script: their answers).
#
# Only the sim itself and the `responses-router sim` command (router/cli.py) import it: a managed
# pool of engine "sim" starts it as a process (backends/engines.py), and no module that serves
# traffic may depend on it (tests/unit/test_architecture.py).

__all__ = [
    "VOCAB",
    "SimConfig",
    "SimWorker",
    "Stats",
    "build_app",
    "count_prompt_tokens",
    "generate_tokens",
    "main",
    "parse_args",
    "parse_markers",
    "parser",
    "render_metrics",
]
