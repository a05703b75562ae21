"""bench/instructions.py's reference and ratios, with plain data (the counting itself needs valgrind)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import instructions


def test_the_committed_reference_has_every_count_and_says_why() -> None:
    reference = instructions.read_reference(instructions.REFERENCE)["chat"]
    assert set(instructions.COUNTS) <= set(reference) and reference["why"] and reference["revision"]
    assert all(isinstance(reference[k], int) and reference[k] > 0 for k in instructions.COUNTS)


def test_ratios_name_each_count_both_sides_have() -> None:
    new = {"create": 1100.0, "passthrough": 0.0, "stream": 50.0}
    old = {"create": 1000, "passthrough": 400, "stream": 40}
    assert instructions.ratios(new, old) == "create 1.100x, streamed token 1.250x"


def test_a_written_reference_keeps_the_other_pool_kind(tmp_path: Path) -> None:
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"harmony": {"revision": "abc", "why": "x", "create": 5, "stream": 6}}))
    instructions.write_reference(path, "chat", {"create": 1.4, "passthrough": 2.6, "stream": 3.0}, "because", "def")
    written = json.loads(path.read_text())
    assert written["harmony"]["create"] == 5
    assert written["chat"] == {"revision": "def", "why": "because", "create": 1, "passthrough": 3, "stream": 3}
