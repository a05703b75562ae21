"""Request ``tools`` and ``tool_choice`` -> what the model is offered.

Function tools (also inside ``namespace`` tools) and ``custom`` tools are
offered to the engine as functions under names it accepts; ``ToolSet`` maps
those names back to ``{name, namespace, kind}`` on the way out. Built-in
tools (web_search, mcp, ...) run on the router: until a backend serves them
they are echoed in ``tools`` and not offered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from router.protocol.errors import InvalidRequest

ToolKind = Literal["function", "custom"]
BUILTIN_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "mcp", "image_generation", "computer_use_preview", "computer", "local_shell", "shell",
    "apply_patch", "tool_search", "programmatic_tool_calling",
})
_ENGINE_NAME = re.compile(r"[^a-zA-Z0-9_-]")


@dataclass(frozen=True, slots=True)
class OfferedTool:
    engine_name: str  # what the engine sees and calls
    kind: ToolKind
    name: str
    namespace: str | None
    description: str | None
    parameters: dict[str, Any]
    strict: bool


@dataclass(slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required"] = "auto"
    forced: str | None = None  # an engine name the model must call


@dataclass(slots=True)
class ToolSet:
    offered: list[OfferedTool] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=ToolChoice)
    by_engine_name: dict[str, OfferedTool] = field(default_factory=dict)

    def lookup(self, engine_name: str) -> OfferedTool | None:
        return self.by_engine_name.get(engine_name)


def build_toolset(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> ToolSet:
    """Validate ``tools`` and ``tool_choice`` together; every refusal names its param."""
    toolset = ToolSet()
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        where = f"tools[{i}]"
        if kind == "function":
            _offer(toolset, _function(tool, None, where))
        elif kind == "custom":
            _offer(toolset, _custom(tool, None, where))
        elif kind == "namespace":
            ns = _name(tool, where)
            for j, inner in enumerate(tool.get("tools") or []):
                inner_where = f"{where}.tools[{j}]"
                if inner.get("type") == "function":
                    _offer(toolset, _function(inner, ns, inner_where))
                elif inner.get("type") == "custom":
                    _offer(toolset, _custom(inner, ns, inner_where))
                else:
                    raise InvalidRequest(f"{inner_where}.type must be function or custom", param=f"{inner_where}.type")
        elif kind not in BUILTIN_TYPES:
            raise InvalidRequest(f"tool type {kind!r} is not supported", param=f"{where}.type", code="unsupported_tool_type")
    toolset.choice = _choice(tool_choice, toolset)
    return toolset


def _function(tool: dict[str, Any], namespace: str | None, where: str) -> OfferedTool:
    name = _name(tool, where)
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
    return OfferedTool(engine_name(name, namespace), "function", name, namespace, tool.get("description"),
                       parameters, tool.get("strict") is True)


def _custom(tool: dict[str, Any], namespace: str | None, where: str) -> OfferedTool:
    name = _name(tool, where)
    fmt = tool.get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise InvalidRequest("custom tools with a grammar format are not supported; use format text",
                             param=f"{where}.format", code="unsupported_parameter")
    parameters = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                  "additionalProperties": False}
    return OfferedTool(engine_name(name, namespace), "custom", name, namespace, tool.get("description"), parameters, True)


def _offer(toolset: ToolSet, tool: OfferedTool) -> None:
    if tool.engine_name in toolset.by_engine_name:
        raise InvalidRequest(f"two tools share the name {tool.engine_name!r}", param="tools")
    toolset.offered.append(tool)
    toolset.by_engine_name[tool.engine_name] = tool


def _choice(choice: str | dict[str, Any], toolset: ToolSet) -> ToolChoice:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be none, auto, required or an object", param="tool_choice")
        if choice == "required" and not toolset.offered:
            raise InvalidRequest("tool_choice 'required' needs at least one function or custom tool", param="tool_choice")
        return ToolChoice(mode=choice)  # type: ignore[arg-type]
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        match = [t for t in toolset.offered if t.name == name and t.kind == kind]
        if not match:
            raise InvalidRequest(f"tool_choice names {kind} tool {name!r}, which is not in tools", param="tool_choice.name")
        return ToolChoice(mode="required", forced=match[0].engine_name)
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise InvalidRequest("tool_choice.mode must be auto or required", param="tool_choice.mode")
        allowed = {(t.get("type"), t.get("name")) for t in choice.get("tools") or []}
        keep = [t for t in toolset.offered if (t.kind, t.name) in allowed]
        toolset.offered = keep
        return ToolChoice(mode=mode)
    raise InvalidRequest(f"tool_choice type {kind!r} is not supported yet", param="tool_choice.type",
                         code="unsupported_parameter")


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.name must be a non-empty string", param=f"{where}.name")
    return name


def engine_name(name: str, namespace: str | None) -> str:
    """A name engines' tool parsers accept: [a-zA-Z0-9_-], at most 64 characters."""
    full = f"{namespace}__{name}" if namespace else name
    return _ENGINE_NAME.sub("_", full)[:64]


def echo_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as the Response echoes them: function tools with every key present."""
    out = []
    for tool in tools:
        if tool.get("type") == "function":
            tool = {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": tool.get("strict", True), **tool}
        out.append(tool)
    return out
