"""What differs between engines: endpoints and launch commands.

Nothing about Responses here, only each engine's own HTTP surface.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    chat_path: str
    health_path: str
    models_path: str
    # Launch command template; {host}, {port} and {model} are filled in.
    command: tuple[str, ...]


ENGINES: dict[str, Engine] = {
    "vllm": Engine(
        name="vllm",
        chat_path="/v1/chat/completions",
        health_path="/health",
        models_path="/v1/models",
        command=("vllm", "serve", "{model}", "--host", "{host}", "--port", "{port}"),
    ),
    "sglang": Engine(
        name="sglang",
        chat_path="/v1/chat/completions",
        # SGLang's /health is 503 until a warm-up generation succeeded: a real readiness signal.
        health_path="/health",
        models_path="/v1/models",
        command=("python", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "{host}", "--port", "{port}"),
    ),
    "sim": Engine(
        name="sim",
        chat_path="/v1/chat/completions",
        health_path="/health",
        models_path="/v1/models",
        command=(sys.executable, "-m", "backends.sim", "--host", "{host}", "--port", "{port}", "--model", "{model}"),
    ),
}


def launch_command(engine: str, template: list[str], *, host: str, port: int, model: str, extra: list[str]) -> list[str]:
    parts = template or list(ENGINES[engine].command)
    return [part.format(host=host, port=port, model=model) for part in parts] + list(extra)


# How vLLM ("maximum context length", "too long to fit into the model") and SGLang
# ("longer than the model's context length") say a request does not fit the context.
_OVERFLOW = re.compile(r"maximum context length|too long to fit|longer than the model'?s context length|context length", re.I)


def is_context_overflow(status: int, message: str) -> bool:
    """A 400 that means prompt + max_tokens exceed the model's context window."""
    return status == 400 and bool(_OVERFLOW.search(message))
