"""Engine options (router/protocol/requests.py ENGINE_FIELDS) on a harmony pool's token-level calls.

One table says, per option and engine, where the option goes on the generate call and under which
name; prepare refuses what it does not list (``refused_on_generate``) and ``HarmonyTurn.request``
places the rest (``place_options``). The chat wire's table is router/dialects/chat.py ENGINE_OPTIONS.

Wire formats as the engines have them:
- vLLM 0.32 ``POST /inference/v1/generate`` (vllm/entrypoints/scale_out/token_in_token_out/protocol.py
  ``GenerateRequest``): top-level ``request_id``, ``priority``, ``cache_salt``; the rest in
  ``sampling_params`` (vllm/sampling_params.py ``SamplingParams``: seed, stop, top_k, min_p, the three
  penalties, logit_bias, stop_token_ids, ignore_eos, include_stop_str_in_output, ``extra_args``, which is
  what the chat call's ``vllm_xargs`` become). Unknown top-level fields are dropped without a word, so an
  option vLLM does not read there is refused, not sent. Its ``/v1/completions`` fallback
  (``CompletionRequest``) takes each under the request's own name, top level.
- SGLang ``POST /generate`` (python/sglang/srt/managers/io_struct.py ``GenerateReqInput``): top-level
  ``rid``, ``priority``, ``extra_key``; ``sampling_params`` (python/sglang/srt/sampling/sampling_params.py)
  with ``sampling_seed`` for the seed. SGLang's own OpenAI server sends ``cache_salt`` as the start of
  ``extra_key`` (serving_base.py ``_compute_extra_key``: cache_salt + extra_key): so does the router.

Values that meet on one wire field are joined: lists (``stop_token_ids`` after harmony's own stop ids,
which must stay) without repeats, two options' strings end to end (``cache_salt`` then ``extra_key``);
an option's value replaces the router's own otherwise (``request_id``).
"""

from __future__ import annotations

from typing import Any, Literal

# sampling: inside sampling_params; top: a field of the request; router: nothing on the wire (the
# router itself does what the option asks).
Where = Literal["sampling", "top", "router"]


def _sampling(name: str) -> dict[str, tuple[Where, str]]:
    return {"vllm": ("sampling", name), "sglang": ("sampling", name)}


# option -> engine ("vllm" or "sglang") -> (where, wire name). An engine missing: the option is refused there.
GENERATE_OPTIONS: dict[str, dict[str, tuple[Where, str]]] = {
    "seed": {"vllm": ("sampling", "seed"), "sglang": ("sampling", "sampling_seed")},
    # The engines check stop strings on their own detokenized text and return the ids through the token
    # that completes one (no harmony end token): the router cuts its text there (router/dialects/stop_strings.py).
    "stop": _sampling("stop"),
    "top_k": _sampling("top_k"),
    "min_p": _sampling("min_p"),
    "repetition_penalty": _sampling("repetition_penalty"),
    "presence_penalty": _sampling("presence_penalty"),
    "frequency_penalty": _sampling("frequency_penalty"),
    "logit_bias": _sampling("logit_bias"),
    "priority": {"vllm": ("top", "priority"), "sglang": ("top", "priority")},
    "cache_salt": {"vllm": ("top", "cache_salt"), "sglang": ("top", "extra_key")},
    # The client's id replaces the router's (the router cancels by closing the stream, not by id).
    "request_id": {"vllm": ("top", "request_id"), "sglang": ("top", "rid")},
    "stop_token_ids": _sampling("stop_token_ids"),  # merged after <|return|> and <|call|>
    "ignore_eos": _sampling("ignore_eos"),  # harmony's stop ids, always sent, still end the turn
    # The ids come back through the stop string either way: the router keeps it in the text or not.
    # SGLang's no_stop_trim is always on for harmony (the parser needs the end tokens): nothing to send.
    "include_stop_str_in_output": {"vllm": ("sampling", "include_stop_str_in_output"), "sglang": ("router", "")},
    "extra_key": {"sglang": ("top", "extra_key")},
    "vllm_xargs": {"vllm": ("sampling", "extra_args")},
}
# Options no harmony pool takes, whatever its engine, and why (the 400's words).
HARMONY_REFUSED: dict[str, str] = {
    "chat_template_kwargs": "the router renders gpt-oss's prompt tokens itself, so no chat template is used",
    "skip_special_tokens": "the router reads harmony's special tokens in the ids the engine returns, so they cannot be skipped",
    "session_id": "the engines' generate calls take no session id in the body (vLLM reads one from a header only, "
                  "SGLang's session_params need a session opened first)",
}


def wire_engine(engine: str) -> str:
    """The generate wire a pool's engine speaks: SGLang's, or vLLM's (the sim's harmony mode speaks it)."""
    return "sglang" if engine == "sglang" else "vllm"


def refused_on_generate(options: dict[str, Any], engine: str) -> tuple[str, str] | None:
    """(option, why) for the first option of ``options`` a harmony pool on ``engine`` cannot take; None: all fit."""
    wire = wire_engine(engine)
    for name in options:
        if name in HARMONY_REFUSED:
            return name, HARMONY_REFUSED[name]
        if wire not in GENERATE_OPTIONS[name]:
            return name, f"its engine ({engine}) does not take it on the generate call"
    return None


def place_options(body: dict[str, Any], options: dict[str, Any], engine: str, *, completions: bool = False) -> None:
    """Put ``options`` (prepare refused what does not fit) on a generate body, or, ``completions``, on
    vLLM's /v1/completions body (top level, under the request's names, ``vllm_xargs`` as it is)."""
    wire = wire_engine(engine)
    placed: set[tuple[str, str]] = set()  # (where, key) an option has set in this body
    for name, value in options.items():
        where, key = GENERATE_OPTIONS[name][wire]
        if where == "router":
            continue
        if completions:
            where, key = "top", name
        target = body["sampling_params"] if where == "sampling" else body
        given = target.get(key)
        if isinstance(given, list) and isinstance(value, list):
            target[key] = given + [v for v in value if v not in given]
        elif (where, key) in placed and isinstance(given, str) and isinstance(value, str):
            target[key] = given + value
        else:
            target[key] = value
        placed.add((where, key))
