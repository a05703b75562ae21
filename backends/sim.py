"""A simulated vLLM / SGLang worker: the engine's HTTP API without a model.

Demos, tests and benchmarks drive the router end to end with it on machines
that cannot run an engine: `/health`, `/v1/models`, `/metrics` and
`/v1/chat/completions` in the engine's wire shapes. Output is derived from the
messages; markers in the last user message script failures and timing:
`[sim:tokens=N]`, `[sim:status=CODE]`, `[sim:drop_after=K]`, `[sim:echo]`,
`[sim:ttft_ms=N]`, `[sim:itl_ms=N]`, `[sim:hang]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import re
import signal
import time
import uuid
from dataclasses import dataclass, field

import orjson
from aiohttp import web

VOCAB = tuple("the router streams tokens from a simulated worker while clients wait for answers "
              "and every request finds its pool quickly models think about cache prefix latency "
              "queue batch of small words today".split())
MARKER_RE = re.compile(r"\[sim:([A-Za-z_]+)(?:=([^\]\s]*))?\]")
ECHO_TOKEN_CHARS = 16
SGLANG_EOS_TOKEN_ID = 2  # SGLang's matched_stop names the stop token; here EOS
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 408: "RequestTimeoutError", 429: "RateLimitError",
                503: "ServiceUnavailableError"}


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


class SimError(Exception):
    """A request the engine would refuse; args are (status, message, param)."""


@dataclass
class Plan:
    """Everything one request will do, decided before any slot is taken."""

    tokens: list[str]
    finish_reason: str
    prompt_tokens: int
    stream: bool = False
    include_usage: bool = False
    ttft_s: float = 0.0
    itl_s: float = 0.0
    drop_after: int | None = None
    hang: bool = False
    status: int | None = None


# ---------------------------------------------------------------- pure helpers


def message_text(message: dict) -> str:
    """The text of one chat message: string content or its parts' `text`."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def last_user_text(messages: list[dict]) -> str:
    """Markers are read only from the last user message, so history replayed
    by the router (which may contain old markers) does not re-trigger them."""
    users = [m for m in messages if m.get("role") == "user"]
    return message_text(users[-1]) if users else ""


def parse_markers(text: str) -> dict[str, str | None]:
    """`[sim:NAME]` -> {NAME: None}; `[sim:NAME=VALUE]` -> {NAME: VALUE}."""
    return {m.group(1): m.group(2) for m in MARKER_RE.finditer(text)}


def int_marker(markers: dict[str, str | None], name: str) -> int | None:
    """An integer marker value, or None when absent or not a non-negative int."""
    value = markers.get(name)
    return int(value) if value and value.isdigit() else None


def count_prompt_tokens(messages: list[dict]) -> int:
    """Deterministic stand-in for a tokenizer: for each message 3 + the number
    of whitespace-separated words of its text content, plus 3 for the reply
    prefix (roughly what chat templates add)."""
    return 3 + sum(3 + len(message_text(m).split()) for m in messages)


def generate_tokens(messages: list[dict], n: int) -> list[str]:
    """N words picked by a hash keyed on the messages: same messages, same
    text; token 0 is a bare word, later tokens are " " + word."""
    seed = hashlib.blake2b(orjson.dumps(messages), digest_size=16).digest()
    words = []
    for i in range(n):
        h = hashlib.blake2b(i.to_bytes(4, "little"), key=seed, digest_size=2).digest()
        words.append(VOCAB[int.from_bytes(h, "little") % len(VOCAB)])
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def echo_tokens(messages: list[dict]) -> list[str]:
    """The messages as received, as JSON text, cut into 16-character tokens."""
    text = orjson.dumps(messages).decode()
    return [text[i:i + ECHO_TOKEN_CHARS] for i in range(0, len(text), ECHO_TOKEN_CHARS)]


def error_body(engine: str, status: int, message: str, param: str | None = None) -> dict:
    """vLLM nests the error under "error"; SGLang's ErrorResponse is flat
    (SGLang python/sglang/srt/entrypoints/openai/protocol.py, ErrorResponse)."""
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    err = {"message": message, "type": kind, "param": param, "code": status}
    if engine == "sglang":
        return {"object": "error", **err}
    return {"error": err}


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
        status = 400 if cfg.engine == "sglang" else 404
        raise SimError(status, f"The model `{body.get('model')}` does not exist.", "model")
    markers = parse_markers(last_user_text(messages))
    prompt = count_prompt_tokens(messages)
    status = int_marker(markers, "status")
    if status is not None and 400 <= status <= 599:
        return Plan([], "stop", prompt, status=status)
    budget = _check_length(cfg, prompt, _max_tokens(body))
    n = int_marker(markers, "tokens")
    tokens = (echo_tokens(messages) if "echo" in markers else
              generate_tokens(messages, cfg.default_tokens if n is None else min(n, budget + 1)))
    stream = bool(body.get("stream"))
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    ttft, itl = int_marker(markers, "ttft_ms"), int_marker(markers, "itl_ms")
    return Plan(tokens[:budget], "length" if len(tokens) > budget else "stop", prompt,
                stream=stream, include_usage=stream and bool(options.get("include_usage")),
                ttft_s=(cfg.ttft_ms if ttft is None else ttft) / 1000,
                itl_s=(cfg.itl_ms if itl is None else itl) / 1000,
                drop_after=int_marker(markers, "drop_after"), hang="hang" in markers)


