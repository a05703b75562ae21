"""The fair queue (policies/fair_queue.py) with plain data: bands, service between keys, FIFO within a
key, the lift against banked credit, refusals, decay, forgetting; and a property test over any sequence
of push/pop/remove/charge against a plain list."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fair_queue import FORGET_AFTER_HALF_LIVES, FairQueue, Refused


@dataclass(eq=False)
class Req:
    """An item: matched by identity, like the router's waiters."""

    name: str

    def __repr__(self) -> str:
        return self.name


def queue(max_len: int = 1000, max_per_key: int = 1000, half_life_s: float = 60.0) -> FairQueue[Req]:
    return FairQueue(max_len=max_len, max_per_key=max_per_key, half_life_s=half_life_s)


def fill(q: FairQueue[Req], key: str, n: int, *, band: int = 0, now: float = 0.0) -> list[Req]:
    reqs = [Req(f"{key}{i}") for i in range(n)]
    for req in reqs:
        assert q.push(req, key=key, band=band, now=now) is None
    return reqs


def drain(q: FairQueue[Req], now: float = 0.0) -> list[Req]:
    out: list[Req] = []
    while (req := q.pop(now)) is not None:
        out.append(req)
    return out


def names(reqs: list[Req]) -> list[str]:
    return [r.name for r in reqs]


def test_an_empty_queue_pops_nothing() -> None:
    q = queue()
    assert q.pop(0.0) is None and q.oldest() is None and len(q) == 0 and q.queued("a") == 0 and q.service("a", 0.0) == 0.0


def test_band_0_goes_before_band_1_whatever_the_counters() -> None:
    q = queue()
    q.charge("heavy", 1e9, 0.0)
    fill(q, "light", 2, band=1)
    fill(q, "heavy", 2, band=0)
    fill(q, "mid", 1, band=2)
    assert names(drain(q, 1.0)) == ["heavy0", "heavy1", "light0", "light1", "mid0"]


def test_inside_a_band_less_service_goes_first_and_fifo_within_a_key() -> None:
    q = queue()
    fill(q, "a", 3, now=1.0)
    fill(q, "b", 3, now=1.0)
    q.charge("a", 500.0, 1.0)  # for requests dispatched earlier, while both wait
    q.charge("b", 100.0, 1.0)
    fill(q, "c", 3, now=1.0)  # never charged: 0, but lifted to b's 100 on joining, and b waited longer
    assert names(drain(q, 2.0)) == ["b0", "b1", "b2", "c0", "c1", "c2", "a0", "a1", "a2"]


def test_ties_between_keys_go_to_the_earliest_waiting_entry() -> None:
    q = queue()
    b = Req("b0")
    a = Req("a0")
    assert q.push(b, key="b", band=0, now=0.0) is None
    assert q.push(a, key="a", band=0, now=1.0) is None
    assert q.pop(2.0) is b and q.pop(2.0) is a


def test_served_keys_alternate_when_charged_alike() -> None:
    q = queue()
    fill(q, "a", 3)
    fill(q, "b", 3)
    order = []
    while (req := q.pop(1.0)) is not None:
        order.append(req.name)
        q.charge(req.name[0], 1000.0, 1.0)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_light_key_is_served_after_at_most_one_of_a_floods_entries() -> None:
    q = queue()
    fill(q, "flood", 200)
    now = 0.0
    for _ in range(50):  # the flood is being served alone, charged as it goes
        req = q.pop(now)
        assert req is not None and req.name.startswith("flood")
        q.charge("flood", 2000.0, now)
        now += 0.5
    light = Req("light")
    assert q.push(light, key="light", band=0, now=now) is None
    floods_before = 0
    while (req := q.pop(now)) is not light:
        assert req is not None
        floods_before += 1
        q.charge("flood", 2000.0, now)
    assert floods_before <= 1


def test_a_light_key_that_arrives_first_is_not_buried_by_a_flood_after_it() -> None:
    q = queue()
    light = Req("light")
    assert q.push(light, key="light", band=0, now=0.0) is None
    fill(q, "flood", 100, now=0.1)
    assert q.pop(0.2) is light


