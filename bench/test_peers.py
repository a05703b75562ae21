"""bench/peers.py's ratios and table, with plain data (the run itself needs the peers' binaries)."""

from __future__ import annotations

from bench import peers


def _rows(ours: float, create: float, sglang: float, vllm: float) -> dict[str, dict[str, float]]:
    def row(us: float) -> dict[str, float]:
        return {"router_us": us, "sim_us": 100.0, "normalised": us / 100.0, "rps": 1000.0}
    return {"responses-router passthrough": row(ours), "responses-router create (store)": row(create),
            "sglang-router": row(sglang), "vllm-router": row(vllm)}


def test_ratios_set_ours_against_each_peer_and_the_create_against_the_best() -> None:
    got = peers.ratios(_rows(90, 240, 100, 80), "router_us")
    assert got == {"passthrough / sglang-router": 0.9, "passthrough / vllm-router": 1.125,
                   "create / best Rust passthrough": 3.0}
    assert set(got) == set(peers.GOALS)


def test_the_table_has_a_row_per_router_and_round_and_each_goal() -> None:
    text = peers.table([_rows(90, 240, 100, 80), _rows(95, 250, 100, 80)])
    assert text.count("| 1 | ") == 4 and text.count("| 2 | ") == 4
    assert "| passthrough / sglang-router | <= 0.8x | 0.90x; 0.90x | 0.95x; 0.95x |" in text
