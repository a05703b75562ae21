"""bench/report.py's paired c=1 rows, from plain data: the verdict is the median of the blocks' differences."""

from __future__ import annotations

from bench.report import _median, _paired_rows, build_rows


def block(p50: float, router_us: float = 0.0, sim_us: float = 0.0, ok: int = 100) -> dict[str, float]:
    return {"p50_ms": p50, "ok": ok, "requests": 100, "router_us": router_us, "sim_us": sim_us}


def test_median_of_odd_and_even_counts() -> None:
    assert _median([3.0, 1.0, 2.0]) == 2.0
    assert _median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_paired_rows_judge_the_median_difference_not_the_medians() -> None:
    # Block by block the router adds 0.40-0.45 ms; the medians of each column alone differ by 0.6.
    paired = {
        "direct": [block(0.2, sim_us=200), block(0.5, sim_us=220), block(0.9, sim_us=240)],
        "passthrough": [block(0.3, 150, 300), block(0.6, 160, 310), block(1.0, 170, 320)],
        "create": [block(0.6, 500, 350), block(0.95, 520, 360), block(1.3, 540, 370)],
        "create_nostore": [block(0.5, 380), block(0.8, 390), block(1.2, 400)],
    }
    rows = {r.measure.split(",")[0]: r for r in _paired_rows(paired)}
    create = rows["responses store=true c=1 added p50 ms"]
    assert create.ratio.startswith("+0.40 ms") and create.verdict == "meets"
    assert "blocks +0.40 to +0.45" in create.ratio
    passthrough = rows["chat passthrough c=1 added p50 ms"]
    assert passthrough.ratio.startswith("+0.10 ms") and passthrough.verdict == "meets"
    cpu = rows["c=1 CPU us/request"]
    assert "create 520 (store=false 390: persisting ~130)" in cpu.router
    assert cpu.baseline == "sim alone: 220" and cpu.ratio == "sim +140 us behind the router"


def test_paired_rows_count_errors_and_miss_over_the_target() -> None:
    paired = {k: [block(0.2), block(0.2)] for k in ("direct", "passthrough", "create_nostore")}
    paired["create"] = [block(0.9, ok=97), block(0.8)]
    create = next(r for r in _paired_rows(paired) if r.measure.startswith("responses"))
    assert create.verdict == "misses" and "(3 errors)" in create.router


def test_without_paired_blocks_the_c1_row_keeps_its_verdict() -> None:
    def run(p50: float) -> dict:
        return {"rps": 1000.0, "p50_ms": p50, "p99_ms": p50 * 2, "requests": 100, "ok": 100, "statuses": {"200": 100},
                "procs": {"router": {"cpu_s": 0.03, "sched_s": 0.03}, "sim": {"cpu_s": 0.02, "sched_s": 0.02}}}
    res = {"direct": {1: run(0.3)}, "responses": {1: run(0.7)}}
    row = next(r for r in build_rows(res) if r.measure == "responses store=true c=1 p50 ms")
    assert row.verdict == "meets"
    res["paired"] = {k: [block(0.3)] for k in ("direct", "passthrough", "create", "create_nostore")}
    row = next(r for r in build_rows(res) if r.measure == "responses store=true c=1 p50 ms")
    assert row.verdict == "" and row.target == "verdict: paired row"
