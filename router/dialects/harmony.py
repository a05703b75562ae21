"""Responses items <-> harmony tokens, for gpt-oss pools (openai-harmony).

The router renders the prompt itself (``render_prompt``), sends token ids to
the worker's token-level generate endpoint with ``stop_token_ids``, and turns
the generated ids back into normalized deltas (``HarmonyParser``, in harmony_parse.py).

Pure: no I/O. The ``HarmonyEncoding`` is a parameter; loading it
(``load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)``) needs
``o200k_base.tiktoken`` in ``$TIKTOKEN_ENCODINGS_BASE`` (see harmony_vocab.py).

Chain-of-thought rule (explicit here, not left to openai-harmony): analysis
messages (``reasoning`` items) that come before the LAST final-channel
assistant message are dropped; those after it (a tool loop in progress) are
kept. openai-harmony's own ``auto_drop_analysis`` (0.0.8) drops analysis only
when the conversation's last assistant message is final, and then only the
analysis before the FIRST final message, so it keeps old turns' CoT in a
multi-turn history and all of it during a tool loop; it is switched off.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Hashable, Sequence
from datetime import UTC, datetime
from typing import Any

from openai_harmony import (
    DeveloperContent,
    HarmonyEncoding,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from router.dialects.harmony_parse import HarmonyParser
from router.dialects.harmony_render import MessageSpec, rendered_messages
from router.protocol.errors import InvalidRequest
from router.protocol.items import Item, message_text

KNOWLEDGE_CUTOFF = "2024-06"  # gpt-oss's
_EFFORT = {
    "minimal": ReasoningEffort.LOW, "none": ReasoningEffort.LOW, "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH, "xhigh": ReasoningEffort.HIGH,
}
_JSON = "<|constrain|>json"
_BUILTIN = {"browser": SystemContent.with_browser_tool, "python": SystemContent.with_python_tool}
_MEDIA = ("input_image", "input_file")
__all__ = ["HarmonyParser", "prompt_messages", "prompt_specs", "refuse_media", "render_prompt", "stop_token_ids"]


# -- what gpt-oss cannot read ------------------------------------------------------------


def refuse_media(written: Sequence[Item], resolved: Sequence[Item], history: Sequence[Item], *, model: str,
                 history_param: str) -> None:
    """A 400 naming the first ``input_image`` or ``input_file`` part a harmony prompt would hold.

    gpt-oss reads text only, and a harmony prompt has no place for anything else: a part left
    out without a word would have the model answer about what it was never shown. ``written``:
    the request's input as sent (``input[i]``); ``resolved``: the same with ``item_reference``s
    replaced by their items; ``history``: the items of ``previous_response_id`` or of the
    conversation (``history_param``), whose media an earlier turn on another pool may have read.
    """
    for i, item in enumerate(written):
        if (found := _media_part(item)) is not None:
            where, kind = found
            raise _refused(f"input[{i}].{where}", f"input[{i}].{where} is an {kind} part", model)
    references = {item["id"]: i for i, item in enumerate(written) if item["type"] == "item_reference"}
    sent = {id(item) for item in written}
    for item in resolved:
        if id(item) not in sent and (found := _media_part(item)) is not None:
            where = f"input[{references[item['id']]}]" if item.get("id") in references else "input"
            raise _refused(where, f"{where} refers to item {item.get('id')!r}, whose {found[0]} is an {found[1]} part", model)
    for item in history:
        if (found := _media_part(item)) is not None:
            raise _refused(history_param, f"the earlier item {item.get('id')!r} (from {history_param}) has an {found[1]} "
                           f"part at {found[0]}", model)


def _media_part(item: Item) -> tuple[str, str] | None:
    """Where in ``item`` its first image or file part is (``content[j]``, ``output[j]``), and its type."""
    for key in ("content", "output"):
        parts = item.get(key)
        if isinstance(parts, list):
            for j, part in enumerate(parts):
                if isinstance(part, dict) and part.get("type") in _MEDIA:
                    return f"{key}[{j}]", part["type"]
    return None


def _refused(param: str, what: str, model: str | None) -> InvalidRequest:
    named = f"the model {model!r}" if model else "this model"
    return InvalidRequest(f"{what}, and {named} reads text only (gpt-oss, served through harmony): send the text "
                          "alone, or use a model that reads images and files", param=param, code="unsupported_content_type")


# -- items -> prompt tokens ------------------------------------------------------


def prompt_specs(
    items: Sequence[Item],
    *,
    instructions: str | None,
    tools: Sequence[dict[str, Any]] | None,
    reasoning_effort: str | None,
    knowledge_cutoff: str = KNOWLEDGE_CUTOFF,
    current_date: str | None = None,
    builtin_tools: Sequence[str] = (),
    response_format: tuple[str, dict[str, Any]] | None = None,
) -> tuple[Hashable, Callable[[], list[Message]], list[MessageSpec]]:
    """History + this turn's input -> the prompt's messages as data: the head's key (all that
    the system and developer messages are built from), what builds them, then the
    conversation's messages (``render_prompt`` renders them; ``prompt_messages`` builds them).

    ``reasoning_effort``: low/medium/high (None -> medium; minimal/none -> low, xhigh -> high).
    ``current_date``: ``YYYY-MM-DD``; None -> today (UTC). Pass the conversation's start
    date to keep the prompt prefix, and so the engine's prefix cache, stable across turns.
    ``tools``: Responses tools; ``function`` tools become the developer ``functions``
    namespace, other types are left to the caller (``builtin_tools`` names harmony's
    own ``browser`` / ``python`` namespaces for the system message).
    ``response_format``: ``text.format``'s name and JSON schema, described to the model in the
    developer message as the harmony format says (``# Response Formats``, ``## name``, the
    schema); harmony_constrain.py holds the final message to it.
    """
    effort = _EFFORT.get((reasoning_effort or "medium").lower(), ReasoningEffort.MEDIUM)
    date = current_date or datetime.now(UTC).strftime("%Y-%m-%d")
    folded = [instructions] if instructions else []
    folded += [message_text(it) for it in items if it.get("type") == "message" and it.get("role") in ("system", "developer")]
    if response_format is not None:
        name, schema = response_format
        folded.append(f"# Response Formats\n\n## {name}\n\n{json.dumps(schema, separators=(',', ':'), allow_nan=False)}")
    functions = [(t["name"], t.get("description") or "", t.get("parameters")) for t in tools or () if t.get("type") == "function"]
    builtins = tuple(builtin_tools)

    def head() -> list[Message]:
        system = (
            SystemContent.new()
            .with_reasoning_effort(effort)
            .with_conversation_start_date(date)
            .with_knowledge_cutoff(knowledge_cutoff)
        )
        for name in builtins:
            system = _BUILTIN[name](system)
        messages = [Message.from_role_and_content(Role.SYSTEM, system)]
        if folded or functions:
            developer = DeveloperContent.new()
            if folded:
                developer = developer.with_instructions("\n\n".join(folded))
            if functions:
                developer = developer.with_function_tools([ToolDescription.new(*f) for f in functions])
            messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        return messages

    key = (effort, date, knowledge_cutoff, builtins, tuple(folded), _json_key(functions))
    return key, head, _history(items)


def prompt_messages(items: Sequence[Item], **options: Any) -> tuple[list[Message], list[Message]]:
    """``prompt_specs``'s messages built: the system and developer ones, then the conversation's."""
    _, head, rest = prompt_specs(items, **options)
    return head(), [spec.message() for spec in rest]


def render_prompt(items: Sequence[Item], *, encoding: HarmonyEncoding, **options: Any) -> list[int]:
    """History + this turn's input -> prompt token ids ending in ``<|start|>assistant``:
    ``prompt_specs`` (which takes ``options``), rendered (messages rendered before are
    not built or rendered again: router/dialects/harmony_render.py)."""
    return rendered_messages(encoding).prompt(*prompt_specs(items, **options))


def _json_key(value: Any) -> str:
    """A key for JSON-like data (function tools' schemas) that tells apart whatever renders
    apart: ``repr`` keeps order and types (1, 1.0, True, "1") and NaN and infinities, which
    JSON serializers turn into null (the request parser accepts them)."""
    return repr(value)


def _history(items: Sequence[Item]) -> list[MessageSpec]:
    """User turns and assistant history as harmony messages (old CoT dropped)."""
    last_final = max((i for i, it in enumerate(items) if _is_final(it)), default=-1)
    names: dict[str, str] = {}  # call_id -> function name
    out: list[MessageSpec] = []
    for i, item in enumerate(items):
        kind = item.get("type")
        if (media := _media_part(item)) is not None:  # refuse_media names it first on a create; counts, compactions
            raise _refused("input", f"item {item.get('id')!r} has an {media[1]} part at {media[0]}", None)
        if kind == "message":
            role = item.get("role")
            if role == "user":
                out.append(MessageSpec(Role.USER, message_text(item)))
            elif role == "assistant":
                channel = "commentary" if item.get("phase") == "commentary" else "final"
                out.append(MessageSpec(Role.ASSISTANT, message_text(item), channel))
            # system / developer text is folded into the developer message
        elif kind == "reasoning":
            if i > last_final:
                text = _reasoning_text(item)
                if text:
                    out.append(MessageSpec(Role.ASSISTANT, text, "analysis"))
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            out.append(MessageSpec(Role.ASSISTANT, item.get("arguments") or "{}", "commentary",
                                   "functions." + item["name"], _JSON))
        elif kind == "function_call_output":
            name = names.get(item.get("call_id", ""))
            if name is None:
                raise InvalidRequest(
                    f"No tool call found for function call output with call_id {item.get('call_id')!r}.",
                    param="input",
                )
            out.append(MessageSpec(Role.TOOL, _output_text(item.get("output")), "commentary", "assistant",
                                   author="functions." + name))
        elif kind in ("mcp_call", "web_search_call", "code_interpreter_call"):
            out += _router_call(item)
        # mcp_list_tools and approval items are not part of the prompt
    return out


def _router_call(item: Item) -> list[MessageSpec]:
    """A tool the router ran: the model's call on its recipient, then the tool's answer."""
    kind = item["type"]
    if kind == "mcp_call":
        recipient = f"functions.mcp__{item['server_label']}__{item['name']}"
        call, content_type = item.get("arguments") or "{}", _JSON
        result = item.get("_output") or item.get("output") or json.dumps(item.get("error") or "")
    elif kind == "web_search_call":
        action = item.get("action") or {}
        if action.get("type") == "open_page":
            recipient, call = "browser.open", json.dumps({"id": action.get("url")})
        elif action.get("type") in ("find", "find_in_page"):
            recipient, call = "browser.find", json.dumps({"pattern": action.get("pattern", "")})
        else:
            recipient, call = "browser.search", json.dumps({"query": action.get("query", "")})
        content_type = _JSON
        result = item.get("_output") or "(results not kept)"
    else:
        recipient = "python"
        call, content_type = item.get("code") or "", "code"
        logs = "".join(o.get("logs", "") for o in item.get("outputs") or () if o.get("type") == "logs")
        result = item.get("_output") or logs or "(output not kept)"
    channel = "commentary" if recipient.startswith("functions.") else "analysis"
    return [
        MessageSpec(Role.ASSISTANT, call, channel, recipient, content_type),
        MessageSpec(Role.TOOL, result, channel, "assistant", author=recipient),
    ]


def _is_final(item: Item) -> bool:
    return item.get("type") == "message" and item.get("role") == "assistant" and item.get("phase") != "commentary"


def _reasoning_text(item: Item) -> str:
    parts = item.get("content") or item.get("summary") or ()
    return "".join(p.get("text") or "" for p in parts if isinstance(p, dict))


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(p.get("text") or "" for p in output if isinstance(p, dict))
    return json.dumps(output)


def stop_token_ids(encoding: HarmonyEncoding) -> list[int]:
    """``<|return|>`` and ``<|call|>``: where an assistant action ends (not ``<|end|>``)."""
    return list(_action_ends(encoding))


@functools.cache
def _action_ends(encoding: HarmonyEncoding) -> tuple[int, int]:
    """The ids of ``<|return|>`` and ``<|call|>``, asked once per encoding: measured, each
    openai-harmony call that names a special token rebuilds the whole special-token table
    (~350k instructions; these two lookups cost ~2M per request)."""
    ids = {t: encoding.encode(t, allowed_special="all")[0] for t in ("<|return|>", "<|call|>")}
    if set(encoding.stop_tokens_for_assistant_actions()) != set(ids.values()):
        raise ValueError("this harmony encoding ends assistant actions with other tokens than <|return|> and <|call|>")
    return ids["<|return|>"], ids["<|call|>"]
