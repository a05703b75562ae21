"""The cut-through of a streamed token (``Assembler.text_cut``): the same bytes and state as the usual way.

A read that is one whole HTTP chunk of one SSE frame of a plain text chunk goes from
the worker's connection to the client's socket without the HTTP parser, the frame
split, the JSON decoder, an event dict or the encoder. These tests drive the real
objects of that path (worker connection, SSE stream, chat dialect, assembler, the
router's chunk writers) with stand-in sockets, once with the cut and once without,
on random reads, and compare what reached the client and what the assembler holds.
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.wire import Connection, WireLimits
from bench.token_path import Worker, path
from router.api.sse import delta_parts, encode_events
from router.turns.assembler import Assembler

HEAD = (b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1795979290,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":')
TAIL = b'},"logprobs":null,"finish_reason":null}]}'
PLAIN = st.text(st.characters(blacklist_characters='"\\', blacklist_categories=("Cs",), min_codepoint=0x20), min_size=1)


# ------------------------------------------------------------------ the frame's parts


@given(text=PLAIN, number=st.integers(0, 2**53), index=st.integers(0, 1000), item=st.text(min_size=1, max_size=60))
def test_delta_parts_put_together_are_the_encoded_event(text: str, number: int, index: int, item: str) -> None:
    event = {"type": "response.output_text.delta", "item_id": item, "output_index": index, "content_index": index % 3,
             "delta": "", "logprobs": (), "sequence_number": 0}
    pre, mid, post = delta_parts(event)
    assert orjson.dumps(text) == b'"' + text.encode() + b'"'  # what the cut writes as the text's JSON
    expected = encode_events([{**event, "delta": text, "sequence_number": number}])
    assert pre + text.encode() + mid + b"%d" % number + post == expected


# ------------------------------------------------------------------ the path, with and without the cut


async def _serve(reads: list[tuple[bytes, bool]], cut: bool) -> tuple[list[bytes], list[list[dict]], dict[str, Any]]:
    """``reads`` (bytes, the client's socket backed up) through the path; the client's writes, the
    batches held for the ASGI send, and the response once the turn is closed."""
    p = path(cut=cut)
    socket, flow, conn, asm, turn, timer, held, pushing = (p.socket, p.flow, p.conn, p.asm, p.turn, p.timer, p.held,
                                                          p.pushing)
    socket.writes.append(encode_events(asm.start()))
    loop = asyncio.get_running_loop()
    consumer = loop.create_task(pushing.__anext__())
    await asyncio.sleep(0)
    for data, paused in reads:
        if conn.paused:  # the socket drains: the runner sends the held batches, and reading resumes
            flow.write_paused = False
            for _ in range(10):
                if consumer.done():
                    break
                await asyncio.sleep(0)
            if not consumer.done() or consumer.exception() is not None:
                break
            while held:  # as uvicorn frames an ASGI body message
                sent = encode_events(held.pop(0))
                socket.writes.append(b"%x\r\n%s\r\n" % (len(sent), sent))
            consumer = loop.create_task(pushing.__anext__())
            await asyncio.sleep(0)
        flow.write_paused = paused
        conn.data_received(data)
        if conn.error is not None:
            break
    consumer.cancel()
    final = asm.feed(turn.end()) + asm.close_turn() + asm.finish(None)
    return socket.writes, held, {"final": encode_events(final), "tokens": timer.tokens}


def _normalized(outcome: Any) -> bytes:
    """The two runs' outcomes with their clock readings (``completed_at``, Unix seconds) taken out."""
    return re.sub(rb"completed_at\W+\d+", b"completed_at T", repr(outcome).encode())


CHUNKS = st.one_of(
    st.builds(lambda t: HEAD + orjson.dumps(t) + TAIL, PLAIN),  # plain text: the cut's
    st.builds(lambda t: HEAD + orjson.dumps(t) + TAIL, st.text(min_size=1)),  # quotes, escapes, control characters
    st.builds(lambda t: HEAD + b'"' + t + b'"' + TAIL, st.binary(min_size=1, max_size=6).filter(
        lambda b: b'"' not in b and b"\\" not in b and all(c >= 0x20 for c in b))),  # not always UTF-8
    st.builds(lambda t: HEAD.replace(b'"content"', b'"reasoning"') + orjson.dumps(t) + TAIL, PLAIN),
    st.builds(lambda t: HEAD.replace(b'"content"', b'"reasoning_content"') + orjson.dumps(t) + TAIL, st.text(min_size=1)),
    st.builds(lambda t: HEAD.replace(b'"content":', b'"role":"assistant","content":') + orjson.dumps(t) + TAIL, PLAIN),
    st.just(b'{"id":"chatcmpl-1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'),
)


@st.composite
def worker_reads(draw: st.DrawFn) -> list[tuple[bytes, bool]]:
    """A chat stream's frames, chunked and read in random ways (most reads one frame in one chunk)."""
    frames = [b"data: " + chunk + b"\n\n" for chunk in draw(st.lists(CHUNKS, min_size=1, max_size=25))]
    body_chunks: list[bytes] = []
    i = 0
    while i < len(frames):
        take = draw(st.sampled_from([1, 1, 1, 1, 2]))
        body_chunks.append(b"".join(frames[i:i + take]))
        i += take
    wire = b""
    for payload in body_chunks:
        size = draw(st.sampled_from([b"%x", b"%x", b"%X", b"0%x", b"%x;ext=1"])) % len(payload)
        if draw(st.integers(0, 9)) == 0 and len(payload) > 4:  # a frame split over two chunks
            cut_at = draw(st.integers(1, len(payload) - 1))
            wire += b"%x\r\n%s\r\n%x\r\n%s\r\n" % (cut_at, payload[:cut_at], len(payload) - cut_at, payload[cut_at:])
        else:
            wire += size + b"\r\n" + payload + b"\r\n"
        wire += b"\x00"  # a read boundary candidate (removed below)
    pieces = [p for p in wire.split(b"\x00") if p]
    reads: list[tuple[bytes, bool]] = []
    for piece in pieces:  # mostly whole chunks; sometimes two together, or one split in two reads
        how = draw(st.integers(0, 9))
        if how == 0 and reads:
            reads[-1] = (reads[-1][0] + piece, reads[-1][1])
        elif how == 1 and len(piece) > 2:
            at = draw(st.integers(1, len(piece) - 1))
            reads += [(piece[:at], False), (piece[at:], False)]
        else:
            reads.append((piece, draw(st.integers(0, 14)) == 0))
    return reads


@settings(max_examples=300, deadline=None)
@given(reads=worker_reads())
def test_the_cut_writes_and_keeps_what_the_usual_way_does(reads: list[tuple[bytes, bool]]) -> None:
    with_cut = asyncio.run(_serve(reads, cut=True))
    without = asyncio.run(_serve(reads, cut=False))
    assert _normalized(with_cut) == _normalized(without)


@pytest.mark.parametrize("key", [b"content", b"reasoning", b"reasoning_content"])
def test_most_reads_of_a_paced_stream_take_the_cut(key: bytes) -> None:
    """Checks the test above compares the cut at all: a plain stream's reads after the first go through it."""
    words = [b" alpha", b" beta", b" \xc3\xa9t\xc3\xa9", b" gamma"] * 5
    head = HEAD.replace(b'"content"', b'"%s"' % key)
    reads = []
    for w in words:
        frame = b"data: " + head + b'"' + w + b'"' + TAIL + b"\n\n"
        reads.append((b"%x\r\n%s\r\n" % (len(frame), frame), False))
    cut_calls = 0
    original = Assembler.text_cut

    def counting(self: Assembler, *args: Any) -> Any:
        cut = original(self, *args)

        def counted(payload: bytes) -> bool:
            nonlocal cut_calls
            taken = cut(payload)
            cut_calls += taken
            return taken
        return counted

    Assembler.text_cut = counting  # type: ignore[method-assign]
    try:
        writes, held, outcome = asyncio.run(_serve(reads, cut=True))
    finally:
        Assembler.text_cut = original  # type: ignore[method-assign]
    # The first teaches the decoder (and opens the item); an answer's second makes its part's template.
    assert cut_calls == len(words) - (2 if key == b"content" else 1)
    assert held == [] and outcome["tokens"] == len(words)
    kind = "response.output_text.delta" if key == b"content" else "response.reasoning_text.delta"
    deltas = [e for w in writes[1:] for e in _events(w)]
    assert "".join(e["delta"] for e in deltas if e["type"] == kind) == b"".join(words).decode()


def test_the_cut_gives_way_while_the_socket_is_backed_up_and_takes_over_after() -> None:
    """Reads 6 to 8 find the client's socket backed up: their events are held (the cut refuses,
    nothing written), the runner sends them once it drains, and the cut takes the reads after."""
    reads = []
    for i in range(16):
        frame = b"data: " + HEAD + b'" w%d"' % i + TAIL + b"\n\n"
        reads.append((b"%x\r\n%s\r\n" % (len(frame), frame), 6 <= i <= 8))
    taken: list[int] = []
    original = Assembler.text_cut

    def watched(self: Assembler, *args: Any) -> Any:
        cut = original(self, *args)

        def watching(payload: bytes) -> bool:
            if cut(payload):
                taken.append(int(payload.split(b'" w')[1].split(b'"')[0]))
                return True
            return False
        return watching

    Assembler.text_cut = watched  # type: ignore[method-assign]
    try:
        with_cut = asyncio.run(_serve(reads, cut=True))
    finally:
        Assembler.text_cut = original  # type: ignore[method-assign]
    assert taken == [2, 3, 4, 5, 9, 10, 11, 12, 13, 14, 15]
    assert _normalized(with_cut) == _normalized(asyncio.run(_serve(reads, cut=False)))
    writes, held, outcome = with_cut
    deltas = [e["delta"] for w in writes[1:] for e in _events(w) if e["type"] == "response.output_text.delta"]
    assert deltas == [" w%d" % i for i in range(16)] and held == [] and outcome["tokens"] == 16


def _events(write: bytes) -> list[dict]:
    size, rest = write.split(b"\r\n", 1)
    assert int(size, 16) == len(rest) - 2
    return [orjson.loads(frame.split(b"\ndata: ", 1)[1]) for frame in rest[:-2].split(b"\n\n")[:-1]]


# ------------------------------------------------------------------ the wire's part: whole chunks only


def test_a_read_that_looks_like_a_chunk_inside_a_chunk_is_parsed() -> None:
    """The parser in the middle of a chunk: bytes shaped like a whole chunk are that chunk's payload."""
    async def main() -> tuple[list[bytes], list[bytes]]:
        conn = Connection(SimpleNamespace(loop=asyncio.get_running_loop(), origin="http://worker",  # type: ignore[arg-type]
                                          limits=WireLimits()))
        conn.connection_made(Worker())  # type: ignore[arg-type]
        conn.active = True
        taken: list[bytes] = []
        bodies: list[bytes] = []
        conn.sink = bodies.append
        conn.cut = lambda payload: taken.append(payload) or True  # type: ignore[func-returns-value]
        conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        conn.data_received(b"4\r\nabcd\r\n")  # parsed: the parser is now between chunks
        conn.data_received(b"3\r\nxyz\r\n")  # a whole chunk at a boundary: cut
        conn.data_received(b"12\r\n01234567")  # a chunk of 18 bytes, 8 of them here
        conn.data_received(b"5\r\nhello\r\n")  # its other 10 bytes, shaped like a chunk
        conn.data_received(b"\r\n3\r\nend\r\n")
        conn.data_received(b"2\r\nok\r\n")  # at a boundary again: cut
        conn.data_received(b"0\r\n\r\n")
        assert conn.complete and conn.error is None
        return taken, bodies
    taken, bodies = asyncio.run(main())
    assert taken == [b"xyz", b"ok"]
    assert b"".join(bodies) == b"abcd" + b"01234567" + b"5\r\nhello\r\n" + b"end"
