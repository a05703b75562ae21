"""``[tools]``: the tools the router runs between model turns (MCP, web search, code interpreter)
and what they may reach."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from router.config.base import Section


class McpServerConfig(Section):
    # Requests refer to it by label (a request's own server_url must match [tools.mcp] allow).
    label: str = Field(min_length=1)
    url: str = Field(min_length=1)
    transport: Literal["streamable_http", "sse"] = "streamable_http"
    headers: dict[str, str] = {}


class McpConfig(Section):
    # URL prefixes or hosts a request's server_url may name; nothing else is ever contacted.
    allow: list[str] = []
    servers: list[McpServerConfig] = []
    timeout_s: float = Field(default=30.0, gt=0)


class WebSearchConfig(Section):
    # A SearXNG-style JSON search API: GET {url}?q=...&format=json.
    url: str = Field(min_length=1)
    max_results: int = Field(default=5, ge=1, le=20)
    timeout_s: float = Field(default=10.0, gt=0)


class CodeInterpreterConfig(Section):
    # Scratch folders, one per container id (relative to the config file).
    root: str = "var/containers"
    timeout_s: float = Field(default=10.0, gt=0)
    memory_mb: int = Field(default=256, ge=32)
    cpu_s: int = Field(default=10, ge=1)
    tmp_mb: int = Field(default=64, ge=1)  # each run's private /tmp (a tmpfs, counted in its memory cgroup)


class ToolsConfig(Section):
    mcp: McpConfig = McpConfig()
    web_search: WebSearchConfig | None = None  # absent: web_search tools are echoed, not offered
    code_interpreter: CodeInterpreterConfig | None = None
    # Model turns one response may take while the router runs tools (protects the pools).
    max_turns: int = Field(default=8, ge=1, le=64)
    # Non-public networks (CIDR) that pages a model opens and a request's MCP server_url may reach,
    # judged on the resolved address; empty: public addresses only. The search API and the MCP
    # servers named in config are the operator's choice and need no entry. Metadata addresses never.
    private_networks: list[str] = []

    @field_validator("private_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for entry in value:
            try:
                ipaddress.ip_network(entry)
            except ValueError as exc:
                raise ValueError(f"{entry!r}: {exc}") from None
        return value
