"""What a harmony turn's output must be, as the engines' structured-output constraint.

``text.format`` (json_schema, json_object) and forced tool choices (``required``, a named
tool, ``allowed_tools`` with mode required) become one xgrammar structural tag, sent with
the one generate call: the model reasons on the analysis channel unconstrained, then the
grammar holds only what follows (the final message's JSON, or the call's header and
arguments). It is the form vLLM 0.32's own harmony path builds (vllm/parser/harmony.py
``_assemble_tag`` / ``get_harmony_structural_tag``: an optional analysis message, an
optional commentary preamble for tool turns, then the constrained part), written here as
plain data: no xgrammar in the router. Both engines take the same JSON text:

- vLLM generate (``/inference/v1/generate``): ``sampling_params.structured_outputs =
  {"structural_tag": TEXT}`` (vllm/sampling_params.py ``StructuredOutputsParams``), with
  ``reasoning_ended: true`` so the engine applies it from the first generated token (the
  tag itself leaves the analysis free); the completions fallback: top-level
  ``structured_outputs``.
- SGLang ``/generate``: ``sampling_params.structural_tag = TEXT`` (a non-legacy tag:
  ``{"type": "structural_tag", "format": ...}``; sglang/srt/constrained/xgrammar_backend.py
  ``dispatch_structural_tag``).

Differences from vLLM's form, for the router's parser (harmony_parse.py reads headers as
openai-harmony 0.0.8 does): the final message opens plainly (``<|channel|>final<|message|>``:
a `` json`` or ``<|constrain|>json`` word there reads as a recipient, a tool call), and every
constrained part ends at the turn's stop token (end ``""``), never at ``<|end|>`` (after
which the grammar would allow only a stop token where the parser expects ``<|start|>``).

Pure: data in, JSON text out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from router.protocol.tools import OfferedTool, ToolChoice

FINAL_BEGIN = "<|channel|>final<|message|>"
CHANNELS = ("<|channel|>commentary", "<|channel|>analysis", "<|channel|>final")  # vLLM's _TOOL_CALL_CHANNELS
_CONSTRAINS = (" json", " <|constrain|>json")  # vLLM's _JSON_CONSTRAINS
# gpt-oss's own tools, by the engine names router/protocol/tools.py gives web_search and code_interpreter
BUILTIN_NAMES = {"web_search": "browser.search", "web_search__open_page": "browser.open",
                 "web_search__find_in_page": "browser.find", "python": "python"}
_ANY: dict[str, Any] = {"type": "any_text"}
_KEEP = 1024  # tags kept; past it the cache starts over
_KEPT: dict[str, str] = {}


def final_schema(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> the JSON schema of the final message (None: plain text)."""
    kind = (fmt or {}).get("type")
    if kind == "json_schema":
        schema = (fmt or {}).get("schema")
        return schema if isinstance(schema, dict) else {}
    if kind == "json_object":
        return {"type": "object"}  # vLLM's structured_outputs_to_format for json_object
    return None


def forced(choice: ToolChoice, offered: Sequence[OfferedTool]) -> bool:
    """Whether this turn must end in a tool call (required, a named tool, allowed_tools required)."""
    return choice.mode == "required" and bool(offered)


def structural_tag(fmt: dict[str, Any] | None, choice: ToolChoice, offered: Sequence[OfferedTool]) -> str | None:
    """The turn's constraint as a structural tag's JSON text, or None when nothing is constrained.

    ``offered``: the tools the prompt offers (none under tool_choice none). A forced choice
    allows only calls (the named one, else any offered); ``text.format`` JSON allows the final
    message with its schema or, under ``auto``, a call of any offered tool. Kept by its inputs'
    ``repr`` (which tells apart what serializes apart): measured, a forced choice's tag over one
    function costs ~38 us to build, its key ~3.
    """
    if final_schema(fmt) is None and not forced(choice, offered if choice.mode != "none" else ()):
        return None
    key = repr((fmt, choice.mode, choice.forced, [(t.engine_name, t.parameters) for t in offered]))
    kept = _KEPT.get(key)
    if kept is None:
        if len(_KEPT) >= _KEEP:
            _KEPT.clear()
        kept = _KEPT[key] = _built(fmt, choice, offered)
    return kept


def _built(fmt: dict[str, Any] | None, choice: ToolChoice, offered: Sequence[OfferedTool]) -> str:
    schema = final_schema(fmt)
    tools = list(offered) if choice.mode != "none" else []
    if forced(choice, tools):
        named = [t for t in tools if t.engine_name == choice.forced] if choice.forced else tools
        return _tag(_calls(named or tools), commentary=True)
    assert schema is not None  # structural_tag said so
    final = {"type": "tag", "begin": FINAL_BEGIN, "content": {"type": "json_schema", "json_schema": schema}, "end": ""}
    return _tag([final, *_calls(tools)], commentary=bool(tools))


def _calls(tools: Sequence[OfferedTool]) -> list[dict[str, Any]]:
    """The tags of calls to ``tools``: a function's arguments hold to its schema; gpt-oss's own tools
    (browser, python) take what they take (vLLM's fallback for built-ins)."""
    tags: list[dict[str, Any]] = []
    for tool in tools:
        builtin = BUILTIN_NAMES.get(tool.engine_name)
        if builtin is not None:
            tags += [_any_call(f"{channel} to={builtin}", ["<|start|>", "<|channel|>"]) for channel in CHANNELS]
            tags.append(_any_call(f" to={builtin}", ["<|start|>"]))  # the channel comes after the recipient
            continue
        arguments = {"type": "json_schema", "json_schema": tool.parameters}
        for channel in CHANNELS:
            for constrain in _CONSTRAINS:
                for begin in (f"{channel} to=functions.{tool.engine_name}{constrain}<|message|>",
                              f" to=functions.{tool.engine_name}{channel}{constrain}<|message|>"):
                    tags.append({"type": "tag", "begin": begin, "content": arguments, "end": ""})
    return tags


def _any_call(begin: str, excludes: list[str]) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": {"type": "any_text", "excludes": excludes}, "end": ""}


def _tag(content: list[dict[str, Any]], *, commentary: bool) -> str:
    """vLLM's ``_assemble_tag``: an optional analysis message, an optional commentary one, then ``content``."""
    elements: list[dict[str, Any]] = [_optional("<|channel|>analysis<|message|>")]
    if commentary:
        elements.append(_optional("<|channel|>commentary<|message|>"))
    elements.append(content[0] if len(content) == 1 else {"type": "or", "elements": content})
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}},
                      separators=(",", ":"), allow_nan=False)


def _optional(begin: str) -> dict[str, Any]:
    message = {"type": "tag", "begin": begin, "content": _ANY, "end": "<|end|>"}
    return {"type": "optional", "content": {"type": "sequence", "elements": [
        message, {"type": "const_string", "value": "<|start|>assistant"}]}}
