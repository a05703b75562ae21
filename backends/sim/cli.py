"""A simulated vLLM / SGLang worker: the engine's HTTP API without a model.

Its command line (``python -m backends.sim``, ``responses-router sim``); the package's docstring
says what it answers and how markers script it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from backends.sim.cache import BLOCK_TOKENS
from backends.sim.config import SimConfig
from backends.sim.server import serve


def parse_args(argv: list[str] | None = None, prog: str = "python -m backends.sim") -> SimConfig:
    return SimConfig(**vars(parser(prog).parse_args(argv)))


def parser(prog: str = "python -m backends.sim") -> argparse.ArgumentParser:
    """The sim's command line, every option explained (``--help``)."""
    p = argparse.ArgumentParser(
        prog=prog, description=(__doc__ or "").split("\n")[0] + " Markers in the last user message drive it "
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
                   help="harmony: gpt-oss token-level generate endpoints (backends/sim/harmony.py)")
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
    p.add_argument("--kv-events-config", default=None,
                   help="vLLM's flag, as JSON (enable_kv_cache_events, endpoint, replay_endpoint, topic): publish "
                        "the prefix cache's KV-cache events over ZMQ (backends/sim/kv_events.py)")
    p.add_argument("--tokenize", action="store_true",
                   help="serve vLLM's POST /tokenize: chat messages as the token ids the prefix cache and its events use")
    p.add_argument("--kv-events-encoding", choices=("map", "array"), default="map",
                   help="each event a map tagged by type (vLLM 0.32) or a positional array (older vLLM)")
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