def test_the_lift_a_key_back_from_idle_does_not_get_a_burst_ahead_of_a_backlogged_key() -> None:
    q = queue()
    q.charge("idle", 50_000.0, 0.0)  # served once, then idle for ten minutes: its counter decays to ~50 tokens
    now = 600.0
    fill(q, "busy", 40, now=now - 60.0)
    for _ in range(20):  # busy has been served steadily for the last minute
        req = q.pop(now - 60.0)
        assert req is not None
        q.charge("busy", 1000.0, now - 60.0)
    assert q.service("busy", now) > 1000.0 > q.service("idle", now)
    fill(q, "idle", 10, now=now)  # comes back with a burst
    assert q.service("idle", now) == q.service("busy", now)  # lifted to the backlogged key's counter
    order = []
    for _ in range(20):
        req = q.pop(now)
        assert req is not None
        key = req.name.rstrip("0123456789")
        order.append(key)
        q.charge(key, 1000.0, now)
    run = longest = 0
    for key in order:
        run = run + 1 if key == "idle" else 0
        longest = max(longest, run)
    assert longest == 1 and order.count("idle") == 10
    assert order[:2] == ["idle", "busy"]  # the tie after the lift goes to the key with fewer waiting (10 to 20)


def test_a_lifted_key_stays_exactly_level_later_so_the_tie_still_goes_to_the_waiting_key() -> None:
    for i in range(50):  # a decayed copy of the counter would drift from it by a rounding error, either way
        q = queue()
        at = 0.37 * i
        q.charge("busy", 1000.0 + 7.3 * i, at)
        waiting = Req("busy0")
        assert q.push(waiting, key="busy", band=0, now=at) is None
        fill(q, "back", 1, now=at + 13.1 + i)  # as many waiting as busy: the earliest entry wins the tie
        assert q.pop(at + 14.0 + 1.11 * i) is waiting


def test_a_tie_goes_to_the_key_with_fewer_waiting() -> None:
    """A key sending one request at a time is lifted to a flood's counter as it joins: the tie is
    its, so it waits behind no more than the call already running."""
    q = queue()
    q.charge("flood", 5000.0, 0.0)
    fill(q, "flood", 10, now=0.0)
    light = Req("light0")
    assert q.push(light, key="light", band=0, now=1.0) is None
    assert q.service("light", 1.0) == q.service("flood", 1.0)
    assert q.pop(1.0) is light


def test_the_lift_never_lowers_a_counter_and_spares_a_key_already_queued_in_the_band() -> None:
    q = queue()
    q.charge("rich", 9000.0, 0.0)
    q.charge("poor", 10.0, 0.0)
    fill(q, "poor", 1)
    fill(q, "rich", 1)  # already above poor's counter: kept
    assert q.service("rich", 0.0) == 9000.0
    q.charge("other", 500.0, 0.0)
    fill(q, "other", 1)
    q.charge("poor", -10.0, 0.0)  # poor is queued in the band: its pushes no longer lift it
    fill(q, "poor", 1)
    assert q.service("poor", 0.0) == 0.0


def test_the_lift_looks_only_at_the_band_pushed_to() -> None:
    q = queue()
    q.charge("b1", 5000.0, 0.0)
    fill(q, "b1", 1, band=1)
    fill(q, "x", 1, band=0)  # band 0 was empty: nothing to lift to
    assert q.service("x", 0.0) == 0.0
    fill(q, "y", 1, band=1)  # band 1 holds b1 at 5000
    assert q.service("y", 0.0) == 5000.0


def test_a_key_waiting_in_a_lower_band_is_lifted_when_it_joins_a_higher_one() -> None:
    q = queue()
    q.charge("a", 3000.0, 0.0)
    fill(q, "a", 1, band=0)
    fill(q, "k", 5, band=1)  # k waits in band 1 unserved: its counter stays 0
    fill(q, "k", 1, band=0)  # nothing of k's queued in band 0 yet: lifted there
    assert q.service("k", 0.0) == 3000.0


def test_key_full_and_queue_full_and_remove_frees_the_room() -> None:
    q = queue(max_len=4, max_per_key=2)
    a0, a1 = fill(q, "a", 2)
    assert q.push(Req("a2"), key="a", band=0, now=0.0) is Refused.KEY_FULL
    b0, b1 = fill(q, "b", 2)
    assert len(q) == 4
    assert q.push(Req("c0"), key="c", band=1, now=0.0) is Refused.QUEUE_FULL
    assert q.push(Req("a2"), key="a", band=0, now=0.0) is Refused.KEY_FULL  # both: the key's own limit decides
    assert len(q) == 4 and q.queued("a") == 2 and q.queued("c") == 0
    assert q.remove(a0) and not q.remove(a0)
    assert q.queued("a") == 1 and len(q) == 3
    c0 = Req("c0")
    assert q.push(c0, key="c", band=1, now=0.0) is None
    assert q.push(Req("a2"), key="a", band=0, now=0.0) is Refused.QUEUE_FULL
    assert q.remove(b1)
    a2 = Req("a2")
    assert q.push(a2, key="a", band=0, now=0.0) is None
    assert drain(q) == [b0, a1, a2, c0]  # a tie at 0: b, with one waiting, before a with two
    assert not q.remove(a1)  # popped: no longer queued


