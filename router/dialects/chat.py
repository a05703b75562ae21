"""Responses items <-> chat completions, as vLLM and SGLang speak them.

Pure translation: no I/O, so it is tested on plain data. ``to_messages`` and
``build_request`` make the worker's request; ``ChatDecoder`` turns its
answer (streamed chunks or one whole completion) into normalized deltas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from router.dialects.chat_chunks import NOT_AN_OBJECT, ChunkDecoder, chunk_object
from router.dialects.deltas import Delta, Finish, ReasoningDelta, ReasoningText, RefusalDelta, TextDelta, ToolCallDelta, Usage
from router.dialects.think import ThinkSplitter
from router.protocol.errors import InvalidRequest
from router.protocol.ids import new_id
from router.protocol.items import Item
from router.protocol.requests import CreateResponse, engine_options
from router.protocol.tools import FIND_IN_PAGE, OPEN_PAGE, ToolSet, engine_name

ReasoningEffortAs = Literal["reasoning_effort", "enable_thinking", "thinking", "drop"]


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What a pool's engine and chat template accept (set per pool in config)."""

    # "merge": all system/developer text becomes ONE leading system message (many templates allow no other).
    system_messages: Literal["merge", "keep"] = "merge"
    # The assistant field that gives the model its earlier reasoning back; None: reasoning stays out of the prompt.
    reasoning_field: str | None = None
    # The model writes its reasoning inside <think>...</think> in the content (served without a reasoning parser).
    think_tags: bool = False
    # How reasoning.effort reaches the engine: a top-level field, a chat_template_kwargs switch, or not at all.
    reasoning_effort_as: ReasoningEffortAs = "reasoning_effort"
    # Whether the engine takes "file" content parts.
    accepts_files: bool = False
    # "data_only": image and file URLs other than data: are refused (400), as the engine would fetch them.
    media_urls: Literal["any", "data_only"] = "any"
    # The pool's engine (vllm, sglang, sim): which engine options it takes, and under which names.
    engine: str = "vllm"
    # The pool's engine schedules by request priority: service_tier "priority" / "flex" become one.
    honor_service_tier: bool = False


# Engine options (router/protocol/requests.py ENGINE_FIELDS) -> the chat-completions field each engine
# takes it as; an engine missing from a field's entry does not take it (a 400 naming the field and the
# pool, router/turns/prepare.py). vLLM: its ChatCompletionRequest has every field of its ResponsesRequest
# under the same name (vllm/entrypoints/openai/chat_completion/protocol.py, 0.32). SGLang's
# ChatCompletionRequest (python/sglang/srt/entrypoints/openai/protocol.py): the request id is ``rid``,
# the stop string kept is ``no_stop_trim``; it has no vllm_xargs. The sim takes what it honours:
# ``seed`` (its words are drawn with it) and ``stop`` (its answer ends before the first stop string).
_BOTH = {"vllm": "", "sglang": ""}
ENGINE_OPTIONS: dict[str, dict[str, str]] = {
    "seed": {**_BOTH, "sim": ""},
    "stop": {**_BOTH, "sim": ""},
    "top_k": _BOTH,
    "min_p": _BOTH,
    "repetition_penalty": _BOTH,
    "presence_penalty": _BOTH,
    "frequency_penalty": _BOTH,
    "logit_bias": _BOTH,
    "priority": _BOTH,
    "cache_salt": _BOTH,
    "request_id": {"vllm": "", "sglang": "rid"},
    "session_id": _BOTH,
    "chat_template_kwargs": _BOTH,
    "stop_token_ids": _BOTH,
    "ignore_eos": _BOTH,
    "skip_special_tokens": _BOTH,
    "include_stop_str_in_output": {"vllm": "", "sglang": "no_stop_trim"},
    "extra_key": {"sglang": ""},
    "vllm_xargs": {"vllm": ""},
}
# service_tier on a pool with honor_service_tier: the engine's request priority (lower runs first on
# both engines as the launcher starts them; 0 is the default of both).
TIER_PRIORITY = {"priority": -1, "flex": 1}


