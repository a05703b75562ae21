"""Harmony mode of the simulated worker (`--dialect harmony`, gpt-oss pools): the
engines' token-level generate APIs answering with ids of the REAL harmony encoding.
Markers of the prompt's last user message: [sim:tokens=N] final words,
[sim:reason=N] analysis words (0: none), [sim:call=A,B] (arguments: the required
top-level fields of the developer message's tool types; without a marker, the function
the message mentions by a word of its name or description, backends/sim/tools.py),
[sim:builtin=browser.search|python], [sim:preamble] (commentary before the final),
[sim:garbage=N] (N random ids, <|return|>), [sim:chunk=N] ids per frame,
[sim:error_after=K], [sim:cached=N] (else the prefix cache's hit on the prompt ids),
and sim.py's timing and failures; a last tool message gets "tool said: ...". gpt-oss
ends a turn at its first <|call|>: all calls but the last end with <|end|>. A structured-output
constraint (vLLM's structured_outputs, SGLang's json_schema / structural_tag) holds the answer
as the engine would (backends/sim/harmony_script.py); a bad one gets the engine's 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from openai_harmony import HarmonyEncodingName, Role, load_harmony_encoding

from backends.sim.harmony_script import (
    CALL,
    END,
    RETURN,
    VOCAB_SIZE,
    constrained_text,
    cut_at_stop,
    garbage_ids,
    plan_answer,
    read_constraint,
    read_sampling,
    script_text,
)
from backends.sim.script import SimError, compact_json, error_body, int_marker, parse_markers

SGLANG_MAX_NEW_TOKENS = 128  # SGLang SamplingParams default
VLLM_COMPLETIONS_MAX_TOKENS = 16  # vLLM CompletionRequest default
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# `type NAME = (_: {`, `type NAME = (_: // the schema's description` (its `{` on a later line) or `type NAME = () => any;`
_TYPE_RE = re.compile(r"^type ([\w-]+) = \((?:_: (\{|//.*)|(\) => any;))$")
_PROP_RE = re.compile(r"^([\w-]+)(\?)?: (.+?),?(?:\s*//.*)?$")
_TS = {"string": "sim", "number": 1, "integer": 1, "boolean": True, "null": None}


def load_encoding(vocab_dir: str | None):
    """The gpt-oss encoding from `vocab_dir/o200k_base.tiktoken`; never downloads."""
    folder = vocab_dir or os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not folder or not (Path(folder) / "o200k_base.tiktoken").is_file():
        raise SystemExit(f"sim: --dialect harmony needs --harmony-vocab-dir DIR with o200k_base"
                         f".tiktoken (got {folder!r}; see `responses-router harmony-vocab`)")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(Path(folder).resolve())
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@dataclass
class PromptInfo:
    digest: str
    user_text: str = ""
    tool_output: str | None = None  # the prompt's last message is a tool's
    functions: dict[str, dict] = field(default_factory=dict)  # name -> arguments
    descriptions: dict[str, str] = field(default_factory=dict)  # name -> its // comment


def read_prompt(enc, ids: list[int]) -> PromptInfo:
    """The messages of a rendered prompt, up to its last message end."""
    info = PromptInfo(hashlib.blake2b(orjson.dumps(ids), digest_size=16).hexdigest())
    last = max((i for i, t in enumerate(ids) if t in (END, CALL, RETURN)), default=-1)
    try:
        messages = enc.parse_messages_from_completion_tokens(ids[:last + 1], role=None)
    except Exception:  # noqa: BLE001 - not a harmony prompt: the default answer
        return info
    for m in messages:
        text = "".join(getattr(c, "text", "") or "" for c in m.content)
        if m.author.role == Role.USER:
            info.user_text = text
        elif m.author.role == Role.DEVELOPER:
            info.functions, info.descriptions = function_args(text), function_descriptions(text)
        info.tool_output = text if m.author.role == Role.TOOL else None
    return info


def function_args(developer: str) -> dict[str, dict]:
    """`type NAME = (_: {...}) => any;` blocks (openai-harmony's TypeScript for the
    `functions` namespace) -> arguments with the required top-level fields. A described schema
    has `(_: // description` (more lines bare), then `{` alone; a described object field (or
    array items) `name:     // description`, then `{`; a block closing with `}[]` is an array."""
    out: dict[str, dict] = {}
    args: dict[str, Any] = {}
    state, depth, block = "between", 0, None  # "open": before a described block's `{`; block: a field valued by a block
    for s in (line.strip() for line in developer.splitlines()):
        if state == "between":
            if m := _TYPE_RE.match(s):
                out[m.group(1)] = args = {}
                state = "between" if m.group(3) else "body" if m.group(2) == "{" else "open"
                depth, block = 0, None
        elif state == "open":
            state = "body" if s == "{" else "open"
        elif depth == 0 and s.startswith("}) => any;"):
            state = "between"
        else:
            code = "" if s.startswith("//") else s.split(" //", 1)[0]
            opened = code.count("{") - code.count("}")
            if depth == 0 and (m := _PROP_RE.match(s)) and not m.group(2):
                kind = m.group(3).split(" | ")[0].strip()
                if opened > 0 or not kind:
                    args[m.group(1)], block = {}, m.group(1)  # an object, or `{...}[]` once it closes
                else:
                    args[m.group(1)] = orjson.loads(kind) if kind.startswith('"') else [] \
                        if kind.endswith("[]") else _TS.get(kind, {} if kind[:1] == "{" else "sim")
            depth += opened
            if depth == 0 and block is not None and code.startswith("}"):
                if code.startswith("}[]"):
                    args[block] = []
                block = None
    return out


def function_descriptions(developer: str) -> dict[str, str]:
    """The `// ...` lines right above each `type NAME = ...` of the `functions` namespace."""
    out: dict[str, str] = {}
    pending: list[str] = []
    inside = False  # in a type's argument block, whose `//` lines describe its fields
    for s in (line.strip() for line in developer.splitlines()):
        if inside:
            inside = not s.startswith("}) => any;")
        elif s.startswith("//"):
            pending.append(s[2:].strip())
        elif m := _TYPE_RE.match(s):
            out[m.group(1)] = " ".join(pending)
            inside, pending = bool(m.group(2)), []
        else:
            pending = []
    return out


def script_ids(enc, info: PromptInfo, markers: dict, default_tokens: int, constraint: dict | None = None,
               seed: bytes = b"", echo: str | None = None) -> list[int]:
    """The whole answer as harmony ids, before any cut (backends/sim/harmony_script.py), held to
    the request's constraint when it has one. The prompt ends with `<|start|>assistant`, so the
    first message starts at <|channel|>."""
    if (garbage := int_marker(markers, "garbage")) is not None:
        return garbage_ids(info.digest, garbage)
    answer = plan_answer(info, markers, default_tokens, seed, echo)
    text = script_text(answer) if constraint is None else constrained_text(constraint, answer)
    return list(enc.encode(text, allowed_special="all"))


def cut_ids(ids: list[int], stops: set[int], budget: int) -> tuple[list[int], str, int | None]:
    """(ids, finish, matched stop id); length is checked first (vLLM v1 check_stop, SGLang
    Req.check_finished); a matched stop id stays in the ids (output_ids_through_stop)."""
    for i, token in enumerate(ids[:budget]):
        if token in stops:
            return ids[:i + 1], ("length" if i + 1 == budget else "stop"), (
                None if i + 1 == budget else token)
    return ids[:budget], ("length" if len(ids) > budget or budget == 0 else "stop"), None


@dataclass
class Run:
    rid: str
    prompt: list[int]
    ids: list[int]
    finish: str  # stop | length
    matched: int | None
    budget: int
    markers: dict
    cached: int
    stop_str: str | None = None  # the stop string that ended it (then matched is None)
    skip_special: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = True  # vLLM completions: return_token_ids
    sent: list[int] = field(default_factory=list)
    text_sent: str = ""
    end: str | None = None  # abort | drop | error
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def prompt_tokens(self) -> int:  # SimWorker.slot counts it
        return len(self.prompt)

    @property
    def done(self) -> bool:
        return self.end is None and len(self.sent) == len(self.ids)

    @property
    def outcome(self) -> str | None:  # stop | length | abort | None (not finished)
        return "abort" if self.end == "abort" else self.finish if self.done else None


class HarmonySim:
    """The harmony routes' state; the SimWorker's config, counters and slots."""

    def __init__(self, worker, enc):
        self.worker, self.cfg, self.enc = worker, worker.cfg, enc
        self.runs: dict[str, Run] = {}

    def plan(self, prompt: object, rid: str, sp: dict, max_key: str, default: int | None, body: dict) -> Run:
        """Validate like the engine and decide the output ([sim:echo=request]: ``body`` without its ids)."""
        limit, least = self.cfg.max_model_len, 0 if self.cfg.engine == "sglang" else 1
        if not isinstance(prompt, list) or not prompt or any(type(t) is not int for t in prompt):
            raise SimError(400, "The prompt must be a non-empty list of token ids.", "token_ids")
        if bad := [t for t in prompt if not 0 <= t < VOCAB_SIZE]:
            raise SimError(400, f"Token id {bad[0]} is out of vocabulary", "token_ids")
        n, budget = len(prompt), sp.get(max_key, default)
        if budget is not None and (type(budget) is not int or budget < least):
            raise SimError(400, f"{max_key} must be at least {least}, got {budget}.", max_key)
        budget = limit - n if budget is None else budget
        if n >= limit or n + budget > limit:  # both engines' messages say "maximum context length"
            raise SimError(400, f"This model's maximum context length is {limit} tokens; the "
                           f"request has {n} input tokens and {budget} for the completion.",
                           "token_ids" if n >= limit else max_key)
        extra = given if isinstance(given := sp.get("stop_token_ids"), list) else []
        stops = set(extra) | (set() if sp.get("ignore_eos") else {RETURN, CALL})
        constraint = read_constraint(self.cfg.engine, sp)  # checked before the prompt is read
        seed, strings = read_sampling(self.cfg.engine, sp)
        markers = parse_markers((info := read_prompt(self.enc, prompt)).user_text)
        echo = compact_json({k: v for k, v in body.items() if k not in ("token_ids", "input_ids", "prompt")}) \
            if markers.get("echo") == "request" else None
        ids, finish, matched = cut_ids(script_ids(self.enc, info, markers, self.cfg.default_tokens, constraint, seed,
                                                  echo), stops, budget)
        ids, stop_str = cut_at_stop(self.enc, ids, strings)  # vLLM: a stop string wins over the length
        finish, matched = ("stop", None) if stop_str is not None else (finish, matched)
        return Run(rid, prompt, ids, finish, matched, budget, markers, min(int_marker(markers, "cached") or 0, n),
                   stop_str, sp.get("skip_special_tokens", True) is not False,
                   bool(sp.get("no_stop_trim") or sp.get("include_stop_str_in_output")))

    def text(self, run: Run, trim: bool) -> str:
        """Detokenized output: the matched stop id trimmed, special tokens skipped on request."""
        ids = run.sent[:-1] if trim and run.matched is not None and run.done else run.sent
        text = self.enc.decode([t for t in ids if not (run.skip_special and self.enc.is_special_token(t))])
        at = text.find(run.stop_str) if run.stop_str and run.done else -1  # the engine's text ends at it
        return text if at < 0 else text[:at + len(run.stop_str or "") if run.no_stop_trim else at]

    async def _wait(self, run: Run, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run.abort.wait(), seconds)

    async def generate(self, run: Run):
        """Frames of ids at the simulated pace; run.end says why they stopped early."""
        m, cfg = run.markers, self.cfg
        ttft, itl = (cfg.ttft_ms if (ttft_ms := int_marker(m, "ttft_ms")) is None else ttft_ms,
                     cfg.itl_ms if (itl_ms := int_marker(m, "itl_ms")) is None else itl_ms)
        if "hang" in m:
            await run.abort.wait()
        await self._wait(run, ttft / 1000)
        cached, prefill_s = self.worker.prefill.lookup(run.prompt, len(run.prompt), int_marker(m, "cached"))
        run.cached = cached or 0  # the prefix cache's hit on the real ids, unless a marker says
        if prefill_s > 0:
            async with self.worker.prefill.gpu:  # one prompt at a time (backends/sim/cache.py)
                await self._wait(run, prefill_s)
        cuts = {k: int_marker(m, k) for k in ("drop_after", "error_after")}
        limit = min([len(run.ids), *(v for v in cuts.values() if v is not None)])
        while len(run.sent) < limit:
            await self._wait(run, itl / 1000 if run.sent else 0)
            if run.abort.is_set():
                break
            new = run.ids[len(run.sent):min(limit, len(run.sent) + (int_marker(m, "chunk") or 1))]
            run.sent += new
            self.worker.stats.generation_tokens += len(new)
            yield new
        if run.abort.is_set() and len(run.sent) < len(run.ids):
            run.end = "abort"
        elif limit < len(run.ids):
            run.end = "drop" if cuts["drop_after"] == limit else "error"

    async def serve(self, request: web.Request, run: Run, wire) -> web.StreamResponse:
        if (status := int_marker(run.markers, "status")) is not None and 400 <= status <= 599:
            return self.error(status, "simulated failure")
        self.runs[run.rid] = run
        resp = web.StreamResponse(headers=_SSE)
        try:
            if run.stream and "hang" not in run.markers:  # headers go out before the queue
                await resp.prepare(request)
            async with self.worker.slot(run):
                async for new in self.generate(run):
                    if run.stream:
                        await _send(request, resp, wire(self, run, "chunk", new))
                if run.end == "drop":  # close the connection mid-answer: a crashed worker
                    if request.transport is not None:
                        request.transport.close()
                    return web.StreamResponse()
                if not run.stream:
                    return self.error(500, "simulated failure") if run.end == "error" else \
                        _json(wire(self, run, "complete", run.sent))
                for frame in [self.error_body(500, "simulated failure")] if run.end == "error" \
                        else wire(self, run, "tail"):
                    await _send(request, resp, frame)
                await _send(request, resp, b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; slot() cleans up
        finally:
            self.runs.pop(run.rid, None)
            if run.done:
                self.worker.stats.success["length" if run.finish == "length" else "stop"] += 1
                self.worker.cache.insert(run.prompt + run.sent)
        return resp

    def error_body(self, status: int, message: str, param: str | None = None) -> dict:
        """SGLang http_server.py's {"error": {"message"}} (in streams too), vLLM's ErrorResponse."""
        return {"error": {"message": message}} if self.cfg.engine == "sglang" else \
            error_body("vllm", status, message, param)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return _json(self.error_body(status, message, param), status)

    def abort(self, keys: list[str] | None) -> None:
        for rid, run in self.runs.items():
            if keys is None or rid in keys or rid.removeprefix("generate-tokens-") in keys:
                run.abort.set()

    def usage(self, run: Run, full: bool = False) -> dict:
        """vLLM UsageInfo (with --enable-prompt-tokens-details); `full`: with its nulls."""
        n, out = len(run.prompt), len(run.sent)
        usage = {"prompt_tokens": n, "total_tokens": n + out, "completion_tokens": out}
        details = {"cached_tokens": run.cached} if run.cached else None
        return {**usage, "prompt_tokens_details": details} if full or details else usage


async def _body(request: web.Request) -> dict:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise SimError(400, f"Invalid JSON body: {exc}", None) from None
    if isinstance(body, dict):
        return body
    raise SimError(400, "The request body must be a JSON object.", None)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def _send(request: web.Request, resp: web.StreamResponse, obj: dict | bytes) -> None:
    if not resp.prepared:  # a [sim:hang] stream sends its headers late
        await resp.prepare(request)
    await resp.write(obj if isinstance(obj, bytes) else b"data: " + orjson.dumps(obj) + b"\n\n")


def vllm_wire(sim: HarmonySim, run: Run, kind: str, new: Sequence[int] = ()) -> dict | list[dict]:
    """ServingTokens (vllm/entrypoints/serve/disagg/{protocol,serving}.py): complete ->
    GenerateResponse dumped in full (serving.py passes id=, which it ignores: the sim
    sends the engine id as request_id, as streams do); chunk -> GenerateStreamResponse
    per step with new ids (none for an abort); tail -> the include_usage chunk."""
    if kind == "tail":
        return [{"request_id": run.rid, "choices": [], "usage": sim.usage(run)}] \
            if run.include_usage else []
    choice = {"index": 0, "logprobs": None, "finish_reason": run.outcome, "token_ids": new}
    if kind == "chunk":
        return {"request_id": run.rid, "choices": [choice], "usage": None}
    return {"request_id": run.rid, "model": sim.cfg.model, "created": run.created,
            "choices": [{**choice, "routed_experts": None}], "usage": sim.usage(run, True),
            "prompt_logprobs": None, "kv_transfer_params": None}


def completions_wire(sim: HarmonySim, run: Run, kind: str, new: Sequence[int] = ()) -> dict | list:
    """vllm/entrypoints/openai/completion/{protocol,serving}.py: chunks dumped exclude_unset
    (all choice fields set), prompt_token_ids on the first, text without the stop token;
    stop_reason: the stop id, None for the primary EOS (<|return|>) and for length."""
    head = {"id": run.rid, "object": "text_completion", "created": run.created,
            "model": sim.cfg.model}
    if kind == "tail":
        return [{**head, "choices": [], "usage": sim.usage(run)}] if run.include_usage else []
    text, finish = sim.text(run, True), run.outcome
    delta, run.text_sent = text[len(run.text_sent):], text
    choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish,
              "stop_reason": run.stop_str or (run.matched if finish == "stop" and run.matched != RETURN else None),
              "token_ids": new if run.token_ids else None, "prompt_token_ids": run.prompt
              if run.token_ids and len(run.sent) == len(new) else None}
    if kind == "chunk":
        return {**head, "choices": [choice]}
    return {**head, "choices": [{**choice, "prompt_logprobs": None}], "service_tier": None,
            "system_fingerprint": None, "usage": sim.usage(run, True), "kv_transfer_params": None}


def sglang_wire(sim: HarmonySim, run: Run, kind: str, new: Sequence[int] = ()) -> dict | list:
    """sglang/srt/managers/tokenizer_manager.py _handle_batch_output; streams send
    cumulative text AND output_ids unless --incremental-streaming-output; finish_reason
    null until finished. detokenizer_manager.py trims the matched stop id from text
    only (not with no_stop_trim, nor <|call|> under the gpt-oss tool-call parser)."""
    if kind == "tail":  # an aborted stream still ends with a finished chunk
        return [sglang_wire(sim, run, "chunk")] if run.end == "abort" else []
    finishes: dict[str | None, dict[str, Any]] = {"abort": {"type": "abort", "message": "Abort request by user"},
                                                  "length": {"type": "length", "length": run.budget},
                                                  "stop": {"type": "stop", "matched": run.stop_str or run.matched}}
    finish = finishes.get(run.outcome)
    text = sim.text(run, not run.no_stop_trim and run.matched != CALL)
    meta: dict[str, Any] = {"id": run.rid, "finish_reason": finish, "prompt_tokens": len(run.prompt),
                            "weight_version": "default", "total_retractions": 0,
                            "completion_tokens": len(run.sent), "cached_tokens": run.cached}
    if finish is not None:
        meta["e2e_latency"] = round(time.monotonic() - run.started, 6)
    if kind == "chunk" and sim.cfg.incremental_streaming_output:
        text, run.text_sent = text[len(run.text_sent):], text
        return {"text": text, "output_ids": list(new), "meta_info": meta}
    return {"text": text, "output_ids": list(run.sent), "meta_info": meta}


def add_harmony_routes(app: web.Application, worker) -> HarmonySim:
    sim, cfg = HarmonySim(worker, load_encoding(worker.cfg.harmony_vocab_dir)), worker.cfg

    @web.middleware
    async def refuse(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except SimError as exc:  # what the engine would refuse, in its error shape
            return sim.error(*exc.args)

    async def vllm_generate(request: web.Request) -> web.StreamResponse:
        # GenerateRequest {request_id, token_ids, sampling_params, model, stream,
        # stream_options}; engine id "generate-tokens-" + (X-Request-Id or request_id).
        # CompletionRequest: prompt (token ids), max_tokens (default 16), return_token_ids.
        body, completions = await _body(request), request.path == "/v1/completions"
        if body.get("model") not in (None, cfg.model):
            raise SimError(404, f"The model `{body.get('model')}` does not exist.", "model")
        sp = body if completions else body.get("sampling_params")
        if not isinstance(sp, dict):
            raise SimError(400, "Field 'sampling_params' is required.", "sampling_params")
        base = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
        rid = f"{'cmpl' if completions else 'generate-tokens'}-{base}"
        run = sim.plan(body.get("prompt" if completions else "token_ids"), rid, sp, "max_tokens",
                       VLLM_COMPLETIONS_MAX_TOKENS if completions else None, body)
        opts = given if isinstance(given := body.get("stream_options"), dict) else {}
        run.stream = bool(body.get("stream"))
        run.include_usage = run.stream and bool(opts.get("include_usage"))
        run.token_ids = bool(body.get("return_token_ids"))
        return await sim.serve(request, run, completions_wire if completions else vllm_wire)

    async def abort(request: web.Request) -> web.Response:
        # vLLM disagg/api_router.py abort_requests {"request_ids": [...]}; SGLang http_server.py
        # abort_request (AbortReq {rid, abort_all}); both 200 without a body, unknown ids ignored
        body = await _body(request)
        if cfg.engine == "vllm" and not isinstance(body.get("request_ids"), list):
            raise SimError(400, "Missing 'request_ids' in request body", "request_ids")
        ids = body["request_ids"] if cfg.engine == "vllm" else [body.get("rid")]
        sim.abort(None if body.get("abort_all") else [str(i) for i in ids])
        return web.Response(status=200)

    async def sglang_generate(request: web.Request) -> web.StreamResponse:
        # io_struct.py GenerateReqInput {input_ids, sampling_params, stream, rid}
        body = await _body(request)
        sp = given if isinstance(given := body.get("sampling_params"), dict) else {}
        rid = named if isinstance(named := body.get("rid"), str) else uuid.uuid4().hex
        try:
            run = sim.plan(body.get("input_ids"), rid, sp, "max_new_tokens", SGLANG_MAX_NEW_TOKENS, body)
        except SimError as exc:
            if not body.get("stream"):
                raise
            resp = web.StreamResponse(headers=_SSE)  # a ValueError in the stream: 200 + error
            await _send(request, resp, sim.error_body(*exc.args))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        run.stream = bool(body.get("stream"))
        return await sim.serve(request, run, sglang_wire)

    async def sglang_server_info(request: web.Request) -> web.Response:
        # http_server.py get_server_info: the server args + scheduler info + version
        flag = cfg.incremental_streaming_output  # the older builds' name: stream_output
        return _json({"model_path": cfg.model, "served_model_name": cfg.model,
                      "context_length": cfg.max_model_len, "skip_tokenizer_init": False,
                      "incremental_streaming_output": flag, "stream_output": flag,
                      "reasoning_parser": "gpt-oss", "tool_call_parser": "gpt-oss",
                      "max_total_num_tokens": cfg.max_model_len * cfg.max_concurrency,
                      "internal_states": [{}], "version": "0.5.0-sim"})

    app.middlewares.append(refuse)
    if cfg.engine == "sglang":
        app.router.add_post("/generate", sglang_generate)
        app.router.add_post("/abort_request", abort)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, sglang_server_info)
    else:
        paths = ("/v1/completions",) if cfg.no_scale_out else ("/inference/v1/generate", "/v1/completions")
        for path in paths:
            app.router.add_post(path, vllm_generate)
        for path in ("/abort_requests", "/inference/v1/abort_requests"):
            app.router.add_post(path, abort)
    return sim

