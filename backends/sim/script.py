"""Pure output scripting for the simulated worker (backends/sim/).

Everything here is a function of the request body: the markers of the last
user message, what the answer is (words, reasoning, tool calls, JSON, a
refusal, an echo), how it is cut into tokens, and the engine-shaped deltas
and logprobs that carry those tokens. No I/O, so tests call it directly.
"""

from __future__ import annotations

import hashlib
import re
import uuid
import zlib
from dataclasses import dataclass, field

import orjson

from backends.sim.schema import VOCAB, SimError, compact_json, schema_instance
from backends.sim.tools import TEXT_MARKERS, mentioned_function

MARKER_RE = re.compile(r"\[sim:([A-Za-z_]+)(?:=([^\]\s]*))?\]")
ECHO_TOKEN_CHARS = 16
FRAGMENT_CHARS = 8  # JSON (tool arguments, structured output) goes out in 8-character tokens
REFUSAL_TEXT = "I can't help with that."
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_TOP_LOGPROBS = 20  # the OpenAI limit; both engines accept at least this many
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 408: "RequestTimeoutError", 429: "RateLimitError",
                503: "ServiceUnavailableError"}


@dataclass(frozen=True)
class Step:
    """One chunk of the answer. kind: content | reasoning | refusal | args (a
    fragment of tool call `call`'s arguments) | call (the call's header with
    id and name; carries no token)."""

    kind: str
    text: str = ""
    call: int = -1

    @property
    def tokens(self) -> int:
        return 0 if self.kind == "call" else 1


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Options:
    """The request fields that shape the output, validated."""

    tools: dict[str, object]  # name -> parameters schema, in request order
    tool_choice: str  # none | auto | required | named
    named: str | None
    parallel: bool
    response_format: dict | None  # json_object / json_schema only
    logprobs: bool
    top_logprobs: int
    descriptions: dict[str, str | None] = field(default_factory=dict)  # name -> description, request order


@dataclass
class Script:
    """The whole answer as steps, before any max_tokens cut."""

    steps: list[Step]
    calls: list[ToolCall]
    choice: str = "auto"  # how the calls were chosen: auto | required | named
    parser: bool = False  # [sim:reason] stands for a server with a reasoning parser


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
    of whitespace-separated words of its text content (and of its tool calls'
    names and arguments), plus 3 for the reply prefix (roughly what chat
    templates add)."""
    total = 3
    for m in messages:
        total += 3 + len(message_text(m).split())
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                total += len(f"{fn.get('name') or ''} {fn.get('arguments') or ''}".split())
    return total


def generate_tokens(messages: list[dict], n: int, salt: bytes = b"") -> list[str]:
    """N words picked by a hash keyed on the messages (and salt, so reasoning
    differs from the answer): same messages, same text; token 0 is a bare
    word, later tokens are " " + word."""
    seed = hashlib.blake2b(orjson.dumps(messages) + salt, digest_size=16).digest()
    words = []
    for i in range(n):
        h = hashlib.blake2b(i.to_bytes(4, "little"), key=seed, digest_size=2).digest()
        words.append(VOCAB[int.from_bytes(h, "little") % len(VOCAB)])
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def chop(text: str, size: int) -> list[str]:
    """Text cut into tokens of `size` characters."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def word_tokens(text: str) -> list[str]:
    """Text cut at single spaces, each later token keeping its space, so the
    tokens join back to exactly the text."""
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def read_options(body: dict) -> Options:
    """Validate the output-shaping fields like the engines' request models do
    (vLLM ChatCompletionRequest validators; SGLang protocol.py)."""
    tools: dict[str, object] = {}
    descriptions: dict[str, str | None] = {}
    for tool in body.get("tools") or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                tool.get("type", "function") != "function":
            raise SimError(400, "Each tool must be {'type': 'function', 'function': {'name'}}.",
                           "tools")
        tools[fn["name"]] = fn.get("parameters")
        description = fn.get("description")
        descriptions[fn["name"]] = description if isinstance(description, str) else None
    raw = body.get("tool_choice") or "auto"
    fn = raw.get("function") if isinstance(raw, dict) else None
    named = fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None
    if named is not None:
        choice = "named"
    elif raw in ("none", "auto", "required"):
        choice = raw
    else:
        raise SimError(400, f"Invalid 'tool_choice': {raw!r}.", "tool_choice")
    if choice in ("required", "named") and not tools:
        raise SimError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if named is not None and named not in tools:
        raise SimError(400, f"Tool '{named}' has not been passed in `tools`.", "tool_choice")
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is not None and (kind not in ("text", "json_object", "json_schema") or (
            kind == "json_schema" and not isinstance(fmt.get("json_schema"), dict))):
        raise SimError(400, "Invalid 'response_format'.", "response_format")
    if kind == "json_schema":
        assert isinstance(fmt, dict)  # kind came from it
        schema_instance(fmt["json_schema"].get("schema"))  # the engine compiles it before anything else
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise SimError(400, f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}.",
                       "top_logprobs")
    if top and not logprobs:
        raise SimError(400, "When using `top_logprobs`, `logprobs` must be set to true.",
                       "top_logprobs")
    if not isinstance(body.get("chat_template_kwargs") or {}, dict):
        raise SimError(400, "'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    return Options(tools, choice, named, body.get("parallel_tool_calls") is not False,
                   fmt if kind in ("json_object", "json_schema") else None, bool(logprobs),
                   top or 0, descriptions)


