"""The body of ``POST /v1/responses``, validated once by pydantic.

Every field a current client may send is known here. Fields the router does
not serve yet are accepted by the schema but refused by ``check_supported``
with a 400 naming them, so nothing is silently dropped.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from router.protocol.errors import InvalidRequest


def _metadata_limits(value: dict[str, str] | None) -> dict[str, str] | None:
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


# OpenAI's metadata: at most 16 string pairs, keys <= 64 characters, values <= 512.
Metadata = Annotated[dict[str, str] | None, AfterValidator(_metadata_limits)]


INT64_MAX = 2**63 - 1


# Booleans the SDK types ``Optional[bool]``: only true and false are booleans (pydantic's lax mode
# would read "yes" or 1 as true), and null (an explicit ``None``) means the default, which
# ``check_supported`` puts in (measured: a validator function per field costs ~0.5 us a request).
Flag = Annotated[bool | None, Field(strict=True)]


class CreateResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_tool_calls: int | None = Field(default=None, ge=1, le=INT64_MAX)
    metadata: Metadata = None
    store: Flag = True
    stream: Flag = False
    stream_options: dict[str, Any] | None = None
    background: Flag = False
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: Flag = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    prompt: dict[str, Any] | None = None
    context_management: Any = None
    client_metadata: dict[str, Any] | None = None
    verbosity: str | None = None
    # Hints for OpenAI's own scheduling, taken and left alone: engines cache prefixes by themselves,
    # and a background response here runs at once, inside any completion window asked for.
    prompt_cache_options: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    # Which names a stream's reasoning events take: "openai" (response.reasoning_text.delta / .done,
    # the openai SDK's) or "open-responses" (response.reasoning.delta / .done, the Open Responses
    # specification's); unset: the API key's or the model's setting in config, else "openai".
    reasoning_events: Literal["openai", "open-responses"] | None = None
    # Engine options: what vLLM's and SGLang's own Responses servers take beyond OpenAI's fields (the
    # openai SDK sends them in extra_body). Each goes to the engine on pools whose engine takes it
    # (router/dialects/chat.py ENGINE_OPTIONS) and is a 400 naming it and the pool elsewhere
    # (router/turns/prepare.py); bounds as vLLM's request model has them. Measured (callgrind, validation and
    # check_supported of a plain create): these 20 fields with reasoning_events cost ~12.6k instructions, ~1.3% of a create.
    seed: int | None = Field(default=None, ge=-2**63, le=INT64_MAX)
    stop: str | list[str] | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    priority: int | None = Field(default=None, ge=-2**63, le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    chat_template_kwargs: dict[str, Any] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    ignore_eos: Flag = None
    skip_special_tokens: Flag = None
    include_stop_str_in_output: Flag = None
    extra_key: str | None = Field(default=None, min_length=1, max_length=256)
    vllm_xargs: dict[str, Any] | None = None
    # OpenAI's own services (UNSUPPORTED) are not fields: refused as unknown, by their own name. Every
    # field costs each create's validation (callgrind: ~0.5k instructions a field).



# ``include`` values (the SDK's ResponseIncludable). Each one served has an effect: router/protocol/shapes.py
# (what a create, its events, a retrieve and an input-items listing show), sealing, logprobs.
KNOWN_INCLUDES = frozenset({
    "reasoning.encrypted_content", "message.output_text.logprobs", "message.input_image.image_url",
    "code_interpreter_call.outputs", "web_search_call.action.sources", "web_search_call.results",
    "file_search_call.results", "computer_call_output.output.image_url",
})
# Values for tools this router has no backend for: no item they name can appear, so asking is a 400.
UNSERVED_INCLUDES = {"file_search_call.results": "file_search", "computer_call_output.output.image_url": "computer use"}


def check_include(values: list[str] | None, param: str = "include") -> frozenset[str]:
    """``include`` (a create's, or a retrieve's or listing's query) checked: a 400 naming the first
    value that is unknown, or that names what this router does not serve."""
    for i, value in enumerate(values or ()):
        if value not in KNOWN_INCLUDES:
            raise InvalidRequest(f"unknown include value {value!r}", param=f"{param}[{i}]", code="invalid_value")
        if value in UNSERVED_INCLUDES:
            raise InvalidRequest(f"include value {value!r} names {UNSERVED_INCLUDES[value]}, which this router does not serve",
                                 param=f"{param}[{i}]", code="unsupported_parameter")
    return frozenset(values or ())


def compact_threshold(req: CreateResponse) -> int | None:
    """``context_management: [{"type": "compaction", "compact_threshold": N}]`` -> N (validated)."""
    cm = req.context_management
    if cm is None:
        return None
    if not isinstance(cm, list):
        raise InvalidRequest("context_management must be a list", param="context_management")
    threshold = None
    for i, entry in enumerate(cm):
        if not isinstance(entry, dict) or entry.get("type") != "compaction":
            raise InvalidRequest("context_management entries must be {\"type\": \"compaction\", ...}",
                                 param=f"context_management[{i}].type")
        value = entry.get("compact_threshold")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidRequest("compact_threshold must be a positive integer (tokens)",
                                 param=f"context_management[{i}].compact_threshold")
        threshold = value
    return threshold


# Values the SDK knows (openai.types): anything else is a 400, not echoed back or sent to an engine.
EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = (None, "auto", "concise", "detailed")
VERBOSITIES = (None, "low", "medium", "high")
SERVICE_TIERS = (None, "auto", "default", "flex", "scale", "priority", "fast", "ultrafast")
# Fields holding free-form JSON: pydantic reads any integer into them, orjson writes 64 bits at most.
_FREE_FORM = frozenset({"input", "tools", "tool_choice", "text", "reasoning", "conversation", "stream_options", "prompt",
                        "context_management", "client_metadata", "prompt_cache_options", "background_options",
                        "chat_template_kwargs", "vllm_xargs"})
# The engine options (see CreateResponse): a request that sets none of them (nearly all) skips their checks.
ENGINE_FIELDS = frozenset({"seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                           "logit_bias", "priority", "cache_salt", "request_id", "session_id", "chat_template_kwargs",
                           "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                           "extra_key", "vllm_xargs"})
MAX_STOP = 4  # stop sequences, as OpenAI and vLLM allow
# A client's engine ``request_id`` goes into a header line of the worker requests (router/telemetry.py
# ``worker_request_id``): visible ASCII only, so no line break or other header can ride in it.
_HEADER_TOKEN = re.compile(r"[\x21-\x7e]+")


def engine_options(req: CreateResponse) -> dict[str, Any]:
    """The engine options the request sets (not null), by field name, in the model's order."""
    fields_set = req.__pydantic_fields_set__  # model_fields_set without the property's call (once per create and per turn)
    if ENGINE_FIELDS.isdisjoint(fields_set):
        return {}
    sent = fields_set & ENGINE_FIELDS
    return {name: value for name in CreateResponse.model_fields if name in sent and (value := getattr(req, name)) is not None}


# Parameters of the SDK's for services of OpenAI's own: refused (``unsupported_parameter``, see
# router/api/http.py) rather than ignored, since a client setting one expects it to act.
UNSUPPORTED = {"moderation": "moderation", "access_programs": "access programs", "image": "request-level image options",
               "personality": "a model style preset (personality)"}
# Options of the engines' own Responses servers that this router does not pass on (the ones it does are
# fields, ENGINE_FIELDS): refused by name, never silently dropped.
UNSUPPORTED.update({
    "include_reasoning": "vLLM's include_reasoning (reasoning items come back whenever the model reasons)",
    "enable_response_messages": "vLLM's enable_response_messages (harmony messages in the response)",
    "previous_input_messages": "vLLM's previous_input_messages (send the history as input items, or previous_response_id)",
    "structured_outputs": "vLLM's structured_outputs (use text.format)",
    "mm_processor_kwargs": "vLLM's mm_processor_kwargs", "media_io_kwargs": "vLLM's media_io_kwargs",
    "mm_payload": "vLLM's mm_payload", "return_mm_kwargs": "vLLM's return_mm_kwargs",
    "kv_transfer_params": "vLLM's kv_transfer_params (disaggregated serving)",
    "ec_transfer_params": "vLLM's ec_transfer_params (disaggregated serving)",
    "watermarking": "vLLM's watermarking", "ngram_corpus_id": "SGLang's ngram_corpus_id",
})
_DEFAULTS = {"store": True, "stream": False, "background": False, "parallel_tool_calls": True}
_FLAGS = frozenset(_DEFAULTS)


def check_encodable(value: Any, param: str) -> None:
    """A 400 naming the first integer in ``value`` that JSON written here cannot hold (beyond 64 bits):
    it would fail later, when the request is sent to a worker or stored. One orjson pass when all is well."""
    try:
        orjson.dumps(value)
    except TypeError:
        where = _oversized(value, param) or param
        raise InvalidRequest(f"{where} is an integer outside the 64-bit range", param=where, code="invalid_value") from None


def _oversized(value: Any, where: str) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return where if not -2**63 <= value < 2**64 else None
    if isinstance(value, dict):
        return next((found for key, v in value.items() if (found := _oversized(v, f"{where}.{key}"))), None)
    if isinstance(value, list):
        return next((found for i, v in enumerate(value) if (found := _oversized(v, f"{where}[{i}]"))), None)
    return None


def _one_of(value: Any, allowed: tuple[str | None, ...], param: str) -> None:
    if value not in allowed:
        raise InvalidRequest(f"{param} must be one of {', '.join(a for a in allowed if a)} (got {value!r})", param=param,
                             code="invalid_value")


def check_supported(req: CreateResponse) -> None:
    """Refuse, by name, what this router cannot serve yet; a null flag becomes its default."""
    sent = req.model_fields_set  # only what the client sent can be null or hold a huge integer
    for name in _FLAGS & sent:
        if getattr(req, name) is None:
            setattr(req, name, _DEFAULTS[name])
    for name in _FREE_FORM & sent:
        value = getattr(req, name)
        if value and type(value) is not str:
            check_encodable(value, name)
    reasoning = req.reasoning
    if reasoning:
        _one_of(reasoning.get("effort"), EFFORTS, "reasoning.effort")
        _one_of(reasoning.get("summary"), SUMMARIES, "reasoning.summary")
        _one_of(reasoning.get("generate_summary"), SUMMARIES, "reasoning.generate_summary")
    if req.text:
        _one_of(req.text.get("verbosity"), VERBOSITIES, "text.verbosity")
    if req.verbosity is not None:
        _one_of(req.verbosity, VERBOSITIES, "verbosity")
    if req.service_tier is not None:
        _one_of(req.service_tier, SERVICE_TIERS, "service_tier")
    compact_threshold(req)
    if req.stop is not None:
        _check_stop(req.stop)
    if req.request_id is not None and not _HEADER_TOKEN.fullmatch(req.request_id):
        raise InvalidRequest("request_id must be printable ASCII without spaces: it is also the worker request's "
                             "X-Request-Id header", param="request_id", code="invalid_value")
    if req.stream_options is not None:
        _check_stream_options(req.stream_options)
    if req.prompt is not None:
        raise InvalidRequest("prompt templates are not supported", param="prompt", code="unsupported_parameter")
    check_include(req.include)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidRequest("text.format.type must be text, json_object or json_schema", param="text.format.type")
        if kind == "json_schema" and not (isinstance(fmt.get("schema"), dict) and isinstance(fmt.get("name"), str)):
            raise InvalidRequest("text.format json_schema needs a name and a schema object", param="text.format.schema")


def _check_stop(stop: str | list[str]) -> None:
    """``stop``: a string or at most MAX_STOP non-empty strings (a 400 naming the one that is wrong)."""
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP:
        raise InvalidRequest(f"stop takes at most {MAX_STOP} sequences (got {len(stops)})", param="stop", code="invalid_value")
    for i, text in enumerate(stops):
        if not text:
            raise InvalidRequest("a stop sequence cannot be empty", param="stop" if isinstance(stop, str) else f"stop[{i}]",
                                 code="invalid_value")


def _check_stream_options(options: dict[str, Any]) -> None:
    """``stream_options.include_obfuscation``, when sent, a boolean (OpenAI's only stream option)."""
    value = options.get("include_obfuscation")
    if value is not None and type(value) is not bool:
        raise InvalidRequest("stream_options.include_obfuscation must be a boolean", param="stream_options.include_obfuscation",
                             code="invalid_type")
