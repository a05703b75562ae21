"""The KV index (policies/kv_index.py) with plain data: what each worker holds, from its events,
against a model that keeps every block's whole prefix."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.kv_index import DEFAULT_SPACE, Cleared, KVIndex, Removed, Stored, block_keys

BS = 4


def blocks(tokens: list[int], first: int, parent: int | None = None, **kw: Any) -> Stored:
    """``tokens`` as stored blocks with engine hashes first, first + 1, ..."""
    n = len(tokens) // BS
    return Stored(hashes=list(range(first, first + n)), parent=parent, token_ids=tokens, block_size=BS, **kw)


PROMPT = list(range(100, 116))  # four blocks


def test_a_worker_holding_a_prefix_is_found_with_its_length_in_tokens() -> None:
    index = KVIndex()
    index.apply("a", blocks(PROMPT[:8], 1))
    index.apply("b", blocks(PROMPT[:4], 11))
    assert index.overlap(PROMPT) == {"a": 8, "b": 4}
    assert index.overlap([*PROMPT[:4], 0, 0, 0, 0]) == {"a": 4, "b": 4}
    assert index.overlap([9, *PROMPT[1:]]) == {}
    assert index.overlap(PROMPT[:3]) == {}  # no full block
    assert index.block_size() == BS and len(index) == 3


def test_blocks_chain_from_their_parent_and_an_unknown_parent_is_not_indexed() -> None:
    index = KVIndex()
    index.apply("a", blocks(PROMPT[:4], 1))
    index.apply("a", blocks(PROMPT[4:12], 2, parent=1))
    assert index.overlap(PROMPT) == {"a": 12}
    index.apply("b", blocks(PROMPT[4:8], 7, parent=99))  # its parent was never seen
    assert index.overlap(PROMPT) == {"a": 12} and index.orphans == 1


def test_a_removed_block_cuts_the_prefix_there() -> None:
    index = KVIndex()
    index.apply("a", blocks(PROMPT, 1))
    index.apply("a", Removed(hashes=[2]))
    assert index.overlap(PROMPT) == {"a": 4}
    index.apply("a", Removed(hashes=[1, 12345]))  # an unknown hash is nothing
    assert index.overlap(PROMPT) == {} and len(index) == 2


def test_cleared_and_forgotten_workers_hold_nothing_and_others_keep_theirs() -> None:
    index = KVIndex()
    index.apply("a", blocks(PROMPT, 1))
    index.apply("b", blocks(PROMPT, 1))  # the same engine hashes on another worker
    index.apply("a", Cleared())
    assert index.overlap(PROMPT) == {"b": 16}
    index.forget("b")
    assert index.overlap(PROMPT) == {} and len(index) == 0


def test_spaces_and_extra_keys_never_match_across() -> None:
    index = KVIndex()
    cpu = ("CPU", 0, None)
    index.apply("a", blocks(PROMPT, 1, space=cpu))
    index.apply("b", blocks(PROMPT, 1, extra_keys=[("salt",)] * 4))
    assert index.overlap(PROMPT) == {}
    assert index.overlap(PROMPT, cpu) == {"a": 16}
    index.apply("c", blocks(PROMPT, 1, space=("GPU", 0, "my-lora")))
    assert index.overlap(PROMPT) == {} and index.overlap(PROMPT, ("GPU", 0, "my-lora")) == {"c": 16}


def test_a_malformed_event_is_counted_not_indexed() -> None:
    index = KVIndex()
    index.apply("a", Stored(hashes=[1, 2], parent=None, token_ids=PROMPT[:5], block_size=BS))
    index.apply("a", Stored(hashes=[1], parent=None, token_ids=PROMPT[:4], block_size=0))
    assert index.malformed == 2 and len(index) == 0


def test_memory_is_bounded_and_the_oldest_goes_first() -> None:
    index = KVIndex(max_blocks=5)
    index.apply("a", blocks(PROMPT, 1))  # stamps 1-4
    index.apply("b", blocks(PROMPT[:8], 1))  # stamps 5-6: a's first block goes
    assert len(index) == 5 and index.evicted == 1
    assert index.overlap(PROMPT) == {"b": 8}  # a lost its first block, so its whole prefix
    index.apply("a", blocks(PROMPT[:4], 1))  # stored again, the newest: a's second block, the oldest, goes
    assert index.overlap(PROMPT) == {"a": 4, "b": 8} and len(index) == 5 and index.evicted == 2


def test_the_callers_keys_give_the_same_answer() -> None:
    index = KVIndex()
    index.apply("a", blocks(PROMPT[:8], 1))
    assert index.overlap(PROMPT, keys=block_keys(PROMPT, BS, DEFAULT_SPACE)) == index.overlap(PROMPT) == {"a": 8}


# -- against a model: each worker's blocks as the whole token prefix they end


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=4 * BS)
ops = st.lists(st.tuples(st.sampled_from(["store", "store_child", "remove", "clear"]), st.sampled_from("abc"),
                         tokens, st.integers(0, 30)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.integers(0, 3), min_size=0, max_size=5 * BS))
def test_the_index_agrees_with_a_model_of_whole_prefixes(operations: list[tuple[str, str, list[int], int]],
                                                         prompt: list[int]) -> None:
    index = KVIndex()
    model: dict[str, dict[int, tuple[int, ...]]] = {}  # worker -> engine hash -> the prefix its block ends
    next_hash = 1000
    for op, worker, toks, pick in operations:
        held = model.setdefault(worker, {})
        toks = toks[:len(toks) // BS * BS]
        if op in ("store", "store_child") and toks:
            parent = None
            base: tuple[int, ...] = ()
            if op == "store_child":
                if not held:
                    continue
                parent = sorted(held)[pick % len(held)]
                base = held[parent]
            hashes = list(range(next_hash, next_hash + len(toks) // BS))
            next_hash += len(hashes)
            index.apply(worker, Stored(hashes=hashes, parent=parent, token_ids=toks, block_size=BS))
            for i, h in enumerate(hashes):
                held[h] = base + tuple(toks[:(i + 1) * BS])
        elif op == "remove" and held:
            h = sorted(held)[pick % len(held)]
            index.apply(worker, Removed(hashes=[h]))
            del held[h]
        elif op == "clear":
            index.apply(worker, Cleared())
            held.clear()
    expected = {}
    for worker, held in model.items():
        prefixes = set(held.values())
        depth = 0
        while (depth + 1) * BS <= len(prompt) and tuple(prompt[:(depth + 1) * BS]) in prefixes:
            depth += 1
        if depth:
            expected[worker] = depth * BS
    if index.block_size() is None:
        expected = {}
    assert index.overlap(prompt) == expected
    assert len(index) == sum(len(held) for held in model.values())


def test_a_removal_names_medium_and_group_and_reaches_a_lora_block() -> None:
    index = KVIndex()
    lora = ("GPU", 0, "my-lora")
    index.apply("a", blocks(PROMPT, 1, space=lora))
    index.apply("a", Removed(hashes=[1]))  # vLLM's BlockRemoved carries no LoRA name
    assert index.overlap(PROMPT, lora) == {} and len(index) == 3