def call_id(engine: str) -> str:
    """vLLM's make_tool_call_id is f"chatcmpl-tool-{random_uuid()}" (vllm/entrypoints/
    chat_utils.py); SGLang's _process_tool_call_id is f"call_{uuid4().hex[:24]}"
    (python/sglang/srt/entrypoints/openai/serving_chat.py)."""
    return f"call_{uuid.uuid4().hex[:24]}" if engine == "sglang" else \
        f"chatcmpl-tool-{uuid.uuid4().hex}"


def pick_calls(messages: list[dict], markers: dict[str, str | None],
               opts: Options) -> tuple[list[str], str]:
    """The tools this turn calls and how they were chosen. A turn that answers
    a tool message, or tool_choice "none", never calls. Markers first; else the
    function the last user message mentions (backends/sim/tools.py), unless a
    marker scripts the text; else, for tool_choice "required", the first one."""
    if opts.tool_choice == "none" or messages[-1].get("role") == "tool":
        return [], "auto"
    if opts.named is not None:
        return [opts.named], "named"
    raw = markers.get("call")
    mentioned = None if raw or TEXT_MARKERS & markers.keys() else mentioned_function(
        last_user_text(messages), {name: opts.descriptions.get(name) for name in opts.tools})
    if raw:
        names = [n for n in raw.split(",") if n]
        unknown = [n for n in names if n not in opts.tools]
        if unknown:
            raise SimError(400, f"Tool '{unknown[0]}' has not been passed in `tools`.", "tools")
    elif mentioned is not None:
        names = [mentioned]
    elif opts.tool_choice == "required":
        names = [next(iter(opts.tools))]
    else:
        return [], "auto"
    return (names if opts.parallel else names[:1]), opts.tool_choice


def answer_tokens(body: dict, messages: list[dict], markers: dict[str, str | None],
                  opts: Options, default_tokens: int, limit: int) -> list[str]:
    """The text answer: an echo, JSON for response_format, the reply to a
    tool message, or generated words (at most `limit`)."""
    if "echo" in markers:
        if markers["echo"] == "request":
            rest = {k: v for k, v in body.items() if k != "messages"}
            return chop(compact_json(rest), ECHO_TOKEN_CHARS)
        return chop(compact_json(messages), ECHO_TOKEN_CHARS)
    fmt = opts.response_format
    if fmt is not None and fmt["type"] == "json_schema":
        return chop(compact_json(schema_instance(fmt["json_schema"].get("schema"))), FRAGMENT_CHARS)
    if fmt is not None:
        return chop(compact_json({"answer": generate_tokens(messages, 1)[0]}), FRAGMENT_CHARS)
    if messages[-1].get("role") == "tool":
        return word_tokens("tool said: " + message_text(messages[-1]))
    n = int_marker(markers, "tokens")
    return generate_tokens(messages, min(default_tokens if n is None else n, limit), seed_salt(body))


def seed_salt(body: dict) -> bytes:
    """The request's ``seed`` as a salt of the generated words: the same seed gives the same words,
    another seed others (the engines' sampling seed; without one the words depend on the prompt alone)."""
    seed = body.get("seed")
    if seed is None:
        return b""
    if type(seed) is not int:
        raise SimError(400, "'seed' must be an integer.", "seed")
    return b"seed=%d" % seed


