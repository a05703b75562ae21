"""What the harmony sim answers (backends/sim/harmony.py): the scripted answer's parts, from
the prompt's markers and mentions, as harmony text; and the same answer held to the request's
structured-output constraint, as the engines hold it.

The constraint, as each engine takes it on its token-level wire:
- vLLM (``/inference/v1/generate``: ``sampling_params.structured_outputs``; ``/v1/completions``:
  top-level ``structured_outputs``): exactly one of ``json``, ``json_object``,
  ``structural_tag`` (and ``regex``, ``choice``, ``grammar``, which the sim does not generate);
  a bad one is a 400. Measured on vLLM 0.32 (CPU build, default ``auto`` backend): a structural
  tag xgrammar rejects falls back to guidance, which reads it as a legacy tag and answers
  "Invalid grammar specification: 'triggers'" (vllm/sampling_params.py, backend_guidance.py);
  a bad ``json`` schema: "Failed to transform json schema into a grammar: ...".
- SGLang (``/generate``: ``sampling_params.json_schema`` / ``structural_tag``; ``regex`` and
  ``ebnf`` are not generated here): a bad one aborts the request with 400 "Invalid grammar
  request: ..." (sglang scheduler, ``INVALID_GRAMMAR_OBJ``).
A structural tag (xgrammar's, ``{"type": "structural_tag", "format": ...}``: sequence, or,
optional, tag, const_string, any_text, json_schema) is walked to text that it accepts,
choosing what the script would have said where it may (the mentioned tool, an analysis
message, the final message) and the first choice where it may not.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.sim.script import SimError, compact_json, generate_tokens, int_marker, schema_instance, seed_salt, stop_strings
from backends.sim.tools import TEXT_MARKERS, mentioned_function

END, RETURN, CALL = 200007, 200002, 200012  # <|end|>; <|return|>, <|call|>: gpt-oss's eos ids
VOCAB_SIZE = 201088  # o200k_harmony
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class Answer:
    """The scripted answer's parts."""

    reason: str | None = None  # the analysis message's text
    preamble: str | None = None  # a commentary message before the end
    calls: list[str] = field(default_factory=list)  # functions called
    builtins: list[str] = field(default_factory=list)  # gpt-oss's own tools called (browser.search, python)
    query: str = "sim"
    functions: dict[str, dict] = field(default_factory=dict)  # name -> the arguments the script sends
    tool_said: str | None = None  # the answer to a tool's output
    final: str = ""


def plan_answer(info: Any, markers: dict, default_tokens: int, seed: bytes = b"", echo: str | None = None) -> Answer:
    """``info``: harmony.PromptInfo. Markers first, then a mention of a function. ``seed``: the
    request's seed as a salt of the words (``read_sampling``); ``echo``: the final text of
    ``[sim:echo=request]`` (the request body without its ids)."""
    def words(n: int, salt: bytes) -> str:
        return "".join(generate_tokens([{"prompt": info.digest}], n, salt + seed))
    reason, n = int_marker(markers, "reason"), int_marker(markers, "tokens")
    answer = Answer(functions=info.functions)
    answer.reason = words(reason or 4, b"r") if reason != 0 else None
    if info.tool_output is not None:
        markers = {"tool": None}
        answer.tool_said = f"tool said: {info.tool_output}"
    if "preamble" in markers:
        answer.preamble = words(3, b"p")
    answer.calls = [name for name in (markers.get("call") or "").split(",") if name]
    if not answer.calls and not (TEXT_MARKERS | {"builtin"}) & markers.keys() and info.tool_output is None:
        mentioned = mentioned_function(info.user_text, {n: info.descriptions.get(n) for n in info.functions})
        answer.calls = [mentioned] if mentioned is not None else []
    answer.query = re.sub(r"\[sim:[^\]]*\]", "", info.user_text).strip() or "sim"
    answer.builtins = [name for name in (markers.get("builtin") or "").split(",") if name]
    answer.final = echo if echo is not None else words(default_tokens if n is None else n, b"")
    return answer


def read_sampling(engine: str, sp: dict) -> tuple[bytes, list[str]]:
    """The request's seed as a salt of the words (vLLM's ``seed``, SGLang's ``sampling_seed``: the same
    seed, the same words) and its stop strings, checked as the engines' request models check them."""
    return seed_salt({"seed": sp.get("sampling_seed" if engine == "sglang" else "seed")}), stop_strings(sp)


