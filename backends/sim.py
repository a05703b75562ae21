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
import contextlib
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from backends.sim_cache import (
    BLOCK_TOKENS,
    Prefill,
    PrefixCache,
    cache_metric_lines,
    chat_token_ids,
    reply_ids,
)
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

SGLANG_EOS_TOKEN_ID = 2  # SGLang's matched_stop names the stop token; here EOS


@dataclass(frozen=True)
class SimConfig:
    engine: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    max_concurrency: int = 64
    max_model_len: int = 4096
    default_tokens: int = 12
    reasoning_field: str | None = None
    dialect: str = "chat"  # harmony: gpt-oss token-level generate APIs (backends/sim_harmony.py)
    harmony_vocab_dir: str | None = None
    incremental_streaming_output: bool = False  # SGLang's flag: /generate streams deltas
    no_scale_out: bool = False  # vLLM without --enable-scale-out: no /inference/v1/generate
    kv_cache_blocks: int = 0  # prefix cache capacity in blocks; 0: no prefix cache
    kv_block_size: int = BLOCK_TOKENS
    prefill_us_per_token: float = 0.0  # added to the time to first token per uncached prompt token

    @property
    def reasoning_key(self) -> str:
        """vLLM renamed reasoning_content to reasoning (vllm#27752) and removed
        the old name (vllm#33402, early 2026), so 0.32 sends `reasoning`;
        SGLang's DeltaMessage/ChatMessage use `reasoning_content`."""
        if self.reasoning_field:
            return self.reasoning_field
        return "reasoning_content" if self.engine == "sglang" else "reasoning"


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


def _max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens")
    value = body.get("max_tokens") if value is None else value
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SimError(400, f"max_tokens must be at least 1, got {value}.", "max_tokens")
    return value


def _check_length(cfg: SimConfig, prompt: int, max_tokens: int | None) -> int:
    """The engine's context-length checks; returns the completion budget."""
    limit = cfg.max_model_len
    if prompt >= limit:
        raise SimError(400, f"This model's maximum context length is {limit} tokens. However, "
                       f"your request has {prompt} input tokens.", "messages")
    if max_tokens is None:
        return limit - prompt
    if prompt + max_tokens > limit:
        raise SimError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                       f"This model's maximum context length is {limit} tokens and your request "
                       f"has {prompt} input tokens ({max_tokens} > {limit} - {prompt}).",
                       "max_tokens")
    return max_tokens


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
    budget = _check_length(cfg, prompt, _max_tokens(body))
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


def _usage(cfg: SimConfig, plan: Plan, steps: list[Step], stream: bool) -> dict:
    return usage_body(cfg.engine, plan.prompt_tokens, steps, stream, cached=plan.cached,
                      parser=plan.parser)


def completion_body(cfg: SimConfig, cid: str, created: int, plan: Plan) -> dict:
    """A non-stream chat.completion in the engine's shape."""
    fields = message_fields(plan.steps, plan.calls, plan.forced)
    usage = _usage(cfg, plan, plan.steps, False)
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
        return {**body, "choices": [choice], "usage": usage, "metadata": None}
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
            "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}


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


@dataclass
class Stats:
    """Counters shared by all requests; only touched from the event loop."""

    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})


# The engines' names for the Stats fields, in _METRIC_FIELDS order.
_METRIC_NAMES = {"vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting",
                          "vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
                 "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                            "sglang:prompt_tokens_total", "sglang:generation_tokens_total")}
_METRIC_FIELDS = (("running", "gauge", "Requests generating now."),
                  ("waiting", "gauge", "Requests waiting for a generation slot."),
                  ("prompt_tokens", "counter", "Prefill tokens processed."),
                  ("generation_tokens", "counter", "Generation tokens processed."))


def render_metrics(engine: str, model: str, stats: Stats, cache: PrefixCache | None = None) -> str:
    """Prometheus text with the engine's metric and label names."""
    labels = f'model_name="{model}"' if engine == "sglang" else f'engine="0",model_name="{model}"'
    lines: list[str] = []
    for name, (attr, kind, help_) in zip(_METRIC_NAMES[engine], _METRIC_FIELDS):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                  f"{name}{{{labels}}} {float(getattr(stats, attr))}"]
    if engine == "vllm":
        name = "vllm:request_success_total"
        lines += [f"# HELP {name} Count of successfully processed requests.",
                  f"# TYPE {name} counter"]
        lines += [f'{name}{{{labels},finished_reason="{r}"}} {float(n)}'
                  for r, n in stats.success.items()]
    if cache is not None:
        lines += cache_metric_lines(engine, labels, cache)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the server


