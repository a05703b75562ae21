"""The kv_aware policy (policies/kv_aware.py) with plain data: cache against load, the load
window, ties, and what was just routed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from policies.kv_aware import KVAware


@dataclass
class W:
    url: str
    in_flight: int = 0
    load: float = 0.0


def workers(*loads: float) -> list[W]:
    return [W(f"http://w{i}", int(load), load) for i, load in enumerate(loads)]


def test_the_cached_worker_wins_among_equals() -> None:
    pool = workers(1, 1, 1)
    chosen, why = KVAware().choose(pool, 4096, {"http://w2": 2048}, prefix_keys=[7])
    assert chosen is pool[2] and why.reason == "cache" and why.expected_cached == 2048


def test_the_prefill_saved_is_weighed_against_the_load() -> None:
    policy = KVAware(tokens_per_request=1024, window=4)
    pool = workers(3, 0)  # w0 holds the whole prompt but runs 3 requests
    assert policy.choose(pool, 4096, {"http://w0": 4096})[0] is pool[0]  # 0 + 3 < 4 + 0
    assert policy.choose(pool, 2048, {"http://w0": 2048})[0] is pool[1]  # 0 + 3 > 2 + 0


def test_a_worker_past_the_load_window_is_never_chosen_for_its_cache() -> None:
    pool = workers(9, 2, 3)
    chosen, why = KVAware(window=4).choose(pool, 100_000, {"http://w0": 100_000, "http://w2": 50_000})
    assert chosen is pool[2] and why.reason == "cache"  # w0 is outside 2 + 4; among the rest, w2's cache decides


def test_with_nothing_cached_it_is_the_least_loaded_and_ties_spread_by_prefix() -> None:
    policy = KVAware()
    pool = workers(2, 1, 3)
    chosen, why = policy.choose(pool, 500, {})
    assert chosen is pool[1] and why.reason == "load" and why.expected_cached == 0
    pool = workers(0, 0, 0, 0)
    picks = Counter(policy.choose(pool, 500, {}, prefix_keys=[key])[0].url for key in range(400))
    assert len(picks) == 4 and min(picks.values()) > 50  # not list order: every worker gets its share
    reversed_picks = Counter(policy.choose(pool[::-1], 500, {}, prefix_keys=[key])[0].url for key in range(400))
    assert picks == reversed_picks


def test_a_prefix_just_routed_counts_as_cached_there_for_a_while() -> None:
    policy = KVAware(speculative_s=2.0)
    pool = workers(0, 0, 0)
    keys = [11, 12, 13]  # three blocks of 1024 tokens
    first, _ = policy.choose(pool, 3072, {}, prefix_keys=keys, now=100.0)
    policy.routed(first.url, keys, 1024, now=100.0)
    first.in_flight, first.load = 1, 1.0  # it is busy now, the others idle
    again, why = policy.choose(pool, 4096, {}, prefix_keys=[11, 12, 13, 14], now=101.0)
    assert again is first and why.reason == "cache" and why.expected_cached == 3072
    later, why = policy.choose(pool, 4096, {}, prefix_keys=[11, 12, 13, 14], now=102.5)
    assert later is not first and why.reason == "load"  # the entry expired: the index must say it now


def test_speculative_entries_are_bounded() -> None:
    policy = KVAware(max_speculative=10)
    for i in range(100):
        policy.routed("http://w0", [i * 10 + j for j in range(4)], 16, now=float(i))
        assert len(policy._speculative) <= 10


@given(st.lists(st.tuples(st.floats(0, 20), st.integers(0, 8192)), min_size=1, max_size=6),
       st.integers(1, 8192), st.floats(0, 8))
def test_the_choice_is_within_the_window_and_of_least_cost(rows: list[tuple[float, int]], prompt: int,
                                                           window: float) -> None:
    policy = KVAware(window=window)
    pool = workers(*(load for load, _ in rows))
    cached = {w.url: have for w, (_, have) in zip(pool, rows, strict=True) if have}
    chosen, why = policy.choose(pool, prompt, cached)
    floor = min(w.load for w in pool) + window
    assert chosen.load <= floor

    def cost(w: W) -> float:
        return (prompt - min(cached.get(w.url, 0), prompt)) / policy.tokens_per_request + w.load

    assert cost(chosen) == min(cost(w) for w in pool if w.load <= floor)
    assert why.expected_cached == min(cached.get(chosen.url, 0), prompt)
