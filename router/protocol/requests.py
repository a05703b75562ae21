"""The body of ``POST /v1/responses``, validated once by pydantic.

Every field a current client may send is known here. Fields the router does
not serve yet are accepted by the schema but refused by ``check_supported``
with a 400 naming them, so nothing is silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.protocol.errors import InvalidRequest


class CreateResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    background: bool = False
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    prompt: dict[str, Any] | None = None
    context_management: Any = None
    client_metadata: dict[str, Any] | None = None
    verbosity: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > 16:
            raise ValueError("at most 16 metadata pairs")
        for key, item in value.items():
            if len(key) > 64:
                raise ValueError(f"metadata key {key[:16]!r}... is longer than 64 characters")
            if len(item) > 512:
                raise ValueError(f"metadata value of {key!r} is longer than 512 characters")
        return value


def check_supported(req: CreateResponse) -> None:
    """Refuse, by name, what this router cannot serve yet."""
    if req.tools:
        raise InvalidRequest("tools are not supported by this router yet", param="tools", code="unsupported_parameter")
    if req.background:
        raise InvalidRequest("background responses are not supported yet", param="background", code="unsupported_parameter")
    if req.conversation is not None:
        raise InvalidRequest("conversations are not supported yet", param="conversation", code="unsupported_parameter")
    if req.text and (req.text.get("format") or {}).get("type", "text") != "text":
        raise InvalidRequest("only text output is supported yet", param="text.format", code="unsupported_parameter")
    if req.prompt is not None:
        raise InvalidRequest("prompt templates are not supported", param="prompt", code="unsupported_parameter")