def stop_strings(body: dict) -> list[str]:
    """The request's ``stop``, validated as vLLM's request model does (a string or a list of strings)."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise SimError(400, "'stop' must be a string or a list of strings.", "stop")
    return [s for s in stops if s]


def apply_stop(steps: list[Step], stops: list[str], keep: bool) -> list[Step]:
    """The answer cut before the first stop string its text holds (with it, when ``keep``: vLLM's
    include_stop_str_in_output): as the engines stop, the text after it is never generated."""
    text = "".join(s.text for s in steps if s.kind == "content")
    found = [(i, stop) for stop in stops if (i := text.find(stop)) >= 0]
    if not found:
        return steps
    at, stop = min(found)
    end = at + len(stop) if keep else at
    out: list[Step] = []
    seen = 0
    for step in steps:
        if step.kind != "content":
            out.append(step)
            continue
        if seen >= end:
            break
        piece = step.text[:end - seen]
        seen += len(step.text)
        if piece:
            out.append(Step("content", piece))
    return out


def build_script(engine: str, body: dict, messages: list[dict], markers: dict[str, str | None],
                 opts: Options, default_tokens: int, limit: int) -> Script:
    """Reasoning ([sim:reason] in the reasoning field, [sim:think] as <think>
    text), then tool calls, a refusal or the text answer."""
    steps: list[Step] = []
    reason, think = int_marker(markers, "reason"), int_marker(markers, "think")
    if reason is not None:
        steps += [Step("reasoning", t) for t in generate_tokens(messages, min(reason, limit), b"r" + seed_salt(body))]
    if think is not None:
        thought = generate_tokens(messages, min(think, limit), b"t")
        steps += [Step("content", t) for t in (THINK_OPEN, *thought, THINK_CLOSE)]
    names, choice = pick_calls(messages, markers, opts)
    calls = []
    for i, name in enumerate(names):
        args = compact_json(schema_instance(opts.tools[name]))
        calls.append(ToolCall(call_id(engine), name, args))
        steps.append(Step("call", call=i))
        steps += [Step("args", piece, i) for piece in chop(args, FRAGMENT_CHARS)]
    if not calls:
        if "refuse" in markers:
            steps += [Step("refusal", t) for t in word_tokens(REFUSAL_TEXT)]
        else:
            steps += [Step("content", t) for t in answer_tokens(
                body, messages, markers, opts, default_tokens, limit)]
            stops = stop_strings(body)
            if stops:
                # kept with the text: vLLM's include_stop_str_in_output, SGLang's no_stop_trim
                keep = body.get("include_stop_str_in_output") is True or body.get("no_stop_trim") is True
                steps = apply_stop(steps, stops, keep)
    return Script(steps, calls, choice, parser=reason is not None)


def cut_steps(steps: list[Step], budget: int) -> tuple[list[Step], bool]:
    """The steps that fit `budget` tokens, and whether any were cut; a call
    header whose arguments were all cut goes too."""
    out: list[Step] = []
    used = 0
    for step in steps:
        if step.tokens and used == budget:
            while out and out[-1].kind == "call":
                out.pop()
            return out, True
        out.append(step)
        used += step.tokens
    return out, False


def step_delta(engine: str, reasoning_field: str, step: Step, calls: list[ToolCall]) -> dict:
    """The chunk delta that carries one step.

    vLLM dumps DeltaMessage/DeltaToolCall with exclude_unset (vllm/entrypoints/
    openai/chat_completion/serving.py, generate/base/protocol.py): a call's
    header has id, type, index and function.name; fragments only index and
    function.arguments. SGLang's tool-call chunks are pydantic ToolCall/
    DeltaMessage dumped whole (serving_chat.py _process_tool_call_stream), so
    id and name are null on fragments and the other delta keys are null; its
    text and reasoning chunks (sse_utils.py build_sse_content) omit nulls."""
    if step.kind == "content":
        return {"content": step.text}
    if step.kind == "reasoning":
        return {reasoning_field: step.text}
    if step.kind == "refusal":
        return {"refusal": step.text}  # OpenAI's shape; neither engine generates refusals
    call, header = calls[step.call], step.kind == "call"
    if engine == "sglang":
        tc = {"id": call.id if header else None, "index": step.call, "type": "function",
              "function": {"name": call.name if header else None,
                           "arguments": "" if header else step.text}}
        return {"role": None, "content": None, "reasoning_content": None, "tool_calls": [tc]}
    if header:
        tc = {"id": call.id, "type": "function", "index": step.call,
              "function": {"name": call.name, "arguments": ""}}
    else:
        tc = {"index": step.call, "function": {"arguments": step.text}}
    return {"tool_calls": [tc]}


def _logprob(token: str, value: float) -> dict:
    return {"token": token, "logprob": value, "bytes": list(token.encode())}


def token_logprob(token: str, position: int, top: int) -> dict:
    """One `logprobs.content` entry (vLLM ChatCompletionLogProbsContent, SGLang
    ChatCompletionTokenLogprob: token, logprob, bytes, top_logprobs). The
    sampled token is always the most likely; the alternatives are other
    vocabulary words, each 0.5 less likely than the one before."""
    value = -round(0.01 * (1 + zlib.crc32(f"{position}:{token}".encode()) % 90), 2)
    lead = " " if token.startswith(" ") else ""
    alternatives = [lead + w for w in VOCAB if lead + w != token]
    start = position % len(alternatives)
    tops = [_logprob(token, value)] + [
        _logprob(alternatives[(start + j) % len(alternatives)], round(value - 0.5 * j, 2))
        for j in range(1, top)]
    return {**_logprob(token, value), "top_logprobs": tops[:top]}


def message_fields(steps: list[Step], calls: list[ToolCall], forced: bool) -> dict:
    """content / reasoning / refusal / tool calls of a non-stream message.
    Content is null beside tool calls the model chose, "" beside forced ones
    (vLLM: `content or ""` for named/required; SGLang: `"" if is_required`)."""
    def join(kind: str) -> str | None:
        parts = [s.text for s in steps if s.kind == kind]
        return "".join(parts) if parts else None

    sent = sorted({s.call for s in steps if s.kind == "call"})
    tool_calls = [(i, calls[i], "".join(s.text for s in steps if s.kind == "args" and s.call == i))
                  for i in sent]
    content = join("content")
    refusal = join("refusal")
    if content is None and refusal is None:
        content = "" if forced or not tool_calls else None
    return {"content": content, "reasoning": join("reasoning"), "refusal": refusal,
            "tool_calls": tool_calls}


def logprobs_body(steps: list[Step], first: int, top: int) -> dict | None:
    """`choices[0].logprobs` for the tokens of `steps`, the first at position `first`."""
    tokens = [s.text for s in steps if s.tokens]
    return {"content": [token_logprob(t, first + i, top) for i, t in enumerate(tokens)]} \
        if tokens else None


def usage_body(engine: str, prompt: int, steps: list[Step], stream: bool, *,
               cached: int | None = None, parser: bool = False) -> dict:
    """Usage for `steps`. SGLang's UsageInfo always dumps prompt_tokens_details
    and a flat reasoning_tokens (protocol.py). vLLM's UsageInfo has
    completion_tokens_details.reasoning_tokens only with a reasoning parser
    (vllm#45802) and prompt_tokens_details only with
    --enable-prompt-tokens-details; non-stream responses are dumped in full,
    the stream's usage chunk with exclude_none (chat_completion/serving.py)."""
    completion = sum(s.tokens for s in steps)
    reasoning = sum(s.kind == "reasoning" for s in steps)
    usage: dict = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                   "completion_tokens": completion}
    details = None if cached is None else {"cached_tokens": min(cached, prompt)}
    if engine == "sglang":
        return {**usage, "prompt_tokens_details": details, "reasoning_tokens": reasoning}
    extra = {"prompt_tokens_details": details,
             "completion_tokens_details": {"reasoning_tokens": reasoning} if parser else None}
    return {**usage, **({k: v for k, v in extra.items() if v is not None} if stream else extra)}


def error_body(engine: str, status: int, message: str, param: str | None = None) -> dict:
    """vLLM nests the error under "error"; SGLang's ErrorResponse is flat
    (SGLang python/sglang/srt/entrypoints/openai/protocol.py, ErrorResponse)."""
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    err = {"message": message, "type": kind, "param": param, "code": status}
    return {"object": "error", **err} if engine == "sglang" else {"error": err}
