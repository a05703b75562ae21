"""The vLLM command lines the launcher builds, read by vLLM's REAL argument parser (engine tier).

backends/engines.py derives the flags a managed pool's config implies. Here the command lines
it builds for a harmony pool and a chat pool (every derived flag: generate endpoint, cached-token
reporting, tensor parallel size, context length, tool-call and reasoning parsers, priority
scheduling) are parsed in the prepared CPU vLLM venv exactly as ``python -m
vllm.entrypoints.openai.api_server`` parses its own: vLLM's ``make_arg_parser``, then its
``validate_parsed_serve_args`` and ``AsyncEngineArgs.from_cli_args`` (on the tier's tiny local
models: it resolves the model path). The parsers named must be ones vLLM registers. No engine is
started: no model is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from backends.engines import LaunchOptions, launch_command
from tests.support.engine_env import vllm_prepared  # noqa: F401 - the session fixture

pytestmark = pytest.mark.engine

MODULE = "vllm.entrypoints.openai.api_server"

# Runs in the vLLM venv: each argv (after ``-m MODULE``) parsed and validated as the server does;
# prints what vLLM understood, one JSON object per argv, and which parser names it registers.
PARSE = r'''
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:  # vLLM before the launchers package
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
import vllm.tool_parsers, vllm.reasoning  # noqa: F401 - they register the parsers

out = []
for argv in json.load(sys.stdin):
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    out.append({
        "model": args.model, "host": args.host, "port": args.port,
        "enable_scale_out": args.enable_scale_out, "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_auto_tool_choice": args.enable_auto_tool_choice, "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": engine.reasoning_parser, "tensor_parallel_size": engine.tensor_parallel_size,
        "max_model_len": engine.max_model_len, "scheduling_policy": engine.scheduling_policy, "dtype": engine.dtype,
    })
tools = ToolParserManager.list_registered()
reasoning = sorted(set(ReasoningParserManager.reasoning_parsers) | set(ReasoningParserManager.lazy_parsers))
print(json.dumps({"parsed": out, "tool_parsers": tools, "reasoning_parsers": reasoning}))
'''


def _parse(prepared: Any, argvs: list[list[str]]) -> dict[str, Any]:
    done = subprocess.run([str(prepared.python), "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=300, env={**os.environ, **prepared.engine_env()})
    assert done.returncode == 0, f"vLLM's parser refused the command line:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _args_after_module(argv: list[str]) -> list[str]:
    assert argv[1:3] == ["-m", MODULE], argv
    return argv[3:]


def test_vllm_parses_the_command_lines_the_launcher_builds(vllm_prepared: Any) -> None:  # noqa: F811
    prepared = vllm_prepared
    harmony = launch_command(
        "vllm", [], host="127.0.0.1", port=18001, model=str(prepared.oss_model), extra=["--dtype", "float32"],
        options=LaunchOptions(dialect="harmony", context_length=8192, tensor_parallel=2, tool_call_parser="openai",
                              reasoning_parser="openai_gptoss", priority=True, python=str(prepared.python)))
    chat = launch_command(
        "vllm", [], host="127.0.0.1", port=18002, model=str(prepared.chat_model), extra=[],
        options=LaunchOptions(context_length=32768, tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                              python=str(prepared.python)))
    plain = launch_command("vllm", [], host="127.0.0.1", port=18003, model=str(prepared.chat_model), extra=[],
                           options=LaunchOptions(python=str(prepared.python)))
    assert harmony[0] == str(prepared.python)  # the configured interpreter, not a bare python
    got = _parse(prepared, [_args_after_module(argv) for argv in (harmony, chat, plain)])
    oss, qwen, bare = got["parsed"]
    assert oss == {"model": str(prepared.oss_model), "host": "127.0.0.1", "port": 18001, "enable_scale_out": True,
                   "enable_prompt_tokens_details": True, "enable_auto_tool_choice": True, "tool_call_parser": "openai",
                   "reasoning_parser": "openai_gptoss", "tensor_parallel_size": 2, "max_model_len": 8192,
                   "scheduling_policy": "priority", "dtype": "float32"}
    assert (qwen["enable_scale_out"], qwen["enable_prompt_tokens_details"], qwen["tool_call_parser"], qwen["reasoning_parser"],
            qwen["max_model_len"], qwen["tensor_parallel_size"], qwen["scheduling_policy"]) == (
        False, True, "hermes", "deepseek_r1", 32768, 1, "fcfs")
    assert bare["enable_prompt_tokens_details"] and not bare["enable_scale_out"] and bare["tool_call_parser"] is None
    # The parser names used above are ones this vLLM knows (it checks them only when it starts).
    assert {"openai", "hermes"} <= set(got["tool_parsers"])
    assert {"openai_gptoss", "deepseek_r1"} <= set(got["reasoning_parsers"])


# What vLLM understands of a KV-events command line: its own KVEventsConfig, from the flag's JSON.
PARSE_KV = r'''
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs

argv = json.load(sys.stdin)
args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
kv = engine.kv_events_config
print(json.dumps({"prefix_caching": engine.enable_prefix_caching, "enabled": kv.enable_kv_cache_events,
                  "publisher": kv.publisher, "endpoint": kv.endpoint, "replay": kv.replay_endpoint, "topic": kv.topic}))
'''


def test_vllm_reads_the_kv_events_flags_the_launcher_builds(vllm_prepared: Any) -> None:  # noqa: F811
    from backends.engines import kv_event_endpoints

    prepared = vllm_prepared
    argv = launch_command("vllm", [], host="127.0.0.1", port=18004, model=str(prepared.chat_model), extra=[],
                          options=LaunchOptions(python=str(prepared.python), kv_events_dir="/tmp/rr-kv"))
    done = subprocess.run([str(prepared.python), "-c", PARSE_KV], input=json.dumps(_args_after_module(argv)),
                          capture_output=True, text=True, timeout=300, env={**os.environ, **prepared.engine_env()})
    assert done.returncode == 0, f"vLLM's parser refused the command line:\n{done.stderr[-4000:]}"
    got = json.loads(done.stdout.strip().splitlines()[-1])
    endpoint, replay = kv_event_endpoints("/tmp/rr-kv", 18004)
    assert got == {"prefix_caching": True, "enabled": True, "publisher": "zmq", "endpoint": endpoint, "replay": replay,
                   "topic": "kv"}
