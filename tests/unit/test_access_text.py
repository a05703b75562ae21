"""The text log line with plain data: whatever a client sends, a value stays on its one line and
reads back exactly; other loggers' messages are escaped too, their tracebacks are not."""

from __future__ import annotations

import json
import logging
import sys

from hypothesis import given
from hypothesis import strategies as st

from router.api import access


@given(st.text())
def test_a_quoted_value_is_one_printable_token_that_reads_back(value: str) -> None:
    quoted = access._quote(value)
    if access._BARE.fullmatch(value):
        assert quoted == value
    else:
        assert quoted.startswith('"') and quoted.isascii() and quoted.isprintable()
    assert (json.loads(quoted) if quoted.startswith('"') else quoted) == value


def test_a_field_is_cut_with_a_marker() -> None:
    assert access._cut("a" * access.FIELD_MAX) == "a" * access.FIELD_MAX
    assert access._cut("a" * (access.FIELD_MAX + 5)) == "a" * access.FIELD_MAX + "...[5 more]"
    assert access._cut(None) is None


def test_other_messages_are_escaped_and_tracebacks_kept() -> None:
    formatter = access.TextFormatter("%(levelname)s %(name)s: %(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("router", logging.WARNING, __file__, 1, "model %s\nINFO forged", ("m\x1b[2J",), sys.exc_info())
    out = formatter.format(record)
    first, *rest = out.splitlines()
    assert first == "WARNING router: model m\\u001b[2J\\nINFO forged"
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: boom"
