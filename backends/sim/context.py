"""The engines' context-window checks on a chat-completions request, in their own words.

vLLM 0.32 (``vllm/renderers/params.py`` TokenizeParams, ``v1/engine/input_processor.py``
``_validate_prompt_len``, ``entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``):
``max_tokens`` above ``max_model_len`` is a 400 whatever the prompt; a prompt longer than the
context is a 400 (its tokenizer stops counting at ``max_model_len + 1``, hence "at least"), one
exactly as long is the input processor's 400; otherwise ``max_tokens`` is clamped to the room
left, ``min(max_tokens, max_model_len - prompt)``, silently. A ``VLLMValidationError``'s text
ends with ``(parameter=..., value=...)`` and its ``param`` is the parameter.

SGLang (``python/sglang/srt/managers/tokenizer_manager.py`` ``_validate_one_request``, without
``--allow-auto-truncate``): a prompt of the context's length or more is a 400; so is
``prompt + max_new_tokens >= context_len``; without ``max_tokens`` the scheduler lets the
answer run to the context less one. Its chat endpoint answers these ``ValueError``s as 400
``BadRequestError`` with ``param: null``.
"""

from __future__ import annotations

from backends.sim.script import SimError


def requested_max_tokens(body: dict) -> tuple[int | None, str]:
    """The body's completion limit and the field that gave it (vLLM reads
    max_completion_tokens first, as ChatCompletionRequest.build_tok_params does)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SimError(400, f"max_tokens must be at least 1, got {value}.", key)
    return value, key


def completion_budget(engine: str, body: dict, prompt: int, limit: int) -> int:
    """The tokens the answer may take, or the engine's 400 (SimError) for the context."""
    max_tokens, key = requested_max_tokens(body)
    if engine == "sglang":
        return _sglang_budget(prompt, max_tokens, limit)
    return _vllm_budget(prompt, max_tokens, key, limit)


def _vllm_budget(prompt: int, max_tokens: int | None, key: str, limit: int) -> int:
    if max_tokens is not None and max_tokens > limit:
        raise SimError(400, f"{key}={max_tokens} cannot be greater than max_model_len={limit}. "
                       f"Please request fewer output tokens. (parameter={key}, value={max_tokens})", key)
    if prompt > limit:
        seen = limit + 1  # the tokenizer truncates at max_input_tokens + 1
        raise SimError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                       f"contains at least {seen} input tokens, which exceeds this limit even without any "
                       f"output tokens. Please reduce the length of the input prompt. "
                       f"(parameter=input_tokens, value={seen})", "input_tokens")
    if prompt == limit:
        raise SimError(400, f"The decoder prompt (length {prompt}) plus the number of requested output tokens "
                       f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                       "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                       "output tokens).", None)
    room = limit - prompt
    return room if max_tokens is None else min(max_tokens, room)


def _sglang_budget(prompt: int, max_tokens: int | None, limit: int) -> int:
    if prompt >= limit:
        raise SimError(400, f"The input ({prompt} tokens) is longer than the model's context length "
                       f"({limit} tokens).", None)
    if max_tokens is not None and max_tokens + prompt >= limit:
        raise SimError(400, "Requested token count exceeds the model's maximum context length of "
                       f"{limit} tokens. You requested a total of {max_tokens + prompt} tokens: {prompt} "
                       f"tokens from the input messages and {max_tokens} tokens for the completion. Please "
                       "reduce the number of tokens in the input messages or the completion to fit within "
                       "the limit.", None)
    return limit - prompt - 1 if max_tokens is None else max_tokens
