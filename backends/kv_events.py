"""The engines' KV-cache event messages, decoded into the index's events (policies/kv_index.py).

vLLM (``vllm/distributed/kv_events.py``) and SGLang publish over ZMQ a message of three frames:
the topic, the sequence number (8 bytes, big-endian) and a msgpack payload, an event batch::

    [ts, [event, ...], data_parallel_rank]      or      {"ts": ..., "events": [...], ...}

Each event is a map tagged by ``"type"`` (vLLM 0.32: ``{"type": "BlockStored", "block_hashes":
[...], ...}``) or, in older versions, a positional array with the tag first, fields in their
declared order::

    BlockStored:  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
    BlockRemoved: block_hashes, medium, group_idx
    AllBlocksCleared

Both are read. A field a version lacks takes its default; an event of another type is skipped; a
payload that is not a batch raises ``BadMessage`` (the subscriber counts it and goes on).
msgspec decodes (what vLLM encodes with): a C decoder, ~1 us per event of 16 tokens.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import msgspec

from policies.kv_index import Cleared, Event, Removed, Space, Stored

_decode = msgspec.msgpack.Decoder().decode

STORED_FIELDS: tuple[str, ...] = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium", "group_idx")


class BadMessage(ValueError):
    """A message that is not an event batch."""


def sequence(frame: bytes) -> int:
    """The sequence number frame: 8 bytes, big-endian, signed (replay's end is -1)."""
    if len(frame) != 8:
        raise BadMessage(f"a sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> list[Event]:
    """The index's events of one batch, in order."""
    try:
        batch = _decode(payload)
    except msgspec.DecodeError as exc:
        raise BadMessage(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise BadMessage(f"not an event batch: {type(batch).__name__}")
    if not isinstance(events, list):
        raise BadMessage("an event batch whose events are not a list")
    out = []
    for raw in events:
        event = _event(raw)
        if event is not None:
            out.append(event)
    return out


def _event(raw: Any) -> Event | None:
    fields: dict[str, Any]
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names: tuple[str, ...] = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise BadMessage(f"an event that is neither a map nor an array: {type(raw).__name__}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return Removed(hashes=_hashes(fields.get("block_hashes")), space=_space(fields))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None  # an event this router does not read


def _stored(fields: dict[str, Any]) -> Stored:
    token_ids, size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(token_ids, list) or not isinstance(size, int) or isinstance(size, bool):
        raise BadMessage("a BlockStored without token_ids or block_size")
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    extra_keys = None
    if isinstance(extra, list) and any(key is not None for key in extra):
        extra_keys = [_hashable(key) for key in extra]
    return Stored(hashes=_hashes(fields.get("block_hashes")), parent=_hashable(parent) if parent is not None else None,
                  token_ids=token_ids, block_size=size, space=_space(fields), extra_keys=extra_keys)


def _hashes(raw: Any) -> list[Hashable]:
    if not isinstance(raw, list):
        raise BadMessage("an event without block_hashes")
    return [_hashable(h) for h in raw]


def _space(fields: dict[str, Any]) -> Space:
    medium, group, lora = fields.get("medium"), fields.get("group_idx"), fields.get("lora_name")
    return (medium if isinstance(medium, str) else "GPU", group if isinstance(group, int) else 0,
            lora if isinstance(lora, str) else None)


def _hashable(value: Any) -> Hashable:
    """msgpack's arrays are lists: as tuples (a hash may be bytes or an int; an extra key a tuple)."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value
