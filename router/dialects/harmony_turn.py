"""One response over a harmony pool: render tokens, call generate, parse tokens.

The router does not use the engine's chat template or its harmony parser:
``render_prompt`` makes the token ids, the engine's token-level generate
endpoint continues them, and ``HarmonyParser`` reads the ids it returns.
"""

from __future__ import annotations

from typing import Any

from openai_harmony import HarmonyEncoding

from backends.engines import (
    COMPLETIONS_FALLBACK_PATH,
    GENERATE_PATH,
    GenerateReader,
    GenerateStep,
    completions_request,
    generate_request,
)
from router.dialects.chat_chunks import chunk_object
from router.dialects.deltas import Delta, Finish, ReasoningDelta, ReasoningText, TextDelta, Usage
from router.dialects.engine_options import place_options
from router.dialects.harmony import HarmonyParser, render_prompt, stop_token_ids
from router.dialects.harmony_chunks import IdsTemplate, probe_ids
from router.dialects.harmony_constrain import final_schema, forced, structural_tag
from router.dialects.sglang_frames import CumulativeFrames
from router.dialects.stop_strings import StopStrings
from router.protocol.errors import InvalidRequest
from router.protocol.items import Item
from router.protocol.requests import CreateResponse, engine_options
from router.protocol.tools import ToolSet


class FrameDeltas(list[Delta]):
    """One frame's deltas, made at decode time (``HarmonyTurn.decode``); ``chunk`` hands them back."""

    __slots__ = ()


