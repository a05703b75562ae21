"""The simulated worker's instances of JSON schemas: deterministic values that validate (tool
arguments, structured output), and the engine's error for a schema with no finite instance."""

from __future__ import annotations

import math
import zlib
from typing import Any

import orjson

VOCAB = tuple("the router streams tokens from a simulated worker while clients wait for answers "
              "and every request finds its pool quickly models think about cache prefix latency "
              "queue batch of small words today".split())
_STRING_FORMATS: dict[Any, str] = {"date-time": "2024-01-01T00:00:00Z", "date": "2024-01-01", "time": "00:00:00Z",
                                   "email": "sim@example.com", "uri": "https://example.com/sim",
                                   "uuid": "00000000-0000-4000-8000-000000000000", "ipv4": "127.0.0.1"}  # by a schema's "format"
_SCHEMA_DEPTH = 6  # past this, recursive schemas get only required properties and no items
_SCHEMA_MAX_DEPTH = 64  # deeper than this, a schema's instance never ends: it recurses through required fields


class SimError(Exception):
    """A request the engine would refuse; args are (status, message, param)."""


def schema_instance(schema: object, root: object = None, path: str = "", depth: int = 0) -> object:
    """A deterministic value that validates against a JSON schema: every
    property filled (required or not), the first enum/const value, the first
    anyOf/oneOf branch, one array element, nested objects recursively, local
    $refs followed; no schema -> {}. A schema with no finite instance ({"$ref": "#"}, a
    required field of its own type) is a 400, as vLLM answers one its grammar backend cannot
    compile (vllm/v1/structured_output/backend_xgrammar.py, validate_xgrammar_grammar)."""
    root = schema if root is None else root
    if depth > _SCHEMA_MAX_DEPTH:
        raise SimError(400, "Failed to transform json schema into a grammar: it has no finite "
                       "instance (a $ref to itself with no way to end)", None)
    if not isinstance(schema, dict):
        return {}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target: object = root
        for part in (p for p in ref[1:].split("/") if p):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return schema_instance(target, root, path, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema_instance(schema[key][0], root, path, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else None
    if kind == "object":
        props = given if isinstance(given := schema.get("properties"), dict) else {}
        required = listed if isinstance(listed := schema.get("required"), list) else []
        return {name: schema_instance(sub, root, f"{path}.{name}", depth + 1)
                for name, sub in props.items() if depth < _SCHEMA_DEPTH or name in required}
    if kind == "array":
        prefix = given if isinstance(given := schema.get("prefixItems"), list) else []
        items = [schema_instance(s, root, f"{path}[{i}]", depth + 1) for i, s in enumerate(prefix)]
        want = max(int(schema.get("minItems", 0)), 0 if depth >= _SCHEMA_DEPTH or prefix else 1)
        want = min(want, int(schema.get("maxItems", want)))
        while len(items) < want:
            items.append(schema_instance(schema.get("items", {}), root, f"{path}[]", depth + 1))
        return items
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    if kind == "string":
        text = _STRING_FORMATS.get(schema.get("format"),
                                   VOCAB[zlib.crc32(path.encode()) % len(VOCAB)])
        text = text.ljust(int(schema.get("minLength", 0)), "x")
        return text[:int(schema["maxLength"])] if "maxLength" in schema else text
    return {}


def _number(schema: dict, integer: bool) -> int | float:
    """1 moved inside the schema's bounds; whole even for "number" (clients often read such fields as integers)."""
    value: int | float = 1
    step = 1 if integer else 0.5
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(low, (int, float)):
        value = max(value, math.ceil(low) if integer else low)
    if isinstance(ex_low, (int, float)):
        value = max(value, math.floor(ex_low) + 1 if integer else ex_low + step)
    if isinstance(high, (int, float)):
        value = min(value, math.floor(high) if integer else high)
    if isinstance(ex_high, (int, float)):
        value = min(value, math.ceil(ex_high) - 1 if integer else ex_high - step)
    return value


def compact_json(value: object) -> str:
    return orjson.dumps(value).decode()
