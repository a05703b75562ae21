"""router/api/server.py ``_header_lines``: an answer's extra headers, rendered once and cached."""

from __future__ import annotations

import pytest

from router.api.server import _header_lines


def test_names_are_lowered_and_connection_is_said_apart() -> None:
    assert _header_lines({"X-Router-Pool": "a", "x-router-worker": "http://w:1"}) == (
        b"x-router-pool: a\r\nx-router-worker: http://w:1\r\n", None)
    assert _header_lines({"Connection": "Close", "x-a": "b"}) == (b"x-a: b\r\n", "close")
    assert _header_lines({}) == (b"", None)


@pytest.mark.parametrize("value", ["a\r\nx-forged: 1", "a\nb", "a\r"])
def test_a_value_with_a_line_break_never_reaches_a_head(value: str) -> None:
    with pytest.raises(ValueError, match="line break"):
        _header_lines({"x-router-worker": value})
