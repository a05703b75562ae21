"""The simulated worker's answers in each engine's wire shape: a whole chat.completion
and the chat.completion.chunk frames of a stream (vLLM's and SGLang's protocol models)."""

from __future__ import annotations

from backends.sim.config import SimConfig
from backends.sim.plan import Plan
from backends.sim.script import Step, logprobs_body, message_fields, usage_body

SGLANG_EOS_TOKEN_ID = 2  # SGLang's matched_stop names the stop token; here EOS


def usage(cfg: SimConfig, plan: Plan, steps: list[Step], stream: bool) -> dict:
    return usage_body(cfg.engine, plan.prompt_tokens, steps, stream, cached=plan.cached,
                      parser=plan.parser)


def completion_body(cfg: SimConfig, cid: str, created: int, plan: Plan) -> dict:
    """A non-stream chat.completion in the engine's shape."""
    fields = message_fields(plan.steps, plan.calls, plan.forced)
    counted = usage(cfg, plan, plan.steps, False)
    body = {"id": cid, "object": "chat.completion", "created": created, "model": cfg.model}
    logprobs = logprobs_body(plan.steps, 0, plan.top_logprobs) if plan.logprobs else None
    if cfg.engine == "sglang":
        # SGLang protocol.py ChatCompletionResponseChoice / ChatMessage / ToolCall
        calls = [{"id": c.id, "index": i, "type": "function",
                  "function": {"name": c.name, "arguments": args}}
                 for i, c, args in fields["tool_calls"]]
        matched = SGLANG_EOS_TOKEN_ID if plan.finish_reason == "stop" else None
        message = {"role": "assistant", "content": fields["content"],
                   cfg.reasoning_key: fields["reasoning"], "tool_calls": calls or None}
        if fields["refusal"] is not None:  # not an SGLang field: the OpenAI shape
            message["refusal"] = fields["refusal"]
        choice = {"index": 0, "message": message, "logprobs": logprobs,
                  "finish_reason": plan.finish_reason, "matched_stop": matched}
        return {**body, "choices": [choice], "usage": counted, "metadata": None}
    # vLLM's ChatCompletionResponse dumped in full (nulls included); ChatMessage
    # drops an empty tool_calls list (chat_completion/protocol.py)
    message = {"role": "assistant", "content": fields["content"], "refusal": fields["refusal"],
               "annotations": None, "audio": None, "function_call": None}
    if fields["tool_calls"]:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": args}}
                                 for _, c, args in fields["tool_calls"]]
    message[cfg.reasoning_key] = fields["reasoning"]
    choice = {"index": 0, "message": message, "logprobs": logprobs,
              "finish_reason": plan.finish_reason, "stop_reason": None}
    return {**body, "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": counted, "prompt_logprobs": None, "kv_transfer_params": None}


def chunk_body(cfg: SimConfig, cid: str, created: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None,
               usage: dict | None = None) -> dict:
    """One chat.completion.chunk. SGLang always sends `matched_stop` (its sse_utils.py
    StreamChoice, used by serving_chat.py) and a null `usage` on pydantic-dumped
    tool-call chunks; vLLM adds `stop_reason` on the finish."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if cfg.engine == "sglang":
        choice["matched_stop"] = SGLANG_EOS_TOKEN_ID if finish_reason == "stop" else None
    elif finish_reason is not None:
        choice["stop_reason"] = None
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created,
             "model": cfg.model, "choices": [choice]}
    if usage is not None or (cfg.engine == "sglang" and "tool_calls" in delta):
        chunk["usage"] = usage
    return chunk