def test_remove_from_the_middle_keeps_the_rest_in_order() -> None:
    q = queue()
    reqs = fill(q, "a", 5)
    assert q.remove(reqs[2]) and q.remove(reqs[0])
    assert drain(q) == [reqs[1], reqs[3], reqs[4]]
    assert len(q) == 0 and q.queued("a") == 0


def test_oldest_is_the_first_pushed_still_queued() -> None:
    q = queue()
    a = Req("a")
    b = Req("b")
    c = Req("c")
    q.push(a, key="k1", band=1, now=1.0)
    q.push(b, key="k2", band=0, now=2.0)
    q.push(c, key="k2", band=0, now=3.0)
    assert q.oldest() == (a, 1.0)
    assert q.pop(4.0) is b  # band 0 first; a is still the oldest
    assert q.oldest() == (a, 1.0)
    assert q.remove(a)
    assert q.oldest() == (c, 3.0)


def test_an_item_is_queued_at_most_once() -> None:
    q = queue()
    a = Req("a")
    q.push(a, key="k", band=0, now=0.0)
    with pytest.raises(ValueError):
        q.push(a, key="other", band=1, now=0.0)
    assert q.pop(0.0) is a
    assert q.push(a, key="k", band=0, now=1.0) is None  # popped: may come back


def test_bad_settings_and_bands_are_refused() -> None:
    with pytest.raises(ValueError):
        FairQueue(max_len=0, max_per_key=1)
    with pytest.raises(ValueError):
        FairQueue(max_len=1, max_per_key=0)
    with pytest.raises(ValueError):
        FairQueue(max_len=1, max_per_key=1, half_life_s=0.0)
    with pytest.raises(ValueError):
        queue().push(Req("a"), key="k", band=-1, now=0.0)


def test_service_halves_every_half_life() -> None:
    q = queue(half_life_s=60.0)
    q.charge("a", 1000.0, 10.0)
    assert q.service("a", 10.0) == 1000.0
    assert q.service("a", 70.0) == pytest.approx(500.0)
    assert q.service("a", 130.0) == pytest.approx(250.0)
    q.charge("a", 250.0, 130.0)  # added to the decayed value
    assert q.service("a", 190.0) == pytest.approx(250.0)
    assert q.service("a", 0.0) == pytest.approx(500.0)  # a clock read before the last update does not grow it


def test_a_negative_correction_never_takes_the_counter_below_zero() -> None:
    q = queue()
    q.charge("a", 1000.0, 0.0)
    q.charge("a", -400.0, 0.0)
    assert q.service("a", 0.0) == pytest.approx(600.0)
    q.charge("a", -5000.0, 0.0)
    assert q.service("a", 0.0) == 0.0


def test_decay_lets_a_key_served_long_ago_go_first_again() -> None:
    q = queue(half_life_s=60.0)
    q.charge("old", 8000.0, 0.0)
    fill(q, "new", 1, now=0.0)
    fill(q, "old", 1, now=0.0)
    q.charge("new", 1000.0, 300.0)  # while both wait; old has decayed to 250 by then
    assert q.service("old", 300.0) == pytest.approx(250.0)
    assert names(drain(q, 300.0)) == ["old0", "new0"]


def test_idle_counters_decayed_to_nothing_are_forgotten() -> None:
    q = queue(half_life_s=1.0)
    for i in range(1000):
        q.charge(f"k{i}", 1000.0, 0.0)
    fill(q, "queued", 1, now=0.0)
    q.charge("queued", 1000.0, 0.0)
    later = FORGET_AFTER_HALF_LIVES + 1.0
    q.charge("fresh", 10.0, later)
    assert set(q._counters) == {"queued", "fresh"}  # the queued key keeps its counter, however old
    assert q.service("k1", later) == 0.0
    assert q.pop(later) is not None
    q.charge("fresh", 10.0, 2 * later)  # queued went idle at `later`: forgotten a horizon after
    assert set(q._counters) == {"fresh"}