class HarmonyTurn:
    def __init__(self, req: CreateResponse, tools: ToolSet, encoding: HarmonyEncoding, *, engine: str,
                 context_length: int | None, request_id: str, model: str = "", use_completions: bool = False,
                 priority: int | None = None) -> None:
        self.path = COMPLETIONS_FALLBACK_PATH if use_completions else GENERATE_PATH[engine]
        self.model = model
        self._req = req
        self._tools = tools
        self._encoding = encoding
        self._engine = engine
        self._context_length = context_length
        self._request_id = request_id
        self._priority = priority  # service_tier's, on a pool that honours it (an explicit ``priority`` wins)
        self._parser = HarmonyParser(encoding)
        self._reader = GenerateReader(engine)
        self._prompt_tokens = 0
        self._forced = False  # this turn must end in a tool call (its constraint says so)
        self._generated = 0
        self._counts: GenerateStep | None = None  # the last token counts the engine reported
        # vLLM's plain frames, read without parsing; SGLang's cumulative ones without what came before
        self._template = IdsTemplate() if engine != "sglang" else None
        self._cumulative = CumulativeFrames() if engine == "sglang" else None
        # The request's stop strings: the engine stops at one, the router cuts its text there
        self._stops = StopStrings(req.stop, bool(req.include_stop_str_in_output)) if req.stop else None
        # The client's own stop ids (harmony's end the turn in the parser): the engine's text leaves the
        # one it matched out, unless include_stop_str_in_output
        self._client_stops = frozenset(req.stop_token_ids or ()) - set(stop_token_ids(encoding))
        self._keep_stop = bool(req.include_stop_str_in_output)

    def request(self, items: list[Item], *, stream: bool) -> dict[str, Any]:
        req = self._req
        tag = self._constraint()
        ids = self.prompt_ids(items)
        self._prompt_tokens = len(ids)
        if self.path == COMPLETIONS_FALLBACK_PATH:
            body = completions_request(self.model, ids, max_tokens=self._max_tokens(len(ids)),
                                       stop_token_ids=stop_token_ids(self._encoding), temperature=req.temperature,
                                       top_p=req.top_p, stream=stream, request_id=self._request_id)
            if tag is not None:
                body["structured_outputs"] = {"structural_tag": tag}
            if self._priority is not None:
                body["priority"] = self._priority
            place_options(body, engine_options(req), self._engine, completions=True)
            return body
        body = generate_request(self._engine, ids, max_tokens=self._max_tokens(len(ids)),
                                stop_token_ids=stop_token_ids(self._encoding), temperature=req.temperature,
                                top_p=req.top_p, stream=stream, request_id=self._request_id)
        if self._priority is not None:  # top level on both engines' generate calls
            body["priority"] = self._priority
        place_options(body, engine_options(req), self._engine)  # prepare refused what the engine lacks
        if tag is not None:  # the same structural tag on both wires (router/dialects/harmony_constrain.py)
            if self._engine == "sglang":
                body["sampling_params"]["structural_tag"] = tag
            else:
                body["sampling_params"]["structured_outputs"] = {"structural_tag": tag}
                body["reasoning_ended"] = True  # from the first token: the tag itself leaves the analysis free
        return body

    def _offered(self) -> list[Any]:
        return self._tools.offered if self._tools.choice.mode != "none" else []

    def _constraint(self) -> str | None:
        """``text.format`` and a forced tool choice as the engine's constraint (None: nothing to hold)."""
        offered = self._offered()
        self._forced = forced(self._tools.choice, offered)
        try:
            return structural_tag((self._req.text or {}).get("format"), self._tools.choice, offered)
        except ValueError as exc:  # NaN or Infinity: JSON has no such numbers
            raise InvalidRequest(f"The schema could not be sent to the engine: {exc}", param="text.format.schema",
                                 code="invalid_json_schema") from None

    def fallback(self) -> bool:
        """The generate endpoint is missing (404): use vLLM's completions endpoint instead, once."""
        if self._engine != "vllm" or self.path == COMPLETIONS_FALLBACK_PATH:
            return False
        self.path = COMPLETIONS_FALLBACK_PATH
        return True

    def prompt_ids(self, items: list[Item]) -> list[int]:
        """The prompt tokens for ``items`` (also what input_tokens counts)."""
        req = self._req
        offered = self._offered()
        functions = [
            {"type": "function", "name": t.engine_name, "description": t.description or "", "parameters": t.parameters}
            for t in offered if t.kind in ("function", "custom", "mcp")
        ]
        # gpt-oss knows its own browser and python tools; the router runs them through its backends.
        builtins = [name for kind, name in (("web_search", "browser"), ("code_interpreter", "python"))
                    if any(t.kind == kind for t in offered)]
        fmt = (req.text or {}).get("format") or {}
        schema = final_schema(fmt)
        described = (fmt.get("name") or "output", schema) if schema is not None and fmt.get("type") == "json_schema" else None
        try:
            return render_prompt(items, instructions=req.instructions, tools=functions, builtin_tools=builtins,
                                 reasoning_effort=(req.reasoning or {}).get("effort"), encoding=self._encoding,
                                 response_format=described)
        except ValueError as exc:  # openai-harmony refuses what is not JSON: a NaN or Infinity in a tool's schema
            raise InvalidRequest(f"The tools could not be rendered for this model: {exc}", param="tools",
                                 code="invalid_tools") from None

    def _max_tokens(self, prompt: int) -> int | None:
        """The pool's context minus the prompt, capped by max_output_tokens."""
        budget = self._req.max_output_tokens
        if self._context_length is None:
            return budget
        room = self._context_length - prompt
        if room <= 0:
            raise InvalidRequest(f"The input is {prompt} tokens, the model's context is {self._context_length}.",
                                 param="input", code="context_length_exceeded")
        return min(room, budget) if budget is not None else room

    def decode(self, payload: bytes) -> Any:
        """One frame's payload -> all of its work, done now: the parser's state must advance
        frame by frame, and the stream decodes every frame of a read before the runner sees it.

        Gives the frame's one piece of answer text as a ``str`` and of reasoning as a
        ``ReasoningText`` (the runner's per-token fast paths), other deltas as ``FrameDeltas``,
        and a worker's error frame as parsed (the stream ends there, unread). A frame the
        template knows is not parsed; others are, and may teach it. ``chunk`` reads each
        of these as the same deltas the parsed frame gives.
        """
        template = self._template
        ids = template.read(payload) if template is not None else None
        if ids is None:
            return self._parsed(payload)
        if len(ids) == 1 and self._stops is None:  # stop strings: every piece of text through the filter
            text = self._parser.plain(ids[0])
            if text is not None:
                self._generated += 1
                return text
        self._generated += len(ids)
        return _result(self._held(self._parser.feed(ids)))  # no finish, no counts: the template says so

    def _parsed(self, payload: bytes) -> Any:
        """A frame the template does not know, the general way (``chunk``); maybe learned from."""
        frame = self._cumulative.read(payload) if self._cumulative is not None else chunk_object(payload)
        if "error" in frame and "choices" not in frame:
            return frame  # the worker's error: the stream reads it
        deltas = self.chunk(frame)
        template = self._template
        if template is not None and template.learning:
            template.learn(payload, _vllm_ids(frame), _plain_ids)
        return _result(deltas)

    def chunk(self, payload: Any) -> list[Delta]:
        kind = type(payload)
        if kind is FrameDeltas:
            return payload
        if kind is str:
            return [TextDelta(payload)]
        if kind is ReasoningText:
            return [ReasoningDelta(str(payload))]
        step = self._reader.step(payload)
        ids = step.token_ids
        if step.finish == "stop" and ids and ids[-1] in self._client_stops and not self._keep_stop:
            ids = ids[:-1]
        out = self._parser.feed(ids)
        self._generated += len(step.token_ids)
        if step.stop_token is not None and not self._parser.done and step.stop_token not in self._client_stops:
            out += self._parser.feed([step.stop_token])  # an engine that trimmed the stop token it matched
        if step.prompt_tokens is not None or step.completion_tokens is not None:
            self._counts = step
        if step.finish is not None:
            out += self._parser.finish(step.finish, self._usage())
        elif self._counts is step and self._parser.done:
            out.append(self._usage())  # a usage frame after the finish
        return self._held(out)

    def completion(self, payload: dict[str, Any]) -> list[Delta]:
        return self.chunk(payload) + self.end()

    def end(self) -> list[Delta]:
        return self._held(self._parser.finish(None, self._usage()))

    def _held(self, deltas: list[Delta]) -> list[Delta]:
        """``deltas``, unless a turn that had to call a tool ended with none: then a ValueError,
        which fails the response (an engine that did not hold the constraint): a forced choice
        never ends ``completed`` with a plain message. With stop strings, the text cut at the first one."""
        if self._stops is not None:
            deltas = self._stops.filter(deltas)
        if self._forced:
            for delta in deltas:
                if type(delta) is Finish and delta.reason == "stop":
                    raise ValueError("tool_choice requires a tool call, and the model answered without one "
                                     "(the engine did not hold the structured-output constraint)")
        return deltas

    def _usage(self) -> Usage:
        counts = self._counts
        prompt = counts.prompt_tokens if counts and counts.prompt_tokens is not None else self._prompt_tokens
        completion = counts.completion_tokens if counts and counts.completion_tokens is not None else self._generated
        cached = counts.cached_tokens if counts and counts.cached_tokens is not None else 0
        # The engine counts no reasoning for a token-level call: the analysis tokens the parser read are it.
        return Usage(prompt, completion, cached, self._parser.reasoning_tokens)