class SimWorker:
    """Per-process state: config, counters and the generation slots."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.stats = Stats()
        self.slots = asyncio.Semaphore(cfg.max_concurrency)
        self.cache = PrefixCache(cfg.kv_cache_blocks, cfg.kv_block_size)
        self.prefill = Prefill(self.cache, cfg.prefill_us_per_token)

    def remember(self, plan: Plan) -> None:
        """Cache the prompt and its answer as the next turn replays them."""
        if plan.prompt_ids is not None:
            f = message_fields(plan.steps, plan.calls, plan.forced)
            calls = [{"function": {"name": c.name, "arguments": a}} for _, c, a in f["tool_calls"]]
            self.cache.insert(plan.prompt_ids + reply_ids(f["content"], calls))

    @contextlib.asynccontextmanager
    async def slot(self, plan: Plan):
        """Wait (counted as waiting) for a generation slot, hold it (counted
        as running); the gauges go back down however the request ends."""
        self.stats.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.stats.waiting -= 1
        self.stats.running += 1
        self.stats.prompt_tokens += plan.prompt_tokens
        try:
            yield
        finally:
            self.stats.running -= 1
            self.slots.release()

    async def produce(self, plan: Plan):
        """Yield steps at the simulated inter-token pace (the caller waited
        the time to first token), counting tokens; stop early at drop_after."""
        steps = plan.steps if plan.drop_after is None else cut_steps(plan.steps,
                                                                      plan.drop_after)[0]
        started = False
        for step in steps:
            if step.tokens:
                if started and plan.itl_s:
                    await asyncio.sleep(plan.itl_s)
                started = True
                self.stats.generation_tokens += 1
            yield step

    def _running(self, plan: Plan, sent: list[Step]) -> dict | None:
        """Usage so far, on every chunk with stream_options.continuous_usage_stats."""
        return _usage(self.cfg, plan, sent, True) if plan.continuous_usage else None

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return _json(error_body(self.cfg.engine, status, message, param), status)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.cfg.model, "object": "model", "created": int(time.time()),
                "owned_by": self.cfg.engine, "root": self.cfg.model, "parent": None,
                "max_model_len": self.cfg.max_model_len}
        return _json({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.cfg.engine, self.cfg.model, self.stats, self.cache)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            plan = plan_request(orjson.loads(await request.read()), self.cfg)
        except orjson.JSONDecodeError as exc:
            return self.error(400, f"Invalid JSON body: {exc}")
        except SimError as exc:
            return self.error(*exc.args)
        if plan.status is not None:
            return self.error(plan.status, "simulated failure")
        if plan.stream:
            return await self._stream(request, plan)
        return await self._complete(request, plan)

    async def _complete(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        async with self.slot(plan):
            if plan.hang:
                await asyncio.Event().wait()  # cancelled when the client leaves
            await asyncio.sleep(plan.ttft_s)
            plan.cached = await self.prefill.run(plan.prompt_ids, plan.prompt_tokens, plan.cached)
            async for _ in self.produce(plan):
                pass
            if plan.drop_after is not None:
                return _drop(request)
            self.remember(plan)
            self.stats.success["length" if plan.finish_reason == "length" else "stop"] += 1
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        return _json(completion_body(self.cfg, cid, int(time.time()), plan))

    async def _stream(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        cfg, cid, created = self.cfg, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        try:
            if not plan.hang:  # like the engines: headers go out before the queue
                await resp.prepare(request)
            async with self.slot(plan):
                if plan.hang:
                    await asyncio.Event().wait()  # cancelled when the client leaves
                await asyncio.sleep(plan.ttft_s)
                plan.cached = await self.prefill.run(plan.prompt_ids, plan.prompt_tokens, plan.cached)
                sent: list[Step] = []
                first = {"role": "assistant", "content": ""}
                await _send(resp, chunk_body(cfg, cid, created, first, usage=self._running(
                    plan, sent)))
                async for step in self.produce(plan):
                    logprobs = logprobs_body([step], sum(s.tokens for s in sent),
                                             plan.top_logprobs) if plan.logprobs else None
                    sent.append(step)
                    delta = step_delta(cfg.engine, cfg.reasoning_key, step, plan.calls)
                    await _send(resp, chunk_body(cfg, cid, created, delta, logprobs=logprobs,
                                                 usage=self._running(plan, sent)))
                if plan.drop_after is not None:
                    return _drop(request)
                self.remember(plan)
                await _send(resp, chunk_body(cfg, cid, created, {}, plan.finish_reason,
                                             usage=self._running(plan, sent)))
                if plan.include_usage:
                    await _send(resp, {"id": cid, "object": "chat.completion.chunk",
                                       "created": created, "model": cfg.model, "choices": [],
                                       "usage": _usage(cfg, plan, plan.steps, True)})
                await resp.write(b"data: [DONE]\n\n")
                self.stats.success["length" if plan.finish_reason == "length" else "stop"] += 1
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left (a write failed); a disconnect while we sleep
            # cancels the handler instead (handler_cancellation); slot() cleans up
        return resp


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


def _drop(request: web.Request) -> web.StreamResponse:
    """Close the TCP connection mid-answer: what a crashed worker looks like.
    close() (not abort()) so chunks already written still reach the client."""
    if request.transport is not None:
        request.transport.close()
    return web.StreamResponse()


def build_app(cfg: SimConfig) -> web.Application:
    worker = SimWorker(cfg)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", worker.health)
    app.router.add_get("/v1/models", worker.models)
    app.router.add_get("/metrics", worker.metrics)
    app.router.add_post("/v1/chat/completions", worker.chat_completions)
    if cfg.dialect == "harmony":
        from backends.sim_harmony import add_harmony_routes
        add_harmony_routes(app, worker)
    return app


async def serve(cfg: SimConfig) -> None:
    """Listen, print the ready line, run until SIGTERM/SIGINT."""
    runner = web.AppRunner(build_app(cfg), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    # The listen backlog vLLM's and SGLang's servers (uvicorn) use; aiohttp's own is 128, which a burst
    # of new connections overflows while the loop is busy (the kernel then drops or resets them).
    await web.TCPSite(runner, cfg.host, cfg.port, backlog=2048).start()
    print(f"sim worker ready on http://{cfg.host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def parse_args(argv: list[str] | None = None, prog: str = "python -m backends.sim") -> SimConfig:
    return SimConfig(**vars(parser(prog).parse_args(argv)))


def parser(prog: str = "python -m backends.sim") -> argparse.ArgumentParser:
    """The sim's command line, every option explained (``--help``)."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n")[0] + " Markers in the last user message drive it "
        "([sim:tokens=N], [sim:status=CODE], [sim:hang], ...: the README's 'The simulated worker').",
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
