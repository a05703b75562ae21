"""What one chat-completions request to the simulated worker will do, decided up front.

``plan_request`` validates the body as the engine does (its 400s in the engine's
words, backends/sim/context.py for the context window) and scripts the answer
(backends/sim/script.py) before any generation slot is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.sim.cache import chat_token_ids
from backends.sim.config import SimConfig
from backends.sim.context import completion_budget
from backends.sim.script import (
    SimError,
    Step,
    ToolCall,
    build_script,
    count_prompt_tokens,
    cut_steps,
    int_marker,
    last_user_text,
    parse_markers,
    read_options,
)


@dataclass
class Plan:
    """Everything one request will do, decided before any slot is taken."""

    steps: list[Step]
    finish_reason: str
    prompt_tokens: int
    calls: list[ToolCall] = field(default_factory=list)
    forced: bool = False  # tool_choice required/named made the calls
    parser: bool = False  # report reasoning tokens as an engine with a reasoning parser does
    cached: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ttft_s: float = 0.0
    itl_s: float = 0.0
    drop_after: int | None = None
    hang: bool = False
    status: int | None = None
    prompt_ids: list[int] | None = None  # for the prefix cache, when it is on

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.steps)


def plan_request(body: object, cfg: SimConfig) -> Plan:
    """Validate a chat-completions body like the engine does and decide the
    output. Raises SimError for what the engine would refuse."""
    if not isinstance(body, dict):
        raise SimError(400, "The request body must be a JSON object.", None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) for m in messages):
        raise SimError(400, "Field 'messages' is required: a non-empty list of messages.",
                       "messages")
    if body.get("model") not in (None, cfg.model):  # both engines default a missing model
        raise SimError(400 if cfg.engine == "sglang" else 404, f"The model `{body.get('model')}` does not exist.", "model")
    markers = parse_markers(last_user_text(messages))
    prompt = count_prompt_tokens(messages)
    status = int_marker(markers, "status")
    if status is not None and 400 <= status <= 599:
        return Plan([], "stop", prompt, status=status)
    opts = read_options(body)
    budget = completion_budget(cfg.engine, body, prompt, cfg.max_model_len)
    script = build_script(cfg.engine, body, messages, markers, opts, cfg.default_tokens, budget + 1)
    steps, cut = cut_steps(script.steps, budget)
    # vLLM finishes a named tool_choice with "stop" and auto/required calls with
    # "tool_calls" (chat_completion/serving.py); SGLang says "tool_calls" for all.
    named_stop = cfg.engine == "vllm" and script.choice == "named"
    finish = "length" if cut else "tool_calls" if script.calls and not named_stop else "stop"
    stream = bool(body.get("stream"))
    options = given if isinstance(given := body.get("stream_options"), dict) else {}
    include_usage = stream and bool(options.get("include_usage"))
    ttft, itl = int_marker(markers, "ttft_ms"), int_marker(markers, "itl_ms")
    return Plan(steps, finish, prompt, calls=script.calls,
                forced=script.choice in ("required", "named"), parser=script.parser,
                cached=int_marker(markers, "cached"), logprobs=opts.logprobs,
                top_logprobs=opts.top_logprobs, stream=stream, include_usage=include_usage,
                continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
                ttft_s=(cfg.ttft_ms if ttft is None else ttft) / 1000,
                itl_s=(cfg.itl_ms if itl is None else itl) / 1000,
                drop_after=int_marker(markers, "drop_after"), hang="hang" in markers,
                prompt_ids=chat_token_ids(messages) if cfg.kv_cache_blocks > 0 else None)