def cut_at_stop(enc: Any, ids: list[int], stops: list[str]) -> tuple[list[int], str | None]:
    """The ids through the one that completes the first stop string of their text (special tokens
    written out, as the engines detokenize with skip_special_tokens false: vLLM drops only the ids
    after it, SGLang none), and that string; the ids as they are when none matches."""
    if not stops or not any(stop in enc.decode(ids) for stop in stops):
        return ids, None
    for end in range(1, len(ids) + 1):
        text = enc.decode(ids[:end])
        found = [(text.find(stop), stop) for stop in stops if stop in text]
        if found:
            return ids[:end], min(found)[1]
    return ids, None


def garbage_ids(digest: str, n: int) -> list[int]:
    """[sim:garbage=N]: N random ids, then <|return|>."""
    rng = random.Random(digest)
    ids = (t for t in iter(lambda: rng.randrange(VOCAB_SIZE), -1) if t not in (RETURN, CALL))
    return [next(ids) for _ in range(n)] + [RETURN]


def script_text(answer: Answer) -> str:
    """The answer as harmony text after the prompt's ``<|start|>assistant``. gpt-oss ends a turn
    at its first <|call|>: all calls but the last end with <|end|>."""
    msgs = [f"<|channel|>analysis<|message|>{answer.reason}<|end|>"] if answer.reason is not None else []
    if answer.tool_said is not None:
        msgs.append(f"<|channel|>final<|message|>{answer.tool_said}<|return|>")
    if answer.preamble is not None:
        msgs.append(f"<|channel|>commentary<|message|>{answer.preamble}<|end|>")
    calls = [f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
             + orjson.dumps(answer.functions.get(name, {})).decode() for name in answer.calls]
    calls += [f"<|channel|>analysis to={name} code<|message|>" + builtin_args(name, answer.query)
              for name in answer.builtins]
    if calls:
        msgs += [c + "<|end|>" for c in calls[:-1]] + [calls[-1] + "<|call|>"]
    elif answer.tool_said is None:
        msgs.append(f"<|channel|>final<|message|>{answer.final}<|return|>")
    return "<|start|>assistant".join(msgs)


def builtin_args(name: str, query: str) -> str:
    """What gpt-oss sends its own tools: code for python, JSON for the browser's search/open/find."""
    if name == "python":
        return "print(1 + 1)"
    if name == "browser.open":
        return orjson.dumps({"id": 0}).decode()  # the first link of the last search
    if name == "browser.find":
        return orjson.dumps({"pattern": query.split()[0] if query else "sim"}).decode()
    return orjson.dumps({"query": query, "topn": 10}).decode()


# -- the constraint ---------------------------------------------------------------------


def read_constraint(engine: str, sp: dict) -> dict | None:
    """The request's constraint as a structural tag's format (None: none), checked as the engine
    checks it: a bad one raises SimError with the engine's answer."""
    if engine == "sglang":
        kinds = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if sp.get(k) is not None]
        if len(kinds) > 1:
            raise SimError(400, "Only one of regex, json_schema, ebnf, or structural_tag can be set.", None)
        if not kinds:
            return None
        kind, value = kinds[0], sp[kinds[0]]
        if kind in ("regex", "ebnf"):
            raise SimError(400, f"the sim does not generate {kind} constraints", None)
        try:
            if kind == "json_schema":
                return _json_format(value if value == "$$ANY$$" else json.loads(value))
            return _checked(json.loads(value))
        except (SimError, ValueError, TypeError, AttributeError, KeyError):
            raise SimError(400, f"Invalid grammar request: req.grammar_key=({kind!r}, {value!r})", None) from None
    so = sp.get("structured_outputs")
    if so is None:
        return None
    given = [k for k in _VLLM_KINDS if isinstance(so, dict) and so.get(k) is not None]
    if len(given) != 1:
        raise SimError(400, "You must use exactly one kind of structured outputs constraint "
                       f"but {len(given)} are specified: {so}", None)
    kind = given[0]
    if kind in ("regex", "choice", "grammar"):
        raise SimError(400, f"the sim does not generate {kind} constraints", None)
    if kind == "json_object":
        return _json_format({"type": "object"})
    if kind == "json":
        try:
            schema = json.loads(so["json"]) if isinstance(so["json"], str) else so["json"]
            return _json_format(schema)
        except SimError as exc:
            raise SimError(400, f"Failed to transform json schema into a grammar: {exc.args[1]}", None) from None
        except ValueError:
            raise SimError(400, "Invalid JSON grammar specification.", None) from None
    try:
        tag = json.loads(so["structural_tag"])
    except (ValueError, TypeError) as exc:
        raise SimError(400, f"Invalid grammar specification: {exc}", None) from None
    try:
        return _checked(tag)
    except (SimError, ValueError, TypeError, AttributeError, KeyError):
        raise SimError(400, "Invalid grammar specification: 'triggers'", None) from None


