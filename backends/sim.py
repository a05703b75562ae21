"""A simulated vLLM / SGLang worker: the engine's HTTP API without a model.

Demos, tests and benchmarks drive the router end to end with it on machines
that cannot run an engine: `/health`, `/v1/models`, `/metrics` and
`/v1/chat/completions` in the engine's wire shapes. Output is derived from the
request; markers in the last user message script it (backends/sim_script.py):

- failures and timing: `[sim:status=CODE]`, `[sim:drop_after=K]` (close the
  connection after K tokens), `[sim:hang]`, `[sim:ttft_ms=N]`, `[sim:itl_ms=N]`;
- text: `[sim:tokens=N]` words, `[sim:echo]` (the messages as JSON),
  `[sim:echo=request]` (the body except `messages`, as JSON), `[sim:refuse]`
  (a refusal); a last message of role `tool` is answered "tool said: ...";
- tool calls (with `tools`): `[sim:call=NAME]`, `[sim:call=A,B]` (parallel),
  arguments valid for the tool's schema; `tool_choice` required/named/none;
  without a marker, the function the message mentions by a word of its name or
  description (backends/sim_tools.py);
- reasoning: `[sim:reason=N]` (the reasoning field), `[sim:think=N]`
  (`<think>...</think>` in the content);
- `[sim:cached=N]`: `usage.prompt_tokens_details.cached_tokens`, else with
  `--kv-cache-blocks N` the prefix cache's hit (backends/sim_cache.py).

`response_format` json_schema/json_object makes the content JSON valid for the
schema; `logprobs`/`top_logprobs` add deterministic logprobs. `--dialect harmony`
adds the engines' token-level generate APIs for gpt-oss (backends/sim_harmony.py).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from backends.sim_bodies import SGLANG_EOS_TOKEN_ID, chunk_body, completion_body  # noqa: F401  (re-exported)
from backends.sim_cache import BLOCK_TOKENS
from backends.sim_config import SimConfig
from backends.sim_metrics import Stats, render_metrics  # noqa: F401  (re-exported)
from backends.sim_plan import Plan, plan_request  # noqa: F401  (re-exported)
from backends.sim_script import (  # noqa: F401  (VOCAB and the helpers are re-exported)
    VOCAB,
    SimError,
    Step,
    ToolCall,
    build_script,
    count_prompt_tokens,
    cut_steps,
    error_body,
    generate_tokens,
    int_marker,
    last_user_text,
    logprobs_body,
    message_fields,
    parse_markers,
    read_options,
    step_delta,
    usage_body,
)
from backends.sim_server import SimWorker, build_app, serve  # noqa: F401  (re-exported)

# The modules, one job each: sim_config (settings), sim_plan (validate and script one request;
# sim_context: the context window's checks), sim_script (the answer's content), sim_bodies (the
# engines' JSON and chunk shapes), sim_server (HTTP routes, slots, pacing), sim_metrics
# (counters, Prometheus text), sim_cache (the prefix cache), sim_harmony (generate APIs).


def parse_args(argv: list[str] | None = None, prog: str = "python -m backends.sim") -> SimConfig:
    return SimConfig(**vars(parser(prog).parse_args(argv)))


def parser(prog: str = "python -m backends.sim") -> argparse.ArgumentParser:
    """The sim's command line, every option explained (``--help``)."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n")[0] + " Markers in the last user message drive it "
        "([sim:tokens=N], [sim:status=CODE], [sim:hang], ...: docs/testing.md, 'The simulated worker').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="whose HTTP API to speak")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks a free port")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    p.add_argument("--itl-ms", type=float, default=0.0, help="delay between tokens")
    p.add_argument("--max-concurrency", type=int, default=64, help="generating at once")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="the context it reports in /v1/models and enforces (400 past it)")
    p.add_argument("--default-tokens", type=int, default=12, help="tokens per answer, unless a marker says")
    p.add_argument("--reasoning-field", choices=("reasoning", "reasoning_content"), default=None,
                   help="the delta/message key for [sim:reason]; default: what the engine sends "
                        "(vLLM 0.32: reasoning, SGLang: reasoning_content)")
    p.add_argument("--dialect", choices=("chat", "harmony"), default="chat",
                   help="harmony: gpt-oss token-level generate endpoints (backends/sim_harmony.py)")
    p.add_argument("--harmony-vocab-dir", help="folder with o200k_base.tiktoken (harmony)")
    p.add_argument("--no-scale-out", action="store_true",
                   help="vLLM started without --enable-scale-out: /inference/v1/generate answers 404")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="SGLang: /generate streams deltas instead of cumulative text/output_ids")
    p.add_argument("--kv-cache-blocks", type=int, default=0,
                   help="prefix cache capacity in blocks (LRU); 0: no prefix cache")
    p.add_argument("--kv-block-size", type=int, default=BLOCK_TOKENS, help="tokens per cache block")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0,
                   help="compute per uncached prompt token (one prompt at a time) before the first token")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m backends.sim") -> None:
    cfg = parse_args(argv, prog)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None
    try:
        from uvloop import new_event_loop as loop_factory
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(cfg))


if __name__ == "__main__":
    main()