def tier_priority(service_tier: str | None, honored: bool, engine: str) -> int | None:
    """The request priority ``service_tier`` becomes on the engine of a pool that honours it (vLLM's
    and SGLang's chat and generate calls take ``priority``); None: it runs at the default priority,
    and the response says ``default`` (OpenAI's meaning: the tier that served it)."""
    if not honored or engine not in ENGINE_OPTIONS["priority"]:
        return None
    return TIER_PRIORITY.get(service_tier or "")


def refused_options(options: dict[str, Any], engine: str) -> list[str]:
    """The engine options of ``options`` (requests.engine_options) that ``engine`` does not take."""
    return [name for name in options if engine not in ENGINE_OPTIONS[name]]


# Item types after which a tool call still belongs to the same assistant turn.
_SAME_TURN = ("message", "function_call", "custom_tool_call", "reasoning")
# Tools the router ran: in the prompt they are a call and its result, like function calls.
_ROUTER_CALLS = ("mcp_call", "web_search_call", "code_interpreter_call")


def _router_call(item: Item) -> tuple[str, str, str]:
    """(engine name, arguments JSON, result text) of a router-run call item."""
    kind = item["type"]
    if kind == "mcp_call":
        output = item.get("_output") or item.get("output") or ""
        if item.get("error") and not output:
            output = f"error: {orjson.dumps(item['error']).decode()}"
        return engine_name(f"mcp__{item['server_label']}__{item['name']}", None), item.get("arguments") or "{}", output
    if kind == "web_search_call":
        name, arguments, fallback = _web_search_call(item.get("action") or {})
        return name, orjson.dumps(arguments).decode(), item.get("_output") or fallback
    logs = "\n".join(o.get("logs", "") for o in item.get("outputs") or () if o.get("type") == "logs")
    return "python", orjson.dumps({"code": item.get("code", "")}).decode(), item.get("_output") or logs or "(output not kept)"


