"""Request ``tools`` and ``tool_choice`` -> what the model is offered.

Function tools (also inside ``namespace`` tools) and ``custom`` tools are
offered to the engine as functions under names it accepts; ``ToolSet`` maps
those names back to ``{name, namespace, kind}`` on the way out. Built-in
tools (web_search, mcp, ...) run on the router: until a backend serves them
they are echoed in ``tools`` and not offered. A served ``web_search`` is
three functions for chat models (``web_search``, ``web_search__open_page``,
``web_search__find_in_page``: namespaced like ``mcp__<label>__<tool>``) and
gpt-oss's own ``browser.search/open/find`` for harmony models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from router.protocol.errors import InvalidRequest

ToolKind = Literal["function", "custom", "mcp", "web_search", "code_interpreter"]
# Kinds the router runs itself between model turns (the others go back to the client).
ROUTER_KINDS = frozenset({"mcp", "web_search", "code_interpreter"})
WEB_SEARCH_TYPES = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11"})
BUILTIN_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "mcp", "image_generation", "computer_use_preview", "computer", "local_shell", "shell",
    "apply_patch", "tool_search", "programmatic_tool_calling",
})
_ENGINE_NAME = re.compile(r"[^a-zA-Z0-9_-]")


# The browsing functions chat models get beside ``web_search`` (``{namespace}__{name}``, as client namespaces are).
OPEN_PAGE = "web_search__open_page"
FIND_IN_PAGE = "web_search__find_in_page"
_SEARCH_PARAMETERS = {"type": "object", "properties": {"query": {"type": "string", "description": "What to search for."}},
                      "required": ["query"]}
_OPEN_PARAMETERS = {
    "type": "object",
    "properties": {
        "url": {"type": "string", "description": "The URL of a page that a web_search result listed."},
        "result": {"type": "integer", "minimum": 1, "description": "The number of a result of the last web_search: 1 for [1]."},
    },
}
_FIND_PARAMETERS = {
    "type": "object",
    "properties": {
        "pattern": {"type": "string", "description": "The text to look for (case-insensitive)."},
        "url": {"type": "string", "description": "The page to search; the page opened last when not given."},
    },
    "required": ["pattern"],
}


@dataclass(frozen=True, slots=True)
class OfferedTool:
    engine_name: str  # what the engine sees and calls
    kind: ToolKind
    name: str
    namespace: str | None
    description: str | None
    parameters: dict[str, Any]
    strict: bool
    server_label: str | None = None  # mcp: the server, and ``name`` is the tool's name there
    approval: bool = False  # mcp: a call must be approved by the client first
    config: dict[str, Any] | None = None  # the request's tool object (container, search settings, ...)


ChoiceMode = Literal["none", "auto", "required"]


@dataclass(slots=True)
class ToolChoice:
    mode: ChoiceMode = "auto"
    forced: str | None = None  # an engine name the model must call


@dataclass(slots=True)
class ToolSet:
    offered: list[OfferedTool] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=ToolChoice)
    by_engine_name: dict[str, OfferedTool] = field(default_factory=dict)
    # mcp tools of the request, by server label; their tools are offered once listed.
    mcp: dict[str, dict[str, Any]] = field(default_factory=dict)
    mcp_where: dict[str, str] = field(default_factory=dict)  # server label -> the tool's place in the request, "tools[i]"
    mcp_choice: dict[str, Any] | None = None  # a tool_choice naming an mcp tool, resolved after listing

    def lookup(self, engine_name: str) -> OfferedTool | None:
        return self.by_engine_name.get(engine_name)

    def add_mcp(self, label: str, tools: list[dict[str, Any]]) -> None:
        """Offer a listed MCP server's tools, filtered by the request's ``allowed_tools``."""
        spec = self.mcp[label]
        for tool in tools:
            name = tool.get("name", "")
            if not _mcp_allowed(spec.get("allowed_tools"), tool):
                continue
            offered = OfferedTool(engine_name(f"mcp__{label}__{name}", None), "mcp", name, None, tool.get("description"),
                                  tool.get("input_schema") or {"type": "object", "properties": {}}, False,
                                  server_label=label, approval=_needs_approval(spec.get("require_approval"), name),
                                  config=spec)
            self.offered.append(offered)
            self.by_engine_name[offered.engine_name] = offered
        choice = self.mcp_choice
        if choice is not None and choice.get("server_label") == label:
            wanted = [t for t in self.offered if t.server_label == label and (choice.get("name") in (None, t.name))]
            if wanted:
                self.choice = ToolChoice(mode="required", forced=wanted[0].engine_name if choice.get("name") else None)

    def relax(self) -> None:
        """After the first turn of a loop a forced choice becomes auto, so the loop can end."""
        if self.choice.mode == "required" or self.choice.forced:
            self.choice = ToolChoice(mode="auto")


def build_toolset(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                  runnable: frozenset[str] = frozenset()) -> ToolSet:
    """Validate ``tools`` and ``tool_choice`` together; every refusal names its param.

    ``runnable``: the built-in kinds this router has a backend for (``web_search``,
    ``code_interpreter``); other built-ins are echoed but not offered.
    """
    toolset = ToolSet()
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        where = f"tools[{i}]"
        if not isinstance(kind, str):
            raise InvalidRequest(f"{where}.type must be a string", param=f"{where}.type")
        if kind == "function":
            _offer(toolset, _function(tool, None, where))
        elif kind == "custom":
            _offer(toolset, _custom(tool, None, where))
        elif kind == "namespace":
            ns = _name(tool, where)
            for j, inner in enumerate(_objects(tool.get("tools"), f"{where}.tools")):
                inner_where = f"{where}.tools[{j}]"
                if inner.get("type") == "function":
                    _offer(toolset, _function(inner, ns, inner_where))
                elif inner.get("type") == "custom":
                    _offer(toolset, _custom(inner, ns, inner_where))
                else:
                    raise InvalidRequest(f"{inner_where}.type must be function or custom", param=f"{inner_where}.type")
        elif kind in WEB_SEARCH_TYPES and "web_search" in runnable:
            _offer_web_search(toolset, tool)
        elif kind == "code_interpreter" and "code_interpreter" in runnable:
            _offer(toolset, OfferedTool("python", "code_interpreter", "python", None,
                                        "Run Python code in a sandbox; files persist in the container between calls.",
                                        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                                        False, config=tool))
        elif kind == "mcp":
            label = tool.get("server_label")
            if not isinstance(label, str) or not label:
                raise InvalidRequest(f"{where}.server_label must be a non-empty string", param=f"{where}.server_label")
            if label in toolset.mcp:
                raise InvalidRequest(f"two mcp tools share the server_label {label!r}", param=f"{where}.server_label")
            _check_mcp(tool, where)
            toolset.mcp[label] = tool
            toolset.mcp_where[label] = where
        elif kind not in BUILTIN_TYPES:
            raise InvalidRequest(f"tool type {kind!r} is not supported", param=f"{where}.type", code="unsupported_tool_type")
    toolset.choice = _choice(tool_choice, toolset)
    return toolset


def _function(tool: dict[str, Any], namespace: str | None, where: str) -> OfferedTool:
    name = _name(tool, where)
    _description(tool, where)
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
    return OfferedTool(engine_name(name, namespace), "function", name, namespace, tool.get("description"),
                       parameters, tool.get("strict") is True)


def _custom(tool: dict[str, Any], namespace: str | None, where: str) -> OfferedTool:
    name = _name(tool, where)
    _description(tool, where)
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise InvalidRequest(f"{where}.format must be an object", param=f"{where}.format")
    if fmt.get("type") != "text":
        raise InvalidRequest("custom tools with a grammar format are not supported; use format text",
                             param=f"{where}.format", code="unsupported_parameter")
    parameters = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                  "additionalProperties": False}
    return OfferedTool(engine_name(name, namespace), "custom", name, namespace, tool.get("description"), parameters, True)


def _offer(toolset: ToolSet, tool: OfferedTool, alias: str | None = None) -> None:
    if tool.engine_name in toolset.by_engine_name:
        raise InvalidRequest(f"two tools share the name {tool.engine_name!r}", param="tools")
    toolset.offered.append(tool)
    toolset.by_engine_name[tool.engine_name] = tool
    if alias is not None:  # harmony models call built-ins by their own names
        toolset.by_engine_name[alias] = tool


def _offer_web_search(toolset: ToolSet, tool: dict[str, Any]) -> None:
    """Search, open a result, find text in it: three functions for chat models, gpt-oss's browser for harmony ones.

    Every one is kind ``web_search`` (its output item is a ``web_search_call``); ``name`` is the item's
    action: search, open_page or find.
    """
    _offer(toolset, OfferedTool("web_search", "web_search", "web_search", None,
                                "Search the web. Returns the top results, numbered [1], [2], ..., with their URLs; "
                                f"read one with {OPEN_PAGE}.", _SEARCH_PARAMETERS, False, config=tool),
           alias="browser.search")
    _offer(toolset, OfferedTool(OPEN_PAGE, "web_search", "open_page", None,
                                "Open a page that web_search found and read its text. Give the result's number "
                                "(result: 1 for [1] of the last search) or its url.", _OPEN_PARAMETERS, False, config=tool),
           alias="browser.open")
    _offer(toolset, OfferedTool(FIND_IN_PAGE, "web_search", "find", None,
                                "Find the lines of a page that contain a text: the page opened last, or the result "
                                "page url names.", _FIND_PARAMETERS, False, config=tool),
           alias="browser.find")


def _mcp_allowed(allowed: Any, tool: dict[str, Any]) -> bool:
    if allowed is None:
        return True
    if isinstance(allowed, list):
        return tool.get("name") in allowed
    names = allowed.get("tool_names")
    if names is not None and tool.get("name") not in names:
        return False
    if allowed.get("read_only"):
        return bool((tool.get("annotations") or {}).get("readOnlyHint"))
    return True


def _needs_approval(policy: Any, name: str) -> bool:
    """OpenAI's rule: approval is required unless the request says never (for all or for this tool)."""
    if policy is None or policy == "always":
        return True
    if policy == "never":
        return False
    never = (policy.get("never") or {}).get("tool_names") or []
    always = (policy.get("always") or {}).get("tool_names")
    if name in never:
        return False
    return always is None or name in always


