"""Reading vLLM's generate frames: a plain frame's token ids are sliced out, not parsed.

Nearly every frame of a harmony stream from vLLM's ``/inference/v1/generate`` is
``{"request_id":"…","choices":[{"index":0,"logprobs":null,"finish_reason":null,
"token_ids":[1234],"routed_experts":null}],"usage":null}``: the same bytes around
the ids on every frame of one stream. Parsing it with orjson builds three dicts and
two lists to hand back one int. Once one such frame has been parsed and checked,
later ones are recognized by the bytes before (``head``) and after (``tail``) the
ids, and the ids are read from the digits between.

Pure: bytes in, a list of ints or None out; tested against orjson on random frames
(tests/unit/test_harmony_fast_path.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

_KEY = b'"token_ids":['
# What JSON and orjson read as a list of ints without signs, exponents or white space,
# each below 2**63 (orjson's limit is higher, but an id past a u32 is an error anyway).
_IDS = re.compile(rb"(?:0|[1-9][0-9]{0,17})(?:,(?:0|[1-9][0-9]{0,17}))*")
_PROBE = b"7,8"
_PROBE_IDS = [7, 8]
# One id's digits -> [the id], checked once: measured natively, a dict hit ~50 ns against ~0.35 us
# for int(bytes) alone, more with the regex check. Shared by every stream (ids mean the same
# everywhere); bounded: ids past the vocabulary's size are not kept.
_ONE_ID: dict[bytes, list[int]] = {}
_ONE_ID_LIMIT = 262_144
_ONE_ID_MAX = 1 << 18


def plain_step(frame: Any) -> bool:
    """Whether a parsed frame is what a template may be learned from: an object that is
    no worker error (the stream's reader sees those)."""
    return type(frame) is dict and not ("error" in frame and "choices" not in frame)


class IdsTemplate:
    """The bytes around the token ids of one stream's plain frames, once learned.

    ``learn`` is given a parsed frame whose ids, finish and counts ``check`` approves
    (new ids, nothing else); it keeps the frame's head and tail only if the same bytes
    with other ids there parse to a frame ``check`` reads as exactly those ids. A later
    payload that is head, digits and commas, tail, then parses to the same as that
    frame but for the ids: ``read`` gives them. Anything else (white space, a sign, a
    number too long) gives None: parse it. A stream's first frames may differ from the
    rest (vLLM's first has the prompt's ids), so it may learn a few times.
    """

    __slots__ = ("_head", "_tail", "_start", "_end", "_cut", "_lessons")

    def __init__(self) -> None:
        self._head = self._tail = b""
        self._start = self._end = self._cut = 0  # len(head), -len(tail), their sum (0 until learned)
        self._lessons = 3

    @property
    def learned(self) -> tuple[bytes, bytes]:
        """The head and tail (empty until learned)."""
        return self._head, self._tail

    @property
    def learning(self) -> bool:
        """Whether ``learn`` may still learn (a few lessons per stream bound what failed ones cost)."""
        return self._lessons > 0

    def read(self, payload: bytes) -> list[int] | None:
        """The ids of a payload that matches the template, else None. The list may be
        shared: callers only read it."""
        cut = self._cut
        if not cut or len(payload) <= cut:
            return None
        start, end = self._start, self._end
        if payload[:start] != self._head or payload[end:] != self._tail:
            return None
        digits = payload[start:end]
        ids = _ONE_ID.get(digits)
        if ids is not None:
            return ids
        if _IDS.fullmatch(digits) is None:
            return None
        if b"," in digits:
            return [int(d) for d in digits.split(b",")]
        token = int(digits)
        ids = [token]
        if token < _ONE_ID_MAX and len(_ONE_ID) < _ONE_ID_LIMIT:
            _ONE_ID[digits] = ids
        return ids

    def learn(self, payload: bytes, ids: list[int], check: Callable[[Any], bool]) -> None:
        """Learn ``payload``'s head and tail if its ids sit plainly between them (see the class)."""
        if not self._lessons or not ids:
            return
        self._lessons -= 1
        start = payload.find(_KEY)
        if start < 0:
            return
        start += len(_KEY)
        end = payload.find(b"]", start)
        digits = payload[start:end]
        if end < 0 or _IDS.fullmatch(digits) is None or [int(d) for d in digits.split(b",")] != ids:
            return
        head, tail = payload[:start], payload[end:]
        try:
            probe = orjson.loads(head + _PROBE + tail)
        except orjson.JSONDecodeError:
            return
        if not plain_step(probe) or not check(probe):
            return
        self._head, self._tail = head, tail
        self._start, self._end, self._cut = len(head), -len(tail), len(head) + len(tail)


def probe_ids() -> list[int]:
    """The ids ``learn`` puts in its probe: ``check`` must read exactly these."""
    return list(_PROBE_IDS)