def test_counters_charged_recently_are_kept() -> None:
    q = queue(half_life_s=1.0)
    q.charge("a", 1000.0, 0.0)
    q.charge("b", 1000.0, FORGET_AFTER_HALF_LIVES - 1.0)
    q.charge("c", 1000.0, FORGET_AFTER_HALF_LIVES + 0.5)
    assert set(q._counters) == {"b", "c"}


# Property: any sequence of operations against a plain list of what waits.

KEYS = ("a", "b", "c", "d")

Op = tuple[str, str, int, float]  # (what, key, band or index, tokens or seconds)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(KEYS), st.integers(0, 2), st.just(0.0)),
        st.just(("pop", "", 0, 0.0)),
        st.tuples(st.just("remove"), st.just(""), st.integers(0, 1000), st.just(0.0)),
        st.tuples(st.just("charge"), st.sampled_from(KEYS), st.just(0), st.floats(-3000.0, 5000.0)),
        st.tuples(st.just("tick"), st.just(""), st.just(0), st.floats(0.0, 200.0)),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(ops=ops, max_len=st.integers(1, 8), max_per_key=st.integers(1, 5), half_life_s=st.sampled_from([1.0, 60.0]))
def test_any_sequence_pops_each_item_once_in_band_and_fair_order(
    ops: list[Op], max_len: int, max_per_key: int, half_life_s: float
) -> None:
    q: FairQueue[Req] = FairQueue(max_len=max_len, max_per_key=max_per_key, half_life_s=half_life_s)
    waiting: list[tuple[Req, str, int, float]] = []  # what the queue should hold, in push order
    pushed: list[Req] = []
    popped: list[Req] = []
    removed: list[Req] = []
    now = 0.0

    def check_pop(req: Req | None) -> None:
        if not waiting:
            assert req is None
            return
        assert req is not None
        index = next(i for i, w in enumerate(waiting) if w[0] is req)
        _, key, band, _ = waiting[index]
        assert band == min(w[2] for w in waiting)  # bands first
        assert all(w[1] != key or w[2] != band for w in waiting[:index])  # FIFO within the key, in its band
        mine = q.service(key, now)
        for other in {w[1] for w in waiting if w[2] == band} - {key}:
            theirs = q.service(other, now)
            assert mine <= theirs  # the least served key
            if mine == theirs:  # a tie: the key with fewer entries waiting in the band, then the earliest entry
                count = sum(1 for w in waiting if w[1] == key and w[2] == band)
                their_count = sum(1 for w in waiting if w[1] == other and w[2] == band)
                assert count <= their_count
                if count == their_count:
                    assert index < next(j for j, w in enumerate(waiting) if w[1] == other and w[2] == band)
        del waiting[index]
        popped.append(req)

    for kind, key, number, amount in ops:
        if kind == "push":
            band = number
            req = Req(f"{key}{len(pushed)}")
            in_band = {w[1] for w in waiting if w[2] == band}
            mine = sum(1 for w in waiting if w[1] == key)
            expect = Refused.KEY_FULL if mine >= max_per_key else Refused.QUEUE_FULL if len(waiting) >= max_len else None
            assert q.push(req, key=key, band=band, now=now) is expect
            if expect is None:
                waiting.append((req, key, band, now))
                pushed.append(req)
                if key not in in_band and in_band:  # the lift
                    assert q.service(key, now) >= min(q.service(k, now) for k in in_band)
        elif kind == "pop":
            check_pop(q.pop(now))
        elif kind == "remove":
            if pushed:
                req = pushed[number % len(pushed)]
                queued = any(w[0] is req for w in waiting)
                assert q.remove(req) is queued
                if queued:
                    waiting[:] = [w for w in waiting if w[0] is not req]
                    removed.append(req)
        elif kind == "charge":
            before = q.service(key, now)
            q.charge(key, amount, now)
            assert q.service(key, now) == pytest.approx(max(0.0, before + amount), abs=1e-6)
        else:
            now += amount
        assert len(q) == len(waiting)
        for k in KEYS:
            assert q.queued(k) == sum(1 for w in waiting if w[1] == k)
            assert q.service(k, now) >= 0.0
        assert q.oldest() == ((waiting[0][0], waiting[0][3]) if waiting else None)
        assert len(q._counters) <= len(KEYS)

    while waiting:
        check_pop(q.pop(now))
    assert q.pop(now) is None and len(q) == 0
    assert len({id(r) for r in popped}) == len(popped)  # none twice
    assert {id(r) for r in popped} | {id(r) for r in removed} == {id(r) for r in pushed}  # none lost
    assert not {id(r) for r in popped} & {id(r) for r in removed}
