"""What each field of ``CreateResponse`` does on each of the four pool kinds: plain data.

Every field of the request model (router/protocol/requests.py) is a row here, or, where docs/api.md
treats its parts apart (``text.format``, ``reasoning.effort``, ``stream_options.include_obfuscation``,
``include`` values), several rows named ``field.part`` or ``field: value``. Each row says, for chat and
harmony pools on vLLM's and SGLang's wires, one of:

- ``effect``: the field changes what the router or the engine does (``meaning`` says what);
- ``400``: the request is refused, with the error ``code`` and the ``param`` named;
- ``echoed``: accepted and returned in the response, with no effect;
- ``accepted``: accepted, with no effect, and not returned in the response either.

An ``effect`` either is checked by ``tests/e2e/test_parity_fields.py`` through a real router, or names in
``proof`` the test that shows it. ``tests/e2e/test_parity_fields.py`` fails when a field of the model has no
row, and docs/api.md holds ``render_markdown()``'s table as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Status = Literal["effect", "400", "echoed", "accepted"]

CHAT_VLLM, CHAT_SGLANG, HARMONY_VLLM, HARMONY_SGLANG = "chat-vllm", "chat-sglang", "harmony-vllm", "harmony-sglang"
POOL_KINDS = (CHAT_VLLM, CHAT_SGLANG, HARMONY_VLLM, HARMONY_SGLANG)
POOL_KIND_TITLES = {CHAT_VLLM: "chat · vLLM", CHAT_SGLANG: "chat · SGLang", HARMONY_VLLM: "harmony · vLLM",
                    HARMONY_SGLANG: "harmony · SGLang"}
CHAT = (CHAT_VLLM, CHAT_SGLANG)
HARMONY = (HARMONY_VLLM, HARMONY_SGLANG)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one field does on one pool kind."""

    status: Status
    note: str = ""  # what differs on this pool kind (shown in the cell)
    code: str = ""  # a 400's error code
    param: str = ""  # a 400's param
    proof: str = ""  # an effect the parity suite does not observe: "tests/FILE.py::test_name" that shows it


@dataclass(frozen=True, slots=True)
class Field:
    name: str  # the field, "field.part" or "field: value"
    meaning: str  # one line: what it does
    outcomes: dict[str, Outcome]  # pool kind -> outcome

    @property
    def top_level(self) -> str:
        """The request model's field this row is about."""
        return re.split(r"[.: ]", self.name, maxsplit=1)[0]


def _all(outcome: Outcome) -> dict[str, Outcome]:
    return dict.fromkeys(POOL_KINDS, outcome)


def _split(chat: Outcome, harmony: Outcome) -> dict[str, Outcome]:
    return {**dict.fromkeys(CHAT, chat), **dict.fromkeys(HARMONY, harmony)}


EFFECT = Outcome("effect")
ECHOED = Outcome("echoed")
ACCEPTED = Outcome("accepted")


def _refused(param: str, code: str = "unsupported_parameter", note: str = "") -> Outcome:
    return Outcome("400", note=note, code=code, param=param)


def _engine_option(name: str, meaning: str, *, vllm: str | None = "", sglang: str | None = "",
                   harmony: tuple[str | Outcome | None, str | Outcome | None] | str) -> Field:
    """An engine option: on chat pools sent to the engine under its wire name ("" = the same name; None:
    the engine lacks it, a 400), recorded in the response. ``harmony``: where the generate call of a
    harmony pool on vLLM and on SGLang takes it (router/dialects/engine_options.py), a note each, None
    where that engine lacks it (an Outcome: one with its proof); or, one string, why no harmony pool takes
    it (a 400 on both)."""
    def chat(wire: str | None, engine: str) -> Outcome:
        if wire is None:
            return _refused(name, note=f"not {engine}'s")
        return Outcome("effect", note=f"sent as `{wire}`" if wire else "")

    def generate(note: str | Outcome | None, engine: str) -> Outcome:
        if isinstance(note, Outcome):
            return note
        return _refused(name, note=f"not {engine}'s") if note is None else Outcome("effect", note=note)
    on_harmony: dict[str, Outcome]
    if isinstance(harmony, str):
        on_harmony = dict.fromkeys(HARMONY, _refused(name, note=harmony))
    else:
        on_harmony = {HARMONY_VLLM: generate(harmony[0], "vLLM"), HARMONY_SGLANG: generate(harmony[1], "SGLang")}
    return Field(name, meaning + "; recorded in the response", {
        CHAT_VLLM: chat(vllm, "vLLM"), CHAT_SGLANG: chat(sglang, "SGLang"), **on_harmony})


def _both(note: str) -> tuple[str, str]:
    return note, note


def _sampling(wire: str, sglang: str = "") -> tuple[str, str]:
    """The generate call's ``sampling_params.NAME`` on both engines (SGLang's own name when given)."""
    return f"`sampling_params.{wire}`", f"`sampling_params.{sglang or wire}`"


