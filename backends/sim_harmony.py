"""Harmony mode of the simulated worker (`--dialect harmony`): gpt-oss pools.

The engines' token-level generate APIs, answering with ids made by the REAL
harmony encoding (openai-harmony, o200k_harmony). The prompt ids are parsed
back into messages; markers in the last user message script the answer (see
backends/sim.py for timing and failures): `[sim:tokens=N]` final words,
`[sim:reason=N]` analysis words (0: none), `[sim:call=A,B]` function calls,
`[sim:builtin=browser.search|python]`, `[sim:preamble]` (commentary before the
final), `[sim:garbage=N]` (N random ids, then <|return|>), `[sim:chunk=N]` ids
per stream frame, `[sim:error_after=K]` (an error frame after K ids),
`[sim:cached=N]`. A prompt whose last message is a tool's is answered
"tool said: ...". gpt-oss emits one call per turn (<|call|> ends it); for
`[sim:call=A,B]` every call but the last ends with <|end|>, so both come in
one turn. Arguments are filled from the developer message's TypeScript tool
types (required top-level fields only; `{}` when unreadable).

vLLM (`--engine vllm`): POST /inference/v1/generate, /abort_requests (and
/inference/v1/abort_requests), /v1/completions with token-id prompts. SGLang:
POST /generate, /abort_request, GET /server_info, /get_server_info.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

from backends.sim_script import SimError, error_body, generate_tokens, int_marker, parse_markers

RETURN, CALL = 200002, 200012  # <|return|>, <|call|>: gpt-oss's generation_config eos ids
VOCAB_SIZE = 201088  # o200k_harmony (gpt-oss vocab_size)
REASON_WORDS = 4
SGLANG_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
VLLM_COMPLETIONS_MAX_TOKENS = 16  # vLLM CompletionRequest.max_tokens default
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_TYPE_RE = re.compile(r"^type ([\w-]+) = \((_: \{)?(\) => any;)?$")
_PROP_RE = re.compile(r"^([\w-]+)(\?)?: (.+?),?(?:\s*//.*)?$")


def load_encoding(vocab_dir: str | None):
    """The gpt-oss encoding, from `vocab_dir/o200k_base.tiktoken` (never downloaded)."""
    folder = vocab_dir or os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not folder or not (Path(folder) / "o200k_base.tiktoken").is_file():
        raise SystemExit(f"sim: --dialect harmony needs --harmony-vocab-dir with o200k_base.tiktoken "
                         f"(got {folder!r}; `responses-router harmony-vocab DIR` writes it)")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(Path(folder).resolve())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


# ---------------------------------------------------------------- the prompt


@dataclass
class PromptInfo:
    user_text: str = ""
    tool_output: str | None = None  # the last message is a tool's
    functions: dict[str, dict] = field(default_factory=dict)  # name -> arguments
    digest: str = ""


def read_prompt(enc, ids: list[int]) -> PromptInfo:
    """Messages of a rendered prompt (up to its last <|end|>/<|call|>/<|return|>)."""
    from openai_harmony import Role
    info = PromptInfo(digest=hashlib.blake2b(orjson.dumps(ids), digest_size=16).hexdigest())
    ends = [i for i, t in enumerate(ids) if t in (200007, CALL, RETURN)]
    try:
        messages = enc.parse_messages_from_completion_tokens(ids[:ends[-1] + 1], role=None) if ends else []
    except Exception:  # noqa: BLE001 - not a harmony prompt: default answer
        return info
    def text(m) -> str:
        return "".join(getattr(c, "text", "") or "" for c in m.content)
    for m in messages:
        if m.author.role == Role.USER:
            info.user_text = text(m)
        elif m.author.role == Role.DEVELOPER:
            info.functions = function_args(text(m))
    if messages and messages[-1].author.role == Role.TOOL:
        info.tool_output = text(messages[-1])
    return info


def function_args(developer: str) -> dict[str, dict]:
    """`type NAME = (_: {...}) => any;` blocks of the developer message's `functions`
    namespace (openai-harmony's TypeScript rendering) -> arguments with every
    required top-level field filled."""
    out: dict[str, dict] = {}
    name, depth, args = None, 0, {}
    for line in developer.splitlines():
        s = line.strip()
        if name is None:
            m = _TYPE_RE.match(s)
            if m and m.group(3):
                out[m.group(1)] = {}
            elif m and m.group(2):
                name, depth, args = m.group(1), 0, {}
            continue
        if depth == 0 and s.startswith("}) => any;"):
            out[name], name = args, None
            continue
        m = _PROP_RE.match(s)
        if depth == 0 and m and not m.group(2):
            args[m.group(1)] = _ts_value(m.group(3).strip())
        depth += s.count("{") - s.count("}")
    return out


def _ts_value(kind: str) -> object:
    if kind.startswith('"'):
        m = re.match(r'"((?:[^"\\]|\\.)*)"', kind)
        return json.loads(m.group(0)) if m else "sim"
    if " | " in kind:
        return _ts_value(kind.split(" | ")[0])
    if kind.endswith("[]") or kind.startswith("Array"):
        return []
    return {"string": "sim", "number": 1, "integer": 1, "boolean": True, "null": None}.get(
        kind, {} if kind.startswith("{") else "sim")


def script_ids(enc, info: PromptInfo, markers: dict, default_tokens: int) -> list[int]:
    """The whole answer as harmony token ids, before any cut."""
    garbage = int_marker(markers, "garbage")
    if garbage is not None:
        rng = random.Random(info.digest)
        return [t for t in (rng.randrange(VOCAB_SIZE) for _ in range(garbage * 2))
                if t not in (RETURN, CALL)][:garbage] + [RETURN]
    seed = [{"prompt": info.digest}]
    def words(n: int, salt: bytes) -> str:
        return "".join(generate_tokens(seed, n, salt))
    msgs: list[str] = []
    reason = int_marker(markers, "reason")
    reason = REASON_WORDS if reason is None else reason
    if reason:
        msgs.append(f"<|channel|>analysis<|message|>{words(reason, b'r')}<|end|>")
    if info.tool_output is not None:
        msgs.append(f"<|channel|>final<|message|>tool said: {info.tool_output}<|return|>")
        return _encode(enc, msgs)
    if "preamble" in markers:
        msgs.append(f"<|channel|>commentary<|message|>{words(3, b'p')}<|end|>")
    calls = []
    for name in (markers.get("call") or "").split(","):
        if name:
            args = orjson.dumps(info.functions.get(name, {})).decode()
            calls.append(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}")
    for name in (markers.get("builtin") or "").split(","):
        if name:  # gpt-oss calls its built-in tools on the analysis channel
            query = re.sub(r"\[sim:[^\]]*\]", "", info.user_text).strip() or "sim"
            args = "print(1 + 1)" if name == "python" else orjson.dumps(
                {"query": query, "topn": 10} if name.endswith("search") else {}).decode()
            calls.append(f"<|channel|>analysis to={name} code<|message|>{args}")
    if calls:
        msgs += [c + "<|end|>" for c in calls[:-1]] + [calls[-1] + "<|call|>"]
    else:
        n = int_marker(markers, "tokens")
        msgs.append(f"<|channel|>final<|message|>{words(default_tokens if n is None else n, b'')}"
                    "<|return|>")
    return _encode(enc, msgs)


def _encode(enc, msgs: list[str]) -> list[int]:
    # The prompt ends with <|start|>assistant, so the first message starts at <|channel|>.
    return list(enc.encode("<|start|>assistant".join(msgs), allowed_special="all"))


def cut_ids(ids: list[int], stops: set[int], budget: int) -> tuple[list[int], str, int | None]:
    """Generation as the engines end it: the length cap is checked before the
    stop tokens (vLLM v1 check_stop; SGLang Req.check_finished), and a matched
    stop token stays in the output ids (SGLang output_ids_through_stop)."""
    for i, token in enumerate(ids[:budget]):
        if token in stops:
            return ids[:i + 1], ("length" if i + 1 == budget else "stop"), (
                None if i + 1 == budget else token)
    return ids[:budget], "length" if len(ids) > budget or budget == 0 else "stop", None


# ---------------------------------------------------------------- one request


@dataclass
class Run:
    rid: str
    prompt: list[int]
    ids: list[int]
    finish: str
    matched: int | None
    budget: int
    markers: dict
    stream: bool = False
    include_usage: bool = False
    continuous: bool = False
    skip_special: bool = True
    no_stop_trim: bool = False
    token_ids: bool = True  # vLLM completions: return_token_ids
    logprobs: int | None = None
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
    def cached(self) -> int | None:
        n = int_marker(self.markers, "cached")
        return None if n is None else min(n, len(self.prompt))

    @property
    def done(self) -> bool:
        return self.end is None and len(self.sent) == len(self.ids)


class HarmonySim:
    """The harmony routes of one SimWorker (its cfg, stats and slots)."""

    def __init__(self, worker, enc):
        self.worker, self.cfg, self.enc = worker, worker.cfg, enc
        self.runs: dict[str, Run] = {}

    def plan(self, prompt: object, rid: str, sp: dict, max_key: str, default_max: int | None,
             ignore_eos: bool) -> Run:
        cfg = self.cfg
        if not isinstance(prompt, list) or not prompt or not all(
                type(t) is int for t in prompt):
            raise SimError(400, "The prompt must be a non-empty list of token ids.", "token_ids")
        bad = [t for t in prompt if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise SimError(400, f"Token id {bad[0]} is out of vocabulary", "token_ids")
        info = read_prompt(self.enc, prompt)
        markers = parse_markers(info.user_text)
        limit, n = cfg.max_model_len, len(prompt)
        budget = sp.get(max_key, default_max)
        if budget is not None and (type(budget) is not int or budget < (
                0 if cfg.engine == "sglang" else 1)):
            raise SimError(400, f"{max_key} must be at least 1, got {budget}.", max_key)
        if n >= limit:
            raise SimError(400, f"The input ({n} tokens) is longer than the model's context "
                           f"length ({limit} tokens)." if cfg.engine == "sglang" else
                           f"This model's maximum context length is {limit} tokens. However, "
                           f"your request has {n} input tokens.", "token_ids")
        budget = limit - n if budget is None else budget
        if n + budget > limit:
            raise SimError(400, f"This model's maximum context length is {limit} tokens. You "
                           f"requested {n + budget} tokens ({n} in the input, {budget} for the "
                           f"completion).", max_key)
        extra = sp.get("stop_token_ids") or []
        stops = set(extra if isinstance(extra, list) else []) | (
            set() if ignore_eos else {RETURN, CALL})
        ids, finish, matched = cut_ids(script_ids(self.enc, info, markers, cfg.default_tokens),
                                       stops, budget)
        return Run(rid, prompt, ids, finish, matched, budget, markers,
                   skip_special=sp.get("skip_special_tokens", True) is not False,
                   no_stop_trim=bool(sp.get("no_stop_trim")))

    def timing(self, run: Run) -> tuple[float, float, int]:
        ttft, itl = int_marker(run.markers, "ttft_ms"), int_marker(run.markers, "itl_ms")
        return ((self.cfg.ttft_ms if ttft is None else ttft) / 1000,
                (self.cfg.itl_ms if itl is None else itl) / 1000,
                max(int_marker(run.markers, "chunk") or 1, 1))

    def text(self, run: Run, ids: list[int], trim: bool) -> str:
        """Detokenized output: the matched stop token trimmed, specials skipped on request."""
        if trim and run.matched is not None and ids and ids[-1] == run.matched:
            ids = ids[:-1]
        if run.skip_special:
            ids = [t for t in ids if not self.enc.is_special_token(t)]
        return self.enc.decode(ids)

    async def _wait(self, run: Run, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.abort.wait(), seconds)

    async def generate(self, run: Run):
        """Yield the output in frames at the simulated pace; stop at an abort,
        drop_after or error_after (run.end says which)."""
        ttft, itl, chunk = self.timing(run)
        if "hang" in run.markers:
            await run.abort.wait()
        await self._wait(run, ttft)
        cuts = {k: int_marker(run.markers, k) for k in ("drop_after", "error_after")}
        cuts = {k: v for k, v in cuts.items() if v is not None and v < len(run.ids)}
        limit = min([len(run.ids), *cuts.values()])
        while len(run.sent) < limit:
            if run.sent:
                await self._wait(run, itl)
            if run.abort.is_set():
                run.end = "abort"
                return
            new = run.ids[len(run.sent):min(limit, len(run.sent) + chunk)]
            run.sent += new
            self.worker.stats.generation_tokens += len(new)
            yield new
        if run.abort.is_set() and not run.done:
            run.end = "abort"
        elif limit < len(run.ids):
            run.end = "drop" if cuts.get("drop_after") == limit else "error"

    async def serve(self, request: web.Request, run: Run, fmt) -> web.StreamResponse:
        if run.rid in self.runs:
            return self.error(400, f"Request id {run.rid} is already running.")
        self.runs[run.rid] = run
        try:
            if run.stream:
                return await self._stream(request, run, fmt)
            async with self.worker.slot(run):
                async for _ in self.generate(run):
                    pass
                if run.end == "drop":
                    return _drop(request)
                if run.end == "error":
                    return self.error(500, "simulated failure")
                self._count(run)
            return _json(fmt.complete(run))
        finally:
            self.runs.pop(run.rid, None)

    async def _stream(self, request: web.Request, run: Run, fmt) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE)
        try:
            if "hang" not in run.markers:  # like the engines: headers go out before the queue
                await resp.prepare(request)
            async with self.worker.slot(run):
                async for new in self.generate(run):
                    if not resp.prepared:
                        await resp.prepare(request)
                    await _send(resp, fmt.chunk(run, new))
                if not resp.prepared:
                    await resp.prepare(request)
                if run.end == "drop":
                    return _drop(request)
                if run.end == "error":
                    await _send(resp, self.error_frame("simulated failure"))
                else:
                    for frame in fmt.tail(run):
                        await _send(resp, frame)
                    self._count(run)
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; slot() and serve() clean up
        return resp

    def _count(self, run: Run) -> None:
        if run.end is None:
            self.worker.stats.success["length" if run.finish == "length" else "stop"] += 1

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        if self.cfg.engine == "sglang":  # native /generate: {"error": {"message"}} (http_server.py)
            return _json({"error": {"message": message}}, status)
        return _json(error_body("vllm", status, message, param), status)

    def error_frame(self, message: str) -> dict:
        """An error after the 200: SGLang http_server.py stream_results; vLLM
        create_streaming_error_response (an ErrorResponse)."""
        if self.cfg.engine == "sglang":
            return {"error": {"message": message}}
        return error_body("vllm", 500, message)

    def abort(self, keys: list[str] | None) -> None:
        for rid, run in self.runs.items():
            if keys is None or rid in keys or rid.removeprefix("generate-tokens-") in keys:
                run.abort.set()

    def usage(self, run: Run, full: bool = False) -> dict:
        """vLLM UsageInfo (prompt_tokens_details as with --enable-prompt-tokens-details);
        `full`: dumped with its nulls (non-stream), else exclude_none (usage chunks)."""
        n, out = len(run.prompt), len(run.sent)
        usage = {"prompt_tokens": n, "total_tokens": n + out, "completion_tokens": out}
        details = {"cached_tokens": run.cached} if run.cached else None
        return {**usage, "prompt_tokens_details": details} if full or details else usage


async def _body(request: web.Request) -> dict:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise SimError(400, f"Invalid JSON body: {exc}", None) from None
    if not isinstance(body, dict):
        raise SimError(400, "The request body must be a JSON object.", None)
    return body


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


def _drop(request: web.Request) -> web.StreamResponse:
    if request.transport is not None:
        request.transport.close()
    return web.StreamResponse()


def _vllm_logprobs(ids: list[int], top: int) -> dict:
    """ServingTokens._create_tokens_logprobs: "token_id:N" tokens, at least one top entry."""
    def lp(t: int) -> float:
        return -round(0.01 * (1 + t % 90), 2)
    return {"content": [{"token": f"token_id:{t}", "logprob": lp(t), "bytes": None, "top_logprobs": [
        {"token": f"token_id:{u}", "logprob": lp(t) - 0.5 * j, "bytes": None}
        for j, u in enumerate([t, *range(t + 1, t + max(top, 1))][:max(top, 1)])]} for t in ids]}


# ---------------------------------------------------------------- the wire shapes


class VllmGenerate:
    """vllm/entrypoints/serve/disagg/protocol.py + serving.py (ServingTokens):
    GenerateResponse dumped in full; stream chunks GenerateStreamResponse
    {request_id, choices[{index, logprobs, finish_reason, token_ids}], usage},
    only for steps with new ids (an abort adds no chunk), finish_reason on the
    last; the usage chunk (choices: [], exclude_none) with include_usage."""

    def __init__(self, sim: HarmonySim):
        self.sim = sim

    def _choice(self, run: Run, ids: list[int], finish: str | None) -> dict:
        logprobs = None if run.logprobs is None else _vllm_logprobs(ids, run.logprobs)
        return {"index": 0, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}

    def finish(self, run: Run) -> str:
        return "abort" if run.end == "abort" else run.finish

    def complete(self, run: Run) -> dict:
        # serving.py passes id=request_id, which GenerateResponse ignores (its field is
        # request_id); the sim sends the engine request id there, as the stream does.
        usage = self.sim.usage(run, full=True)
        return {"request_id": run.rid, "model": self.sim.cfg.model, "created": run.created,
                "choices": [{**self._choice(run, run.sent, self.finish(run)),
                             "routed_experts": None}],
                "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}

    def chunk(self, run: Run, new: list[int]) -> dict:
        usage = self.sim.usage(run) if run.continuous else None
        return {"request_id": run.rid, "choices": [self._choice(
            run, new, run.finish if run.done else None)], "usage": usage}

    def tail(self, run: Run) -> list[dict]:
        return [{"request_id": run.rid, "choices": [], "usage": self.sim.usage(run)}] \
            if run.include_usage else []


class VllmCompletions(VllmGenerate):
    """vllm/entrypoints/openai/completion/{protocol,serving}.py: CompletionResponse;
    stream chunks dumped exclude_unset (every choice field is set), prompt_token_ids
    on the first chunk, text deltas without the stop token; stop_reason = the
    stop token id, None for the primary EOS (<|return|>) and for length."""

    def _stop_reason(self, run: Run) -> int | None:
        return run.matched if run.end is None and run.matched != RETURN else None

    def complete(self, run: Run) -> dict:
        choice = {"index": 0, "text": self.sim.text(run, run.sent, True), "logprobs": None,
                  "finish_reason": self.finish(run), "stop_reason": self._stop_reason(run),
                  "token_ids": run.sent if run.token_ids else None, "prompt_logprobs": None,
                  "prompt_token_ids": run.prompt if run.token_ids else None}
        return {"id": run.rid, "object": "text_completion", "created": run.created,
                "model": self.sim.cfg.model, "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": self.sim.usage(run, full=True),
                "kv_transfer_params": None}

    def chunk(self, run: Run, new: list[int]) -> dict:
        text = self.sim.text(run, run.sent, run.done)
        delta, run.text_sent = text[len(run.text_sent):], text
        first = len(run.sent) == len(new)
        chunk = {"id": run.rid, "object": "text_completion", "created": run.created,
                 "model": self.sim.cfg.model, "choices": [{
                     "index": 0, "text": delta, "logprobs": None,
                     "finish_reason": run.finish if run.done else None,
                     "stop_reason": self._stop_reason(run) if run.done else None,
                     "prompt_token_ids": run.prompt if first and run.token_ids else None,
                     "token_ids": new if run.token_ids else None}]}
        if run.continuous:
            chunk["usage"] = self.sim.usage(run)
        return chunk

    def tail(self, run: Run) -> list[dict]:
        return [{"id": run.rid, "object": "text_completion", "created": run.created,
                 "model": self.sim.cfg.model, "choices": [], "usage": self.sim.usage(run)}] \
            if run.include_usage else []


class SglangGenerate:
    """python/sglang/srt/managers/tokenizer_manager.py _handle_batch_output:
    {text, output_ids, meta_info{id, finish_reason, prompt_tokens, weight_version,
    total_retractions, completion_tokens, cached_tokens, (e2e_latency)}}; streams
    cumulative text/output_ids unless --incremental-streaming-output (deltas);
    finish_reason {"type":"stop","matched":ID} | {"type":"length","length":N} |
    {"type":"abort",...} | null; the detokenizer trims the matched stop token
    from text only (unless no_stop_trim)."""

    def __init__(self, sim: HarmonySim):
        self.sim = sim

    def _finish(self, run: Run) -> dict | None:
        if run.end == "abort":
            return {"type": "abort", "message": "Abort request by user", "status_code": None,
                    "err_type": None}
        if not run.done:
            return None
        if run.finish == "length":
            return {"type": "length", "length": run.budget}
        return {"type": "stop", "matched": run.matched}

    def _out(self, run: Run, new: list[int], final: bool) -> dict:
        sim, finish = self.sim, self._finish(run)
        text = sim.text(run, run.sent, not run.no_stop_trim and finish is not None)
        meta = {"id": run.rid, "finish_reason": finish, "prompt_tokens": len(run.prompt),
                "weight_version": "default", "total_retractions": 0,
                "completion_tokens": len(run.sent), "cached_tokens": run.cached or 0}
        if finish is not None:
            meta["e2e_latency"] = round(time.monotonic() - run.started, 6)
        if run.stream and sim.cfg.incremental_streaming_output and not final:
            delta, run.text_sent = text[len(run.text_sent):], text
            return {"text": delta, "output_ids": new, "meta_info": meta}
        return {"text": text, "output_ids": list(run.sent), "meta_info": meta}

    def complete(self, run: Run) -> dict:
        return self._out(run, run.sent, True)

    def chunk(self, run: Run, new: list[int]) -> dict:
        return self._out(run, new, False)

    def tail(self, run: Run) -> list[dict]:
        return [self._out(run, [], False)] if run.end == "abort" else []


# ---------------------------------------------------------------- the handlers


def add_harmony_routes(app: web.Application, worker) -> HarmonySim:
    sim = HarmonySim(worker, load_encoding(worker.cfg.harmony_vocab_dir))
    cfg = worker.cfg

    def guard(handler):
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except SimError as exc:
                return sim.error(*exc.args)
        return wrapped

    def failure(run: Run) -> web.Response | None:
        status = int_marker(run.markers, "status")
        return sim.error(status, "simulated failure") if status and 400 <= status <= 599 else None

    def check_model(body: dict) -> None:
        if body.get("model") not in (None, cfg.model):
            raise SimError(404, f"The model `{body.get('model')}` does not exist.", "model")

    def stream_opts(run: Run, body: dict) -> Run:
        run.stream = bool(body.get("stream"))
        opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        run.include_usage = run.stream and bool(opts.get("include_usage"))
        run.continuous = run.include_usage and bool(opts.get("continuous_usage_stats"))
        return run

    async def vllm_generate(request: web.Request) -> web.StreamResponse:
        # GenerateRequest {request_id, token_ids, sampling_params, model, stream,
        # stream_options}; the engine id is "generate-tokens-" + (X-Request-Id or request_id).
        body = await _body(request)
        check_model(body)
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            raise SimError(400, "Field 'sampling_params' is required.", "sampling_params")
        base = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
        run = stream_opts(sim.plan(body.get("token_ids"), f"generate-tokens-{base}", sp,
                                   "max_tokens", None, bool(sp.get("ignore_eos"))), body)
        run.logprobs = sp.get("logprobs")
        return failure(run) or await sim.serve(request, run, VllmGenerate(sim))

    async def vllm_completions(request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = list(sim.enc.encode(prompt, allowed_special="all"))
        run = stream_opts(sim.plan(prompt, f"cmpl-{uuid.uuid4().hex}", body, "max_tokens",
                                   VLLM_COMPLETIONS_MAX_TOKENS, bool(body.get("ignore_eos"))), body)
        run.token_ids = bool(body.get("return_token_ids"))
        return failure(run) or await sim.serve(request, run, VllmCompletions(sim))

    async def vllm_abort(request: web.Request) -> web.Response:
        # disagg/api_router.py abort_requests: {"request_ids": [...]} -> 200, empty
        ids = (await _body(request)).get("request_ids")
        if not isinstance(ids, list):
            raise SimError(400, "Missing 'request_ids' in request body", "request_ids")
        sim.abort([str(i) for i in ids])
        return web.Response(status=200)

    async def sglang_generate(request: web.Request) -> web.StreamResponse:
        # io_struct.py GenerateReqInput {text | input_ids, sampling_params, stream, rid}
        body = await _body(request)
        sp = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
        rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
        prompt = body.get("input_ids")
        if prompt is None and isinstance(body.get("text"), str):
            prompt = list(sim.enc.encode(body["text"], allowed_special="all"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            raise SimError(400, "sim: batched input_ids are not supported", "input_ids")
        try:
            run = sim.plan(prompt, rid, sp, "max_new_tokens",
                           SGLANG_MAX_NEW_TOKENS, bool(sp.get("ignore_eos")))
        except SimError as exc:
            if not body.get("stream"):
                raise
            resp = web.StreamResponse(headers=_SSE)  # ValueError inside the stream: 200 + error
            await resp.prepare(request)
            await _send(resp, sim.error_frame(exc.args[1]))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        run.stream = bool(body.get("stream"))
        return failure(run) or await sim.serve(request, run, SglangGenerate(sim))

    async def sglang_server_info(request: web.Request) -> web.Response:
        # http_server.py get_server_info: server args + scheduler info + version
        flag = cfg.incremental_streaming_output
        return _json({"model_path": cfg.model, "served_model_name": cfg.model,
                      "context_length": cfg.max_model_len, "skip_tokenizer_init": False,
                      "incremental_streaming_output": flag, "stream_output": flag,
                      "reasoning_parser": "gpt-oss", "tool_call_parser": "gpt-oss",
                      "max_total_num_tokens": cfg.max_model_len * cfg.max_concurrency,
                      "max_req_input_len": cfg.max_model_len - 1,
                      "internal_states": [{}], "version": "0.5.0-sim"})

    async def sglang_abort(request: web.Request) -> web.Response:
        # http_server.py abort_request(AbortReq{rid, abort_all}) -> 200; unknown rids ignored
        body = await _body(request)
        sim.abort(None if body.get("abort_all") else [str(body.get("rid"))])
        return web.Response(status=200)

    if cfg.engine == "sglang":
        app.router.add_post("/generate", guard(sglang_generate))
        app.router.add_post("/abort_request", guard(sglang_abort))
        app.router.add_get("/server_info", sglang_server_info)
        app.router.add_get("/get_server_info", sglang_server_info)
    else:
        app.router.add_post("/inference/v1/generate", guard(vllm_generate))
        app.router.add_post("/abort_requests", guard(vllm_abort))
        app.router.add_post("/inference/v1/abort_requests", guard(vllm_abort))
        app.router.add_post("/v1/completions", guard(vllm_completions))
    return sim