def _choice(choice: str | dict[str, Any], toolset: ToolSet) -> ToolChoice:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be none, auto, required or an object", param="tool_choice")
        if choice == "required" and not toolset.offered:
            raise InvalidRequest("tool_choice 'required' needs at least one function or custom tool", param="tool_choice")
        return ToolChoice(mode=cast(ChoiceMode, choice))  # checked just above
    kind = choice.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest("tool_choice.type must be a string", param="tool_choice.type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        match = [t for t in toolset.offered if t.name == name and t.kind == kind]
        if not match:
            raise InvalidRequest(f"tool_choice names {kind} tool {name!r}, which is not in tools", param="tool_choice.name")
        return ToolChoice(mode="required", forced=match[0].engine_name)
    if kind == "mcp":
        if not isinstance(choice.get("server_label"), str) or choice["server_label"] not in toolset.mcp:
            raise InvalidRequest("tool_choice names an mcp server that is not in tools", param="tool_choice.server_label")
        toolset.mcp_choice = choice
        return ToolChoice(mode="auto")
    if kind in WEB_SEARCH_TYPES or kind == "code_interpreter":
        target = "web_search" if kind in WEB_SEARCH_TYPES else "python"
        if target not in toolset.by_engine_name:
            raise InvalidRequest(f"tool_choice names {kind}, which is not available here", param="tool_choice.type")
        return ToolChoice(mode="required", forced=target)
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise InvalidRequest("tool_choice.mode must be auto or required", param="tool_choice.mode")
        listed = _objects(choice.get("tools"), "tool_choice.tools")
        for j, t in enumerate(listed):
            if not isinstance(t.get("type"), str) or not isinstance(t.get("name", ""), str):
                raise InvalidRequest("an allowed tool is {type, name?} with strings", param=f"tool_choice.tools[{j}]")
        allowed = {("web_search" if t.get("type") in WEB_SEARCH_TYPES else t.get("type"), t.get("name"))
                   for t in listed}
        # A built-in tool is allowed by its type (web_search keeps its open_page and find functions).
        keep = [t for t in toolset.offered if (t.kind, t.name) in allowed
                or (t.kind in ("web_search", "code_interpreter") and (t.kind, None) in allowed)]
        toolset.offered = keep
        return ToolChoice(mode=mode)
    raise InvalidRequest(f"tool_choice type {kind!r} is not supported yet", param="tool_choice.type",
                         code="unsupported_parameter")


def _objects(value: Any, where: str) -> list[dict[str, Any]]:
    """A list of objects (None: empty), or a 400 naming ``where``."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InvalidRequest(f"{where} must be a list of objects", param=where)
    return value


def _description(tool: dict[str, Any], where: str) -> None:
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise InvalidRequest(f"{where}.description must be a string", param=f"{where}.description")


def _check_mcp(tool: dict[str, Any], where: str) -> None:
    """The shapes the tool loop reads later, checked now: a bad one would fail mid-response."""
    for key in ("server_url", "server_description", "authorization", "connector_id"):
        if tool.get(key) is not None and not isinstance(tool[key], str):
            raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    headers = tool.get("headers")
    if headers is not None and not (isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())):
        raise InvalidRequest(f"{where}.headers must map names to strings", param=f"{where}.headers")
    allowed = tool.get("allowed_tools")
    if allowed is not None and not (_names(allowed) or (isinstance(allowed, dict) and _names(allowed.get("tool_names", []))
                                                         and isinstance(allowed.get("read_only", False), bool))):
        raise InvalidRequest(f"{where}.allowed_tools must be a list of tool names or {{tool_names, read_only}}",
                             param=f"{where}.allowed_tools")
    policy = tool.get("require_approval")
    if policy is not None and policy not in ("always", "never") and not (
            isinstance(policy, dict) and all(key in ("always", "never") and isinstance(rule, dict)
                                             and _names(rule.get("tool_names", [])) for key, rule in policy.items())):
        raise InvalidRequest(f"{where}.require_approval must be always, never or {{always, never: {{tool_names}}}}",
                             param=f"{where}.require_approval")


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


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