def _json_format(schema: Any) -> dict:
    """A plain JSON constraint: the whole output is the JSON (``$$ANY$$``: any JSON)."""
    return _checked({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {} if schema == "$$ANY$$" else schema}})


def _checked(tag: Any) -> dict:
    """The tag's format, every part known and every schema with an instance (else raises)."""
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise ValueError("not a structural tag")
    _walk(tag["format"], _Pick([], "", None), check=True)
    return tag["format"]


@dataclass
class _Pick:
    """What the script would say: the preferred begins of an ``or``'s tags, in order."""

    prefer: list[str]
    words: str
    answer: Answer | None
    stop: list[int] = field(default_factory=lambda: [RETURN])


def constrained_text(fmt: dict, answer: Answer) -> str:
    """Text the constraint ``fmt`` accepts, as near the scripted ``answer`` as it allows, with the
    turn's stop token (<|call|> after a call, else <|return|>) after it."""
    prefer = [f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>" for name in answer.calls]
    prefer += [f"<|channel|>analysis to={name}" for name in answer.builtins]
    if answer.tool_said is not None or not prefer:
        prefer.append("<|channel|>final<|message|>")
    prefer += ["<|channel|>commentary to=functions.", "<|channel|>analysis to="]  # a forced call the script did not make
    pick = _Pick(prefer, answer.final, answer)
    text = _walk(fmt, pick, check=False)
    return text + ("<|call|>" if pick.stop == [CALL] else "<|return|>")


def _walk(fmt: Any, pick: _Pick, *, check: bool) -> str:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    elements = fmt.get("elements") if kind in ("sequence", "or") else None
    if elements is not None and not isinstance(elements, list):
        raise ValueError(f"a {kind}'s elements must be a list")
    if kind == "sequence":
        return "".join(_walk(el, pick, check=check) for el in elements or ())
    if kind == "or":
        if not elements:
            raise ValueError("an empty or")
        if check:
            for el in elements:
                _walk(el, pick, check=True)
        return _walk(_choose(elements, pick), pick, check=check)
    if kind == "optional":
        return _optional(fmt["content"], pick, check=check)
    if kind == "const_string":
        return str(fmt["value"])
    if kind == "any_text":
        return pick.words
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        return compact_json(schema_instance(schema if isinstance(schema, dict) else {}))
    if kind == "tag":
        begin, end = str(fmt["begin"]), fmt["end"]
        ends = end if isinstance(end, list) else [end]
        if "to=" in begin:
            pick.stop = [CALL]
            name = begin.split("to=", 1)[1].split("<|")[0].split(" ")[0]
            pick.words = " code<|message|>" + builtin_args(name, pick.answer.query if pick.answer else "sim")
        content = _walk(fmt["content"], pick, check=check)
        return begin + content + ("" if "" in ends else str(ends[0]))
    raise ValueError(f"the sim does not generate structural tag parts of type {kind!r}")


def _optional(content: Any, pick: _Pick, *, check: bool) -> str:
    """An analysis or commentary message when the script has one."""
    answer = pick.answer
    first = content.get("elements", [{}])[0] if isinstance(content, dict) and content.get("type") == "sequence" else {}
    begin = first.get("begin", "") if isinstance(first, dict) else ""
    said = None if answer is None else answer.reason if "analysis" in begin else answer.preamble
    if check:
        _walk(content, pick, check=True)
    if said is None:
        return ""
    words, pick.words = pick.words, said
    text = _walk(content, pick, check=check)
    pick.words = words
    return text


def _choose(elements: list, pick: _Pick) -> Any:
    """The element whose tag opens as the script would, else the first."""
    for want in pick.prefer:
        for el in elements:
            if isinstance(el, dict) and str(el.get("begin", "")).startswith(want):
                return el
    return elements[0]
