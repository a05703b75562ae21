"""bench/checkpoint.py's pure form: what a long answer's checkpoints write."""

from __future__ import annotations

from bench.checkpoint import written


def test_growth_writes_each_token_once_where_whole_outputs_write_it_again_and_again() -> None:
    checkpoints, whole, grown = written(1000, 50)  # asserts the log rebuilds the last checkpoint
    assert checkpoints == 20
    # Whole outputs write ~n^2/2 tokens over the answer; growth each token once, plus one event per checkpoint.
    assert grown < whole / 5
    single, _, once = written(50, 50)
    assert single == 1 and once < grown