def _web_search_call(action: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """(function, arguments, result when the text was not kept) of a web_search_call: the function the model
    called for its action, with the page it read named by URL (as the function takes it)."""
    url = action.get("url")
    if action.get("type") == "open_page":
        return OPEN_PAGE, {"url": url} if url else {}, f"{url}\n\n(page text not kept)" if url else "(no page opened)"
    if action.get("type") in ("find", "find_in_page"):  # find_in_page: what newer OpenAI SDKs call it
        arguments = {"pattern": action.get("pattern", ""), **({"url": url} if url else {})}
        return FIND_IN_PAGE, arguments, f"{url}\n\n(find results not kept)" if url else "(no page searched)"
    sources = action.get("sources") or []
    fallback = "\n".join(s.get("url", "") for s in sources) or "(results not kept)"
    return "web_search", {"query": action.get("query", "")}, fallback


# -- request --------------------------------------------------------------------------


def to_messages(items: list[Item], instructions: str | None, options: ChatOptions) -> list[dict[str, Any]]:
    """Items (history + this turn's input, references resolved) -> chat messages."""
    system: list[str] = [instructions] if instructions else []
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    prev = None  # the previous item's type: tool calls merge into the assistant message of their turn
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = item["role"]
            if role in ("system", "developer"):
                text = _text(item["content"])
                if options.system_messages == "merge":
                    system.append(text)
                else:
                    out.append({"role": "system", "content": text})
            elif role == "user":
                out.append({"role": "user", "content": _user_content(item["content"], options)})
            else:
                out.append(_assistant(_text(item["content"]), reasoning, options))
                reasoning = []
        elif kind in ("function_call", "custom_tool_call"):
            call = _tool_call(item)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and prev in _SAME_TURN:
                last.setdefault("tool_calls", []).append(call)
                if reasoning and options.reasoning_field and options.reasoning_field not in last:
                    last[options.reasoning_field] = "".join(reasoning)
                reasoning = []
            else:
                out.append({**_assistant(None, reasoning, options), "tool_calls": [call]})
                reasoning = []
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _tool_content(item["output"], options)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.extend(p["text"] for p in parts)
        elif kind in _ROUTER_CALLS:
            name, arguments, output = _router_call(item)
            call = {"id": item["id"], "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and prev in _SAME_TURN:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({**_assistant(None, reasoning, options), "tool_calls": [call]})
                reasoning = []
            out.append({"role": "tool", "tool_call_id": item["id"], "content": output})
            kind = "tool_output"
        prev = kind
    if not system:
        return out
    # merge: every system text; keep: only the instructions (other system messages stayed in place).
    return [{"role": "system", "content": "\n\n".join(system)}, *out]


def _assistant(content: str | None, reasoning: list[str], options: ChatOptions) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning and options.reasoning_field:
        message[options.reasoning_field] = "".join(reasoning)
    return message


def _tool_call(item: Item) -> dict[str, Any]:
    if item["type"] == "custom_tool_call":
        arguments = orjson.dumps({"input": item["input"]}).decode()
    else:
        arguments = item["arguments"]
    return {"id": item["call_id"], "type": "function",
            "function": {"name": engine_name(item["name"], item.get("namespace")), "arguments": arguments}}


def _text(parts: list[Item]) -> str:
    return "".join(p["text"] if "text" in p else p.get("refusal", "") for p in parts)


def _user_content(parts: list[Item], options: ChatOptions) -> str | list[dict[str, Any]]:
    if len(parts) == 1 and parts[0]["type"] == "input_text":
        return parts[0]["text"]
    return [_chat_part(p, options) for p in parts]


def _chat_part(part: Item, options: ChatOptions) -> dict[str, Any]:
    kind = part["type"]
    if kind == "input_text":
        return {"type": "text", "text": part["text"]}
    url = part.get("image_url") or part.get("file_url")
    if options.media_urls == "data_only" and url is not None and not url.startswith("data:"):
        raise InvalidRequest(f"{kind} URL {url[:100]!r}: the engine serving this model would fetch it, and this router "
                             "passes it only data: URLs; send the content inline", param="input",
                             code="unsupported_content_type")
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail", "auto")}}
    if kind == "input_file" and options.accepts_files:
        file: dict[str, Any] = {k: part[k] for k in ("file_data", "filename") if k in part}
        if "file_url" in part:
            file["file_url"] = part["file_url"]
        return {"type": "file", "file": file}
    raise InvalidRequest("input_file is not accepted by the engine serving this model", param="input",
                         code="unsupported_content_type")


def _tool_content(output: str | list[Item], options: ChatOptions) -> str | list[dict[str, Any]]:
    if isinstance(output, str):
        return output
    if all(p["type"] == "input_text" for p in output):
        return "".join(p["text"] for p in output)
    return [_chat_part(p, options) for p in output]


def build_request(
    req: CreateResponse, messages: list[dict[str, Any]], tools: ToolSet, options: ChatOptions, *, model: str, stream: bool,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The chat-completions body for one turn: every Responses setting mapped or refused, none dropped.
    ``max_tokens``: ``max_output_tokens`` as clamped to the context (``ChatTurn``); default, as sent."""
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if max_tokens is None:
        max_tokens = req.max_output_tokens
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if tools.offered:  # with tool_choice "none" too: the template still shows them, the engine won't call
        body["tools"] = [_chat_tool(t) for t in tools.offered]
        body["tool_choice"] = (
            {"type": "function", "function": {"name": tools.choice.forced}} if tools.choice.forced else tools.choice.mode
        )
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt["type"] == "json_schema":
        schema = {"name": fmt.get("name") or "output", "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    _reasoning_switch(body, (req.reasoning or {}).get("effort"), options)
    tier = tier_priority(req.service_tier, options.honor_service_tier, options.engine)
    if tier is not None:
        body["priority"] = tier  # an explicit "priority" (below) wins
    for name, value in engine_options(req).items():  # refused in prepare where the engine lacks one
        wire = ENGINE_OPTIONS[name].get(options.engine)
        if wire is None:
            continue
        if name == "chat_template_kwargs" and "chat_template_kwargs" in body:  # the client's keys win over the effort switch
            value = {**body["chat_template_kwargs"], **value}
        body[wire or name] = value
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return body


def _chat_tool(tool: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.engine_name, "parameters": tool.parameters}
    if tool.description:
        function["description"] = tool.description
    if tool.strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def _reasoning_switch(body: dict[str, Any], effort: str | None, options: ChatOptions) -> None:
    if effort is None or options.reasoning_effort_as == "drop":
        return
    if options.reasoning_effort_as == "reasoning_effort":
        body["reasoning_effort"] = effort
    else:  # Qwen3/GLM templates read enable_thinking, DeepSeek/Kimi read thinking
        body["chat_template_kwargs"] = {options.reasoning_effort_as: effort not in ("none", "minimal")}


# -- answer -----------------------------------------------------------------------------


class ChatTurn:
    """One response over a chat pool: the request, and chunks -> deltas (the per-request parsing state).

    ``max_output_tokens`` is clamped to the context as the engines' own Responses servers do,
    ``min(max_output_tokens, context - prompt)``: the router does not count a chat prompt's tokens,
    so it sends at most the pool's context (``context_length``; vLLM clamps below it itself), and
    where the engine answers that the rest does not fit, with the prompt's count, the call is sent
    again capped to the room it names (``cap_output``, turns/upstream.py)."""

    def __init__(self, req: CreateResponse, tools: ToolSet, options: ChatOptions, *, model: str, path: str,
                 context_length: int | None = None) -> None:
        self.path = path
        self._req = req
        self._context_length = context_length
        self._cap: int | None = None  # the room the engine named for this prompt
        self._tools = tools
        self._options = options
        self._model = model
        self._think = ThinkSplitter() if options.think_tags else None
        self._calls: dict[int, int] = {}  # the engine's tool-call index -> ours
        # The stream's payloads, a plain text chunk read as its text (a str) without being parsed:
        # the runner's per-token fast path. A think-tag splitter must see every piece of content
        # the general way, so only parsed chunks then.
        decoder = None if options.think_tags else ChunkDecoder()
        self.decode: Callable[[bytes], Any] = chunk_object if decoder is None else decoder.decode

    def request(self, items: list[Item], *, stream: bool) -> dict[str, Any]:
        messages = to_messages(items, self._req.instructions, self._options)
        return build_request(self._req, messages, self._tools, self._options, model=self._model, stream=stream,
                             max_tokens=self.max_tokens)

    @property
    def max_tokens(self) -> int | None:
        """What goes out as ``max_tokens``: ``max_output_tokens`` within the context and the engine's room."""
        limit = self._req.max_output_tokens
        for bound in (self._context_length, self._cap):
            if bound is not None and limit is not None:
                limit = min(limit, bound)
        return limit

    def cap_output(self, room: int | None) -> bool:
        """Cap ``max_tokens`` to the room the engine said the prompt leaves (None: uncapped again, for a
        shorter prompt); True when that changes what is sent."""
        before = self.max_tokens
        self._cap = room
        return self.max_tokens != before

    def end(self) -> list[Delta]:
        out: list[Delta] = []
        self._flush(out)
        return out

    def chunk(self, chunk: dict[str, Any] | str) -> list[Delta]:
        """One streamed ``chat.completion.chunk``, or the text of a plain text or reasoning one (from ``decode``)."""
        out: list[Delta] = []
        if type(chunk) is not dict:
            if type(chunk) is str:
                self._message({"content": chunk}, None, out)
            elif type(chunk) is ReasoningText:
                out.append(ReasoningDelta(str(chunk)))
            else:
                raise ValueError(NOT_AN_OBJECT)
            return out
        for choice in _choices(chunk):
            delta = choice.get("delta") or {}
            if type(delta) is not dict:
                raise _malformed("a choice's 'delta'", "an object", delta)
            self._message(delta, choice.get("logprobs"), out)
            reason = choice.get("finish_reason")
            if reason == "abort":  # the engine gave up on the request: not an answer
                raise ValueError("the worker aborted the request")
            if reason:
                self._flush(out)
                out.append(Finish(_finish(reason)))
        usage = chunk.get("usage")
        if usage:
            out.append(_usage(usage))
        return out

    def completion(self, body: dict[str, Any]) -> list[Delta]:
        """A whole non-streamed ``chat.completion``: the same deltas a stream would give."""
        out: list[Delta] = []
        if type(body) is not dict:
            raise _malformed("an answer", "a JSON object", body)
        choices = _choices(body)
        if not choices:
            raise ValueError("the worker's answer has no choices")
        for choice in choices:
            message = choice.get("message") or {}
            if type(message) is not dict:
                raise _malformed("a choice's 'message'", "an object", message)
            message = dict(message)
            calls = message.get("tool_calls") or []
            if type(calls) is not list:
                raise _malformed("'tool_calls'", "a list", calls)
            message["tool_calls"] = [{**call, "index": i} for i, call in enumerate(calls)]
            self._message(message, choice.get("logprobs"), out)
            self._flush(out)
            out.append(Finish(_finish(choice.get("finish_reason") or "stop")))
        usage = body.get("usage")
        if usage:
            out.append(_usage(usage))
        return out

    def _message(self, delta: dict[str, Any], logprobs: Any, out: list[Delta]) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            if type(reasoning) is not str:
                raise _malformed("reasoning", "a string", reasoning)
            out.append(ReasoningDelta(reasoning))
        content = delta.get("content")
        if content:
            if type(content) is not str:
                raise _malformed("'content'", "a string", content)
            if self._think is not None:
                out.extend(self._think.feed(content))
            else:
                out.append(TextDelta(content, (logprobs or {}).get("content") or None))
        refusal = delta.get("refusal")
        if refusal:
            if type(refusal) is not str:
                raise _malformed("'refusal'", "a string", refusal)
            out.append(RefusalDelta(refusal))
        calls = delta.get("tool_calls")
        if calls:
            if type(calls) is not list:
                raise _malformed("'tool_calls'", "a list", calls)
            for call in calls:
                out.append(self._tool_call(call))

    def _tool_call(self, call: dict[str, Any]) -> ToolCallDelta:
        if type(call) is not dict:
            raise _malformed("a tool call", "an object", call)
        engine_index = call.get("index", 0)
        function = call.get("function") or {}
        if type(function) is not dict or not isinstance(function.get("name") or "", str) \
                or not isinstance(function.get("arguments") or "", str):
            raise _malformed("a tool call's 'function'", "an object with string name and arguments", function)
        ours = self._calls.get(engine_index)
        if ours is None:
            ours = self._calls[engine_index] = len(self._calls)
            # Our own call ids: unique across a conversation whatever the engine sends.
            return ToolCallDelta(ours, new_id("call"), function.get("name") or "", function.get("arguments") or "")
        return ToolCallDelta(ours, None, None, function.get("arguments") or "")

    def _flush(self, out: list[Delta]) -> None:
        if self._think is not None:
            out.extend(self._think.flush())


def _choices(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chunk's or an answer's ``choices``, checked: a list of objects (missing: none)."""
    choices = body.get("choices") or []
    if type(choices) is not list:
        raise _malformed("'choices'", "a list", choices)
    for choice in choices:
        if type(choice) is not dict:
            raise _malformed("a choice", "an object", choice)
    return choices


def _malformed(what: str, expected: str, value: Any) -> ValueError:
    """A worker answer of the wrong shape, named: the client's error says what was wrong."""
    shown = repr(value)
    return ValueError(f"the worker sent {what} that is not {expected}: {shown[:80]}{'...' if len(shown) > 80 else ''}")


def _finish(reason: str) -> Any:
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


def _usage(usage: dict[str, Any]) -> Usage:
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return Usage(
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(prompt_details.get("cached_tokens") or 0),
        reasoning_tokens=int(completion_details.get("reasoning_tokens") or usage.get("reasoning_tokens") or 0),
    )
