"""The choosing policies, alone: balancers, affinity, experiments, shadow sampling."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policies.affinity import Affinity, Choice, hash64, rendezvous
from policies.balance import (
    BALANCERS,
    LeastInFlight,
    LeastLoad,
    PowerOfTwo,
    RoundRobin,
    load_of,
    make_balancer,
)
from policies.experiments import Arm, Assignment, Experiment, NoLiveArm, ShadowSampler


@dataclass(eq=False)
class W:
    url: str
    in_flight: int = 0
    load: float = 0.0


@dataclass(eq=False)
class Bare:
    """A candidate with no load signal."""

    url: str
    in_flight: int = 0


def workers(*loads: float) -> list[W]:
    return [W(f"http://w{i}", in_flight=int(x), load=x) for i, x in enumerate(loads)]


loads_st = st.lists(st.floats(min_value=0, max_value=1000, allow_nan=False), min_size=1, max_size=12)


# -- balancers ---------------------------------------------------------------


def test_make_balancer_names() -> None:
    assert isinstance(make_balancer("round_robin"), RoundRobin)
    assert isinstance(make_balancer("least_in_flight"), LeastInFlight)
    assert isinstance(make_balancer("least_load"), LeastLoad)
    assert isinstance(make_balancer("power_of_two"), PowerOfTwo)
    assert set(BALANCERS) == {"round_robin", "least_in_flight", "least_load", "power_of_two"}
    with pytest.raises(ValueError, match="unknown balance policy"):
        make_balancer("random")


def test_load_of_falls_back_to_in_flight() -> None:
    assert load_of(W("a", in_flight=1, load=7.5)) == 7.5
    assert load_of(Bare("a", in_flight=3)) == 3


def test_round_robin_cycles() -> None:
    ws = workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.choose(ws).url for _ in range(6)] == [w.url for w in ws] * 2


def test_least_in_flight_picks_min_and_rotates_ties() -> None:
    ws = [W("a", in_flight=3), W("b", in_flight=1), W("c", in_flight=2)]
    b = LeastInFlight()
    assert {b.choose(ws).url for _ in range(5)} == {"b"}
    idle = [W("a"), W("b"), W("c")]
    assert Counter(b.choose(idle).url for _ in range(30)) == {"a": 10, "b": 10, "c": 10}


def test_least_load_uses_load_not_in_flight() -> None:
    ws = [W("a", in_flight=0, load=9.0), W("b", in_flight=5, load=1.0)]
    b = LeastLoad()
    assert {b.choose(ws).url for _ in range(4)} == {"b"}


def test_least_load_ties_rotate() -> None:
    ws = [W("a", load=2.0), W("b", load=1.0), W("c", load=1.0), W("d", load=1.0)]
    b = LeastLoad()
    # the scan starts one further each call and keeps the first minimum it meets
    assert Counter(b.choose(ws).url for _ in range(40)) == {"b": 20, "c": 10, "d": 10}


def test_least_load_on_bare_candidates() -> None:
    ws = [Bare("a", 4), Bare("b", 2), Bare("c", 7)]
    assert LeastLoad().choose(ws).url == "b"


@given(loads_st)
def test_least_load_is_a_minimum(loads: list[float]) -> None:
    ws = workers(*loads)
    b = LeastLoad()
    for _ in range(len(ws)):
        assert b.choose(ws).load == min(loads)


def test_power_of_two_single_candidate() -> None:
    ws = workers(5)
    assert PowerOfTwo(seed=1).choose(ws) is ws[0]


@given(st.floats(0, 100), st.floats(0, 100), st.integers(0, 2**32))
def test_power_of_two_with_two_always_takes_less_loaded(x: float, y: float, seed: int) -> None:
    ws = workers(x, y)
    b = PowerOfTwo(seed=seed)
    for _ in range(10):
        assert b.choose(ws).load == min(x, y)


@given(st.lists(st.floats(0, 1000), min_size=3, max_size=10, unique=True), st.integers(0, 2**32))
def test_power_of_two_never_takes_the_most_loaded(loads: list[float], seed: int) -> None:
    ws = workers(*loads)
    b = PowerOfTwo(seed=seed)
    for _ in range(30):
        assert b.choose(ws).load != max(loads)


def test_power_of_two_is_seedable_and_spreads() -> None:
    ws = workers(0, 0, 0, 0)
    b1, b2, b3 = PowerOfTwo(seed=7), PowerOfTwo(seed=7), PowerOfTwo(rng=random.Random(7))
    picks = [b1.choose(ws).url for _ in range(50)]
    assert picks == [b2.choose(ws).url for _ in range(50)] == [b3.choose(ws).url for _ in range(50)]
    b = PowerOfTwo(seed=11)
    spread = Counter(b.choose(ws).url for _ in range(4000))
    assert set(spread) == {w.url for w in ws}
    assert all(800 < n < 1200 for n in spread.values())


def test_power_of_two_prefers_the_less_loaded_in_aggregate() -> None:
    ws = workers(0, 10, 20, 30)
    b = PowerOfTwo(seed=5)
    counts = Counter(b.choose(ws).url for _ in range(6000))
    # exact expectations: the i-th lightest wins the pairs with heavier ones: 3/6, 2/6, 1/6, 0
    assert counts["http://w3"] == 0
    assert counts["http://w0"] > counts["http://w1"] > counts["http://w2"] > 0
    assert abs(counts["http://w0"] / 6000 - 0.5) < 0.03


# -- affinity ----------------------------------------------------------------


def test_affinity_keeps_preferred_until_overloaded() -> None:
    ws = workers(2, 2, 2)
    aff = Affinity(LeastLoad(), overload_factor=1.5, slack=1.0)
    choice = aff.choose(ws, preferred="http://w1", prefix_key=None)
    assert choice == Choice(ws[1], "affinity")
    # busier than the others but within factor x mean + slack: kept
    ws[1].load = 4.0  # mean 8/3, limit 5.0
    assert aff.choose(ws, preferred="http://w1", prefix_key=None).reason == "affinity"
    ws[1].load = 6.0  # mean 10/3, limit 6.0: not above
    assert aff.choose(ws, preferred="http://w1", prefix_key=None).reason == "affinity"
    ws[1].load = 7.0  # mean 11/3, limit 6.5: overloaded
    choice = aff.choose(ws, preferred="http://w1", prefix_key=None)
    assert choice.reason == "fallback"
    assert choice.candidate is not ws[1]
    assert (choice.moved_from, choice.why) == ("http://w1", "overloaded")


def test_affinity_idle_pool_is_not_overloaded() -> None:
    ws = workers(0, 0, 0, 0)
    ws[2].load = 1.0  # mean 0.25: a factor alone would call this overloaded
    aff = Affinity(RoundRobin(), overload_factor=1.5, slack=2.0)
    assert aff.choose(ws, preferred="http://w2", prefix_key=None) == Choice(ws[2], "affinity")


def test_affinity_single_candidate_is_never_overloaded() -> None:
    ws = workers(500)
    aff = Affinity(RoundRobin(), overload_factor=1.0, slack=0.0)
    assert aff.choose(ws, preferred="http://w0", prefix_key=None).reason == "affinity"


def test_affinity_preferred_unhealthy_falls_back() -> None:
    ws = workers(1, 0, 3)
    aff = Affinity(LeastLoad())
    choice = aff.choose(ws, preferred="http://gone", prefix_key="abc")
    assert choice == Choice(ws[1], "fallback", "http://gone", "unhealthy")


def test_affinity_no_target_balances() -> None:
    ws = workers(1, 0, 3)
    aff = Affinity(LeastLoad())
    assert aff.choose(ws, preferred=None, prefix_key=None) == Choice(ws[1], "balance")


def test_affinity_prefix_is_stable_and_checked_for_overload() -> None:
    ws = workers(0, 0, 0, 0)
    aff = Affinity(LeastLoad(), overload_factor=1.5, slack=2.0)
    first = aff.choose(ws, preferred=None, prefix_key="system-prompt-hash")
    assert first.reason == "prefix"
    # order of candidates does not matter
    for _ in range(5):
        shuffled = ws[:]
        random.shuffle(shuffled)
        assert aff.choose(shuffled, preferred=None, prefix_key="system-prompt-hash").candidate is first.candidate
    first.candidate.load = 50.0
    moved = aff.choose(ws, preferred=None, prefix_key="system-prompt-hash")
    assert moved.reason == "fallback"
    assert moved.candidate is not first.candidate
    assert (moved.moved_from, moved.why) == (first.candidate.url, "overloaded")


def test_affinity_validates() -> None:
    with pytest.raises(ValueError):
        Affinity(RoundRobin(), overload_factor=0.9)
    with pytest.raises(ValueError):
        Affinity(RoundRobin(), slack=-1)


@given(loads_st, st.integers(0, 11), st.floats(1.0, 4.0), st.floats(0.0, 10.0))
def test_affinity_rule(loads: list[float], index: int, factor: float, slack: float) -> None:
    ws = workers(*loads)
    target = ws[index % len(ws)]
    aff = Affinity(LeastLoad(), overload_factor=factor, slack=slack)
    choice = aff.choose(ws, preferred=target.url, prefix_key=None)
    limit = factor * sum(loads) / len(loads) + slack
    assume(abs(target.load - limit) > 1e-6)  # not on the float boundary
    if target.load <= limit:
        assert choice == Choice(target, "affinity")
    else:
        assert choice.reason == "fallback" and choice.candidate is not target
        assert choice.why == "overloaded"


def test_rendezvous_spreads_keys_evenly() -> None:
    ws = workers(*[0] * 8)
    counts = Counter(rendezvous(f"key-{i}", ws).url for i in range(10_000))
    assert set(counts) == {w.url for w in ws}
    assert all(abs(n - 1250) < 200 for n in counts.values())


@pytest.mark.parametrize("n", [3, 5, 8])
def test_rendezvous_adding_a_worker_moves_about_one_in_n(n: int) -> None:
    before = workers(*[0] * n)
    after = before + [W("http://new")]
    keys = [f"prefix-{i}" for i in range(10_000)]
    moved = 0
    for key in keys:
        a, b = rendezvous(key, before), rendezvous(key, after)
        if a is not b:
            assert b.url == "http://new"  # a key only ever moves to the new worker
            moved += 1
    frac = moved / len(keys)
    assert 0.5 / (n + 1) < frac < 2 / (n + 1)


def test_rendezvous_removing_a_worker_moves_only_its_keys() -> None:
    ws = workers(*[0] * 6)
    gone = ws[2]
    rest = [w for w in ws if w is not gone]
    for i in range(5000):
        key = f"k{i}"
        a = rendezvous(key, ws)
        b = rendezvous(key, rest)
        if a is not gone:
            assert a is b


# -- experiments ----------------------------------------------------------------


def test_experiment_90_10_split() -> None:
    exp = Experiment("ab", [Arm("vllm", 90), Arm("sglang", 10)])
    counts = Counter(exp.assign(f"conv_{i}") for i in range(20_000))
    assert abs(counts["vllm"] / 20_000 - 0.9) <= 0.015
    assert abs(counts["sglang"] / 20_000 - 0.1) <= 0.015
    assert exp.assigned == counts


def test_experiment_three_arms_fractional_weights() -> None:
    exp = Experiment("abc", [Arm("a", 0.5), Arm("b", 0.3), Arm("c", 0.2)])
    counts = Counter(exp.assign(f"k{i}") for i in range(20_000))
    for name, share in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert abs(counts[name] / 20_000 - share) <= 0.015


@settings(max_examples=200)
@given(st.text(max_size=64))
def test_experiment_is_sticky(key: str) -> None:
    arms = [Arm("a", 3), Arm("b", 1), Arm("c", 2)]
    one, two = Experiment("x", arms), Experiment("x", list(arms))
    arm = one.assign(key)
    assert arm in {"a", "b", "c"}
    assert one.assign(key) == arm == two.assign(key)
    assert one.assign(key, down=set()) == Assignment(arm, failed_over=False)
    assert one.assign(key, down={"zzz"}) == Assignment(arm, failed_over=False)


def test_experiment_known_value_is_stable_across_processes() -> None:
    # blake2b, not hash(): a fixed key maps to a fixed arm regardless of PYTHONHASHSEED
    # (pinned values: a change here re-shuffles every running experiment on deploy)
    exp = Experiment("ab", [Arm("a", 1), Arm("b", 1)])
    keys = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")
    assert [exp.assign(k) for k in keys] == ["a", "b", "b", "a", "a", "a"]
    assert hash64("http://w0") == 10986018543826534


def test_experiment_failover_is_deterministic_and_counted() -> None:
    arms = [Arm("a", 60), Arm("b", 30), Arm("c", 10)]
    exp = Experiment("fo", arms)
    keys = [f"conv_{i}" for i in range(20_000)]
    home = {k: exp.assign(k) for k in keys}
    results = {k: exp.assign(k, down={"a"}) for k in keys}
    again = Experiment("fo", arms)
    assert all(again.assign(k, down={"a"}) == results[k] for k in keys)
    moved = [k for k in keys if results[k].failed_over]
    assert set(moved) == {k for k in keys if home[k] == "a"}
    assert all(results[k].arm != "a" for k in keys)
    assert all(results[k] == Assignment(home[k]) for k in keys if home[k] != "a")
    assert exp.failovers == {"a": len(moved), "b": 0, "c": 0}
    # moved keys spread by the live weights, 30:10
    to_b = sum(results[k].arm == "b" for k in moved)
    assert abs(to_b / len(moved) - 0.75) < 0.03
    # back up: every key returns home
    assert all(exp.assign(k, down=set()) == Assignment(home[k]) for k in keys)


def test_experiment_all_down() -> None:
    exp = Experiment("x", [Arm("a", 1), Arm("b", 1)])
    with pytest.raises(NoLiveArm):
        exp.assign("k", down={"a", "b"})
    only = Experiment("y", [Arm("a", 1)])
    assert only.assign("k", down=set()) == Assignment("a")
    with pytest.raises(NoLiveArm):
        only.assign("k", down={"a"})


@pytest.mark.parametrize("arms", [
    [],
    [Arm("a", 0)],
    [Arm("a", -1), Arm("b", 1)],
    [Arm("a", math.nan)],
    [Arm("a", math.inf)],
    [Arm("a", 1), Arm("a", 2)],
])
def test_experiment_validates(arms: list[Arm]) -> None:
    with pytest.raises(ValueError):
        Experiment("bad", arms)


def test_experiments_are_independent() -> None:
    arms = [Arm("a", 1), Arm("b", 1)]
    one, two = Experiment("one", arms), Experiment("two", arms)
    same = sum(one.assign(f"k{i}") == two.assign(f"k{i}") for i in range(10_000))
    assert abs(same / 10_000 - 0.5) < 0.03


# -- shadow sampling ----------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.01, 0.1, 0.5])
def test_shadow_rate(rate: float) -> None:
    s = ShadowSampler(rate, seed=1)
    hits = sum(s.sample(f"req_{i}") for i in range(20_000))
    assert abs(hits / 20_000 - rate) <= 0.01


def test_shadow_extremes_and_validation() -> None:
    assert not any(ShadowSampler(0.0).sample(f"r{i}") for i in range(1000))
    assert all(ShadowSampler(1.0).sample(f"r{i}") for i in range(1000))
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError):
            ShadowSampler(bad)


@given(st.text(max_size=64), st.floats(0, 1), st.integers(0, 1000))
def test_shadow_is_deterministic(key: str, rate: float, seed: int) -> None:
    assert ShadowSampler(rate, seed).sample(key) == ShadowSampler(rate, seed).sample(key)


def test_shadow_seed_changes_the_sample() -> None:
    a, b = ShadowSampler(0.5, seed=1), ShadowSampler(0.5, seed=2)
    agree = sum(a.sample(f"r{i}") == b.sample(f"r{i}") for i in range(10_000))
    assert abs(agree / 10_000 - 0.5) < 0.03
