"""One upstream read's decoded frames -> events: the per-token step of a model turn's stream.

Kept apart from router/turns/runner.py, which drives a whole response: this runs once per
streamed token, in the worker connection's ``data_received`` (push mode), so it is one
function with nothing around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.dialects.deltas import ReasoningText
from router.dialects.turn import DialectTurn
from router.turns.assembler import Assembler, Event
from router.turns.meters import Timer

__all__ = ["reader"]


def reader(asm: Assembler, turn: DialectTurn, timer: Timer | None, direct: Callable[[list[Event]], bool] | None,
           held: list[list[Event]]) -> Callable[[list[Any]], bool]:
    """The step the pull and push readers of a turn share: one upstream read's decoded frames
    -> its events, counted as output tokens, written through ``direct`` at once when it takes
    them (push mode, a streaming HTTP answer), else appended to ``held`` for the reader to
    yield. Returns False when a batch was held: the push reader stops reading until the held
    batches are sent, so the order stays.

    A read of one plain text chunk (nearly every read of a stream), which the dialect's
    ``decode`` gives as its text, takes a fast path: the assembler's ``text`` instead of
    deltas and ``feed``'s dispatch; one of plain reasoning (a ``ReasoningText``) the
    assembler's ``reasoning``. They give the same events and state as the general way
    (tests/unit/test_fast_path.py). Measured: ~11.5k fewer instructions per streamed token, of
    ~52k from the worker's read to the client's write; ~0.5k fewer for this being one
    function, not a translate step called by a push callback.
    """
    decode = turn.chunk
    if asm.obfuscating:  # every delta padded: the general way only (Assembler.obfuscate)
        return _general(asm, decode, timer, direct, held)

    def on_batch(batch: list[Any]) -> bool:
        events = None
        n = len(batch)
        if n == 1:
            first = batch[0]
            kind = type(first)
            if kind is str:
                events = asm.text(first)
            elif kind is ReasoningText:
                events = asm.reasoning(first)
            if events is None:
                events = asm.feed(decode(first))
        else:
            events = asm.feed([d for frame in batch for d in decode(frame)])
        if events:
            if timer is not None:
                timer.token(n)
            if held or direct is None or not direct(events):
                held.append(events)
                return False
        return True

    return on_batch


def _general(asm: Assembler, decode: Callable[[Any], Any], timer: Timer | None, direct: Callable[[list[Event]], bool] | None,
             held: list[list[Event]]) -> Callable[[list[Any]], bool]:
    """``reader``'s step without the fast paths: every frame's deltas through ``Assembler.feed``."""

    def on_batch(batch: list[Any]) -> bool:
        events = asm.feed([d for frame in batch for d in decode(frame)])
        if events:
            if timer is not None:
                timer.token(len(batch))
            if held or direct is None or not direct(events):
                held.append(events)
                return False
        return True

    return on_batch