def _result(deltas: list[Delta]) -> Any:
    """A frame's deltas as ``decode`` gives them: one plain piece of text or reasoning as its text."""
    if len(deltas) == 1:
        delta = deltas[0]
        kind = type(delta)
        if kind is TextDelta and delta.text and delta.phase is None and delta.logprobs is None:  # type: ignore[union-attr]
            return delta.text  # type: ignore[union-attr]
        if kind is ReasoningDelta and delta.text:  # type: ignore[union-attr]
            return ReasoningText(delta.text)  # type: ignore[union-attr]
    return FrameDeltas(deltas)


_VLLM = GenerateReader("vllm")  # keeps no state for vLLM's frames


def _vllm_ids(frame: dict[str, Any]) -> list[int]:
    """The new ids of a vLLM frame that gave only those (no finish, no counts), else []."""
    try:
        step = _VLLM.step(frame)
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
    if step.finish is not None or step.prompt_tokens is not None or step.completion_tokens is not None:
        return []
    return step.token_ids


def _plain_ids(probe: dict[str, Any]) -> bool:
    """Whether a probe frame (``IdsTemplate.learn``) reads as exactly the probe's ids, nothing more."""
    step_ids = _vllm_ids(probe)
    return step_ids == probe_ids() and _VLLM.step(probe).cached_tokens is None