def usage_body(engine: str, prompt: int, completion: int, stream: bool) -> dict:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
             "completion_tokens": completion}
    if engine == "sglang":  # SGLang UsageInfo always dumps both fields
        return {**usage, "prompt_tokens_details": None, "reasoning_tokens": 0}
    # vLLM dumps non-stream responses in full, stream chunks with exclude_unset
    return usage if stream else {**usage, "prompt_tokens_details": None}


def completion_body(cfg: SimConfig, cid: str, created: int, plan: Plan) -> dict:
    """A non-stream chat.completion in the engine's shape."""
    text = "".join(plan.tokens)
    usage = usage_body(cfg.engine, plan.prompt_tokens, len(plan.tokens), False)
    body = {"id": cid, "object": "chat.completion", "created": created, "model": cfg.model}
    if cfg.engine == "sglang":
        # SGLang protocol.py ChatCompletionResponseChoice / ChatMessage
        matched = SGLANG_EOS_TOKEN_ID if plan.finish_reason == "stop" else None
        message = {"role": "assistant", "content": text, "reasoning_content": None,
                   "tool_calls": None}
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": plan.finish_reason, "matched_stop": matched}
        return {**body, "choices": [choice], "usage": usage, "metadata": None}
    # vLLM's ChatCompletionResponse, dumped in full (nulls included)
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": plan.finish_reason, "stop_reason": None}
    return {**body, "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}


def chunk_body(cfg: SimConfig, cid: str, created: int, delta: dict,
               finish_reason: str | None = None) -> dict:
    """One chat.completion.chunk. SGLang always sends `matched_stop` (its sse_utils.py
    StreamChoice, used by serving_chat.py); vLLM adds `stop_reason` on the finish."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if cfg.engine == "sglang":
        choice["matched_stop"] = SGLANG_EOS_TOKEN_ID if finish_reason == "stop" else None
    elif finish_reason is not None:
        choice["stop_reason"] = None
    return {"id": cid, "object": "chat.completion.chunk", "created": created,
            "model": cfg.model, "choices": [choice]}


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


def render_metrics(engine: str, model: str, stats: Stats) -> str:
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
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the server


class SimWorker:
    """Per-process state: config, counters and the generation slots."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.stats = Stats()
        self.slots = asyncio.Semaphore(cfg.max_concurrency)

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
        """Yield tokens at the simulated inter-token pace (the caller waited
        the time to first token), counting them; stop early at drop_after."""
        for i, token in enumerate(plan.tokens[:plan.drop_after]):
            if i and plan.itl_s:
                await asyncio.sleep(plan.itl_s)
            self.stats.generation_tokens += 1
            yield token

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
        text = render_metrics(self.cfg.engine, self.cfg.model, self.stats)
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
            async for _ in self.produce(plan):
                pass
            if plan.drop_after is not None:
                return _drop(request)
            self.stats.success[plan.finish_reason] += 1
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
                first = {"role": "assistant", "content": ""}
                await _send(resp, chunk_body(cfg, cid, created, first))
                async for token in self.produce(plan):
                    await _send(resp, chunk_body(cfg, cid, created, {"content": token}))
                if plan.drop_after is not None:
                    return _drop(request)
                await _send(resp, chunk_body(cfg, cid, created, {}, plan.finish_reason))
                if plan.include_usage:
                    usage = usage_body(cfg.engine, plan.prompt_tokens, len(plan.tokens), True)
                    await _send(resp, {"id": cid, "object": "chat.completion.chunk",
                                       "created": created, "model": cfg.model, "choices": [],
                                       "usage": usage})
                await resp.write(b"data: [DONE]\n\n")
                self.stats.success[plan.finish_reason] += 1
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
    return app


async def serve(cfg: SimConfig) -> None:
    """Listen, print the ready line, run until SIGTERM/SIGINT."""
    runner = web.AppRunner(build_app(cfg), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    print(f"sim worker ready on http://{cfg.host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def parse_args(argv: list[str] | None = None) -> SimConfig:
    p = argparse.ArgumentParser(prog="python -m backends.sim", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="0 picks a free port")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    p.add_argument("--itl-ms", type=float, default=0.0, help="delay between tokens")
    p.add_argument("--max-concurrency", type=int, default=64, help="generating at once")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--default-tokens", type=int, default=12, help="unless a marker says")
    return SimConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    try:
        from uvloop import new_event_loop as loop_factory
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(cfg))


if __name__ == "__main__":
    main()