FIELDS: tuple[Field, ...] = (
    Field("model", "picks the model's pool (and arm)", _all(EFFECT)),
    Field("input", "the turn's items (a string is one user message)", _all(EFFECT)),
    Field("instructions", "the system message (chat) or developer message (harmony) of the prompt", _all(EFFECT)),
    Field("previous_response_id", "the stored chain before this turn joins the prompt", _all(EFFECT)),
    Field("conversation", "the conversation's items join the prompt; the response's items join the conversation",
          _all(EFFECT)),
    Field("temperature", "sampling temperature, sent to the engine (chat call or generate's sampling_params)",
          _split(EFFECT, Outcome("effect", proof="tests/e2e/test_parity_fields.py::test_generate_body_carries_the_sampling_fields"))),
    Field("top_p", "nucleus sampling, sent to the engine (chat call or generate's sampling_params)",
          _split(EFFECT, Outcome("effect", proof="tests/e2e/test_parity_fields.py::test_generate_body_carries_the_sampling_fields"))),
    Field("max_output_tokens", "caps the answer (status incomplete), clamped to the room the context leaves",
          _all(EFFECT)),
    Field("max_tool_calls", "caps the calls of router-run tools (mcp, web_search, code_interpreter) in one response",
          _all(EFFECT)),
    Field("metadata", "stored and returned with the response", _all(ECHOED)),
    Field("store", "false: nothing is stored (a retrieve is a 404)", _all(EFFECT)),
    Field("stream", "the answer as server-sent events", _all(EFFECT)),
    Field("stream_options.include_obfuscation", "a stream's delta events carry an `obfuscation` padding field",
          _all(EFFECT)),
    Field("background", "answers at once (queued); the response runs detached", _all(EFFECT)),
    Field("tools", "offered to the model (function, custom, namespace; mcp, web_search, code_interpreter run by "
          "the router)", _all(EFFECT)),
    Field("tool_choice", "none, auto, required, a named tool, allowed_tools (harmony: held by a structural tag)",
          _all(EFFECT)),
    Field("parallel_tool_calls", "whether the engine may return several calls in one turn",
          _split(Outcome("effect", note="sent to the engine"), Outcome("echoed", note="not sent to the engine"))),
    Field("text.format", "json_schema / json_object structured output (harmony: the final message held to it)",
          _all(EFFECT)),
    Field("text.verbosity", "returned as given", _all(ECHOED)),
    Field("reasoning.effort", "how hard the model thinks, in the form the pool's template reads",
          _split(Outcome("effect", note="`reasoning_effort`"),
                 Outcome("effect", note="the system message's `Reasoning:`",
                         proof="tests/unit/test_harmony.py::test_reasoning_effort_and_date_defaults"))),
    Field("reasoning.summary", "reasoning items also carry a summary part (the reasoning text)", _all(EFFECT)),
    Field("reasoning.generate_summary", "validated, returned in the response's `reasoning`; no effect here", _all(ECHOED)),
    Field("include: reasoning.encrypted_content", "reasoning items carry it, sealed, for a stateless next turn",
          _all(EFFECT)),
    Field("include: message.output_text.logprobs", "output text carries the tokens' logprobs",
          _split(EFFECT, _refused("top_logprobs", note="harmony pools give no logprobs"))),
    Field("include: code_interpreter_call.outputs", "code_interpreter_call items show their outputs (else null)",
          _all(Outcome("effect", proof="tests/e2e/test_e2e_tools.py::test_include_shows_tool_results_only_when_asked"))),
    Field("include: web_search_call.action.sources", "web_search_call items show their sources (also "
          "`web_search_call.results`)",
          _all(EFFECT)),
    Field("include: message.input_image.image_url", "a create shows no input messages: nothing to show (an input-items "
          "listing's own `include[]` shows image URLs)", _all(ACCEPTED)),
    Field("include: file_search_call.results", "this router has no file_search", _all(_refused("include[0]"))),
    Field("include: computer_call_output.output.image_url", "this router has no computer use",
          _all(_refused("include[0]"))),
    Field("truncation", "auto: the oldest turns leave a prompt that does not fit; disabled: a 400 "
          "context_length_exceeded then",
          {CHAT_VLLM: Outcome("effect", proof="tests/e2e/test_e2e_parity.py::test_a_prompt_overflow_still_truncates"),
           CHAT_SGLANG: Outcome("effect", proof="tests/e2e/test_e2e_parity.py::test_a_prompt_overflow_still_truncates"),
           HARMONY_VLLM: Outcome("effect", note="the router counts the tokens",
                                 proof="tests/e2e/test_e2e_harmony_parity.py::test_truncation_auto_drops_the_oldest_turns"),
           HARMONY_SGLANG: Outcome("effect", note="the router counts the tokens",
                                   proof="tests/e2e/test_e2e_harmony_parity.py::test_truncation_auto_drops_the_oldest_turns")}),
    Field("top_logprobs", "the top alternatives of each output token",
          _split(EFFECT, _refused("top_logprobs", note="harmony pools give no logprobs"))),
    Field("user", "returned; the key that keeps a client on one arm of a multi-arm model",
          _all(Outcome("effect", proof="tests/e2e/test_e2e_pools.py::test_weighted_arms_are_sticky_and_workers_affine"))),
    # No test sends safety_identifier to a multi-arm model: the proof is user's, the same key (turns/prepare.py).
    Field("safety_identifier", "returned; the arm key, before `user`",
          _all(Outcome("effect", proof="tests/e2e/test_e2e_pools.py::test_weighted_arms_are_sticky_and_workers_affine"))),
    Field("prompt_cache_key", "returned; the arm key, and on `policy = \"affinity\"` pools one worker for a key",
          _all(Outcome("effect", proof="tests/e2e/test_e2e_engine_extras.py::test_prompt_cache_key_keeps_requests_on_one_worker"))),
    Field("prompt_cache_retention", "a hint for OpenAI's cache: returned as sent, no effect here", _all(ECHOED)),
    Field("service_tier", "returned as the tier that served it (`default` unless the pool has `honor_service_tier = true`, "
          "where priority/flex become the engine's request `priority` -1/1)",
          _split(Outcome("effect", note="with honor_service_tier"),
                 Outcome("effect", note="with honor_service_tier: the generate call's `priority`"))),
    Field("prompt", "prompt templates are OpenAI's", _all(_refused("prompt"))),
    Field("context_management", "compaction: past `compact_threshold` tokens the older turns are summarized",
          _all(EFFECT)),
    Field("client_metadata", "returned as sent, no effect here", _all(ECHOED)),
    Field("verbosity", "returned as `text.verbosity`", _all(ECHOED)),
    Field("prompt_cache_options", "a hint for OpenAI's cache: returned as sent, no effect here", _all(ECHOED)),
    Field("background_options", "a hint for OpenAI's scheduling: returned as sent, no effect here", _all(ECHOED)),
    Field("reasoning_events", "the names of a stream's reasoning events (openai or open-responses)", _all(EFFECT)),
    _engine_option("seed", "the engine's sampling seed", harmony=_sampling("seed", "sampling_seed")),
    _engine_option("stop", "stop strings (at most 4)",
                   harmony=_both("`sampling_params.stop`; the router cuts the text at it")),
    _engine_option("top_k", "top-k sampling", harmony=_sampling("top_k")),
    _engine_option("min_p", "min-p sampling", harmony=_sampling("min_p")),
    _engine_option("repetition_penalty", "repetition penalty", harmony=_sampling("repetition_penalty")),
    _engine_option("presence_penalty", "presence penalty", harmony=_sampling("presence_penalty")),
    _engine_option("frequency_penalty", "frequency penalty", harmony=_sampling("frequency_penalty")),
    _engine_option("logit_bias", "token logit bias", harmony=_sampling("logit_bias")),
    _engine_option("priority", "the engine's request priority", harmony=_both("`priority`")),
    _engine_option("cache_salt", "splits the engine's prefix cache",
                   harmony=("`cache_salt`", "`extra_key` (before an `extra_key` sent too)")),
    _engine_option("request_id", "the engine's request id, also the X-Request-Id of its worker requests (vLLM reads that "
                   "first); visible ASCII", sglang="rid", harmony=("`request_id`", "`rid`")),
    _engine_option("session_id", "the engine's session id", harmony="no session id on the generate call"),
    _engine_option("chat_template_kwargs", "chat template arguments, over the effort switch",
                   harmony="no chat template: the router renders the tokens"),
    _engine_option("stop_token_ids", "stop token ids",
                   harmony=_both("`sampling_params.stop_token_ids`, after harmony's own")),
    _engine_option("ignore_eos", "generate past the end-of-sequence token",
                   harmony=_both("`sampling_params.ignore_eos`; harmony's stop ids still end the turn")),
    _engine_option("skip_special_tokens", "special tokens left out of the text",
                   harmony="the router reads harmony's special tokens"),
    _engine_option("include_stop_str_in_output", "the stop string kept in the text", sglang="no_stop_trim",
                   harmony=("`sampling_params.include_stop_str_in_output`; the router keeps it",
                            Outcome("effect", note="the router keeps it (`no_stop_trim` is always on)",
                                    proof="tests/e2e/test_e2e_harmony_engine_options.py::test_stop_string_kept_when_asked"))),
    _engine_option("extra_key", "SGLang's extra cache key", vllm=None, harmony=(None, "`extra_key`")),
    _engine_option("vllm_xargs", "vLLM's extra arguments", sglang=None, harmony=("`sampling_params.extra_args`", None)),
)


def _cell(outcome: Outcome) -> str:
    if outcome.status == "400":
        text = f"400 `{outcome.code}` (`{outcome.param}`)"
    else:
        text = outcome.status
    return f"{text}: {outcome.note}" if outcome.note else text


def render_markdown() -> str:
    """docs/api.md's table "Request fields on each pool kind" (ends with a newline)."""
    head = ["field", *(POOL_KIND_TITLES[kind] for kind in POOL_KINDS), "what it does"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in FIELDS:
        cells = [f"`{row.name}`", *(_cell(row.outcomes[kind]) for kind in POOL_KINDS), row.meaning]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
