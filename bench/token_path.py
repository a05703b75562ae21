"""Instructions per streamed token on the router's own path, in one process: an A/B in a minute.

    .venv/bin/python bench/token_path.py [--baseline REV] [--tokens 5000] [--reasoning | --harmony]

``bench/instructions.py`` counts a whole router under callgrind (minutes, and
the stream's start and end spread over its tokens). This counts only the
per-token path: worker bytes into the worker connection (``backends/wire.py``),
SSE frames, the chat dialect's decoder, the runner's reader, the assembler, the
SSE encoder and the router's chunk writer, with stand-in transports instead of
sockets (so no syscalls, and no uvloop). Each token is one read of one HTTP
chunk of one SSE frame, as a paced worker sends it. Counted by callgrind
around ``map``'s calls of ``data_received``, so start-up is left out.
``--reasoning``: every chunk is a piece of reasoning (``"delta":{"reasoning":...}``, as
vLLM 0.32 writes it), not of the answer. ``--harmony``: a harmony (gpt-oss) pool's
stream, vLLM's generate frames of one token id each (the header's few, then the answer's
words: the harmony dialect's ``decode`` and parser instead of the chat one's). ``--run N`` runs the path natively
instead (what bench/test_token_path.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HEAD = (b'{"id":"chatcmpl-da45bc4861a94deb88e7b59ceb0fef96","object":"chat.completion.chunk","created":1795979290,'
        b'"model":"sim-model","choices":[{"index":0,"delta":{"content":"')
TAIL = b'"},"logprobs":null,"finish_reason":null}]}'
WORDS = [b" wait", b" latency", b" a", b" pool", b"models"]
GENERATE = (b'{"request_id":"resp_1-0","choices":[{"index":0,"logprobs":null,"finish_reason":null,'
            b'"token_ids":[%d],"routed_experts":null}],"usage":null}')


class Socket:
    """The client's socket: counts what the router writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


class Worker:
    """The worker's socket: takes the request, never pushes back."""

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def frames(n: int, reasoning: bool = False) -> list[bytes]:
    """``n`` worker reads: each one HTTP chunk holding one SSE frame of one plain text (or reasoning) chunk."""
    head = HEAD.replace(b'"content"', b'"reasoning"') if reasoning else HEAD
    out = []
    for i in range(n):
        sse = b"data: " + head + WORDS[i % len(WORDS)] + TAIL + b"\n\n"
        out.append(b"%x\r\n%s\r\n" % (len(sse), sse))
    return out


def harmony_encoding() -> Any:
    """gpt-oss's encoding, offline (the vocabulary where tests/conftest.py builds it)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    from router.dialects.harmony_vocab import ENV_VAR, ensure_vocab
    if not os.environ.get(ENV_VAR):
        os.environ[ENV_VAR] = str(ensure_vocab(Path.home() / ".cache" / "responses-router" / "harmony").parent)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_frames(n: int, encoding: Any) -> list[bytes]:
    """The final channel's header, then ``n`` reads of one generate frame of one word's token each."""
    ids = encoding.encode("<|channel|>final<|message|>", allowed_special="all")
    words = [encoding.encode(w.decode(), disallowed_special=())[0] for w in WORDS]
    out = []
    for token in ids + [words[i % len(words)] for i in range(n)]:
        sse = b"data: " + GENERATE % token + b"\n\n"
        out.append(b"%x\r\n%s\r\n" % (len(sse), sse))
    return out


def dialect_turn(req: Any, tools: Any, harmony: Any) -> Any:
    """The chat dialect's turn, or with an encoding the harmony one's (vLLM's generate)."""
    if harmony is None:
        from router.dialects.chat import ChatOptions, ChatTurn
        return ChatTurn(req, tools, ChatOptions(), model="m", path="/v1/chat/completions")
    from router.dialects.harmony_turn import HarmonyTurn
    return HarmonyTurn(req, tools, harmony, engine="vllm", context_length=None, request_id="resp_1", model="m")


def path(encoding: Any = None, cut: bool = True) -> SimpleNamespace:
    """The per-token path's real objects over stand-in sockets, the worker's answer head read:
    ``conn`` takes the worker's reads, ``socket.writes`` what reached the client, ``flow.write_paused``
    backs the client's socket up; ``pushing`` is the push reader, not started. A chat pool's turn,
    or with an ``encoding`` a harmony one's; with ``cut``, the cut-through where the tree has one
    (trees before its removal: a ``--baseline`` run measures them as they were)."""
    from backends.client import SSEStream
    from backends.wire import Connection
    from router.api.server import RouterHttpProtocol
    from router.api.sse import encode_events
    from router.metrics import RouterMetrics
    from router.protocol.requests import CreateResponse
    from router.protocol.shapes import response_object
    from router.protocol.tools import build_toolset
    from router.turns.assembler import Assembler
    try:
        from router.turns.reader import reader
    except ImportError:  # revisions before it had its own module
        from router.turns.runner import reader  # type: ignore[attr-defined,no-redef]

    socket = Socket()
    flow = SimpleNamespace(write_paused=False)
    protocol: Any = SimpleNamespace(
        cycle=SimpleNamespace(chunked_encoding=True, response_complete=False, disconnected=False, flow=flow, scope={}),
        raw=socket, transport=SimpleNamespace(held=None))
    scope = protocol.cycle.scope
    if hasattr(RouterHttpProtocol, "chunk_writer"):
        direct = RouterHttpProtocol.chunk_writer(protocol, scope, encode_events)
    else:  # revisions before the chunk writer
        write = RouterHttpProtocol.write_chunk.__get__(protocol)  # type: ignore[attr-defined]
        direct = lambda events: write(encode_events(events))  # noqa: E731

    from backends import wire
    limits = wire.WireLimits() if hasattr(wire, "WireLimits") else None  # revisions before the limits: none
    conn = Connection(SimpleNamespace(loop=asyncio.get_running_loop(), origin="http://worker",  # type: ignore[arg-type]
                                      limits=limits))
    conn.connection_made(Worker())  # type: ignore[arg-type]
    if hasattr(wire, "SENT"):
        conn.state = wire.SENT  # the request is out
    else:  # revisions before the connection's state
        conn.active = True
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    req = CreateResponse(model="m", input="hi")
    tools = build_toolset([], "auto")
    asm = Assembler(response_object(req, response_id="resp_" + "ab" * 24, created_at=1), tools=tools)
    turn = dialect_turn(req, tools, encoding)
    timer = RouterMetrics().timer("m", "arm", "pool")
    held: list[Any] = []
    on_batch = reader(asm, turn, timer, direct, held)
    sse = SSEStream(conn)
    if cut and hasattr(asm, "text_cut") and getattr(turn, "plain_text", None) is not None:
        from router.api.sse import delta_parts
        text_cut = asm.text_cut(turn.plain_text, turn.plain_reasoning, lambda event: RouterHttpProtocol.delta_writer(
            protocol, scope, *delta_parts(event)), timer, held)
        pushing = sse.push(on_batch, turn.decode, text_cut)
    else:
        pushing = sse.push(on_batch, turn.decode) if getattr(turn, "decode", None) else sse.push(on_batch)
    return SimpleNamespace(socket=socket, flow=flow, conn=conn, asm=asm, turn=turn, timer=timer, held=held,
                           pushing=pushing)


async def stream(n: int, reasoning: bool = False, harmony: bool = False, no_cut: bool = False) -> list[bytes]:
    """Runs ``n`` tokens through the path; returns what reached the client's socket."""
    encoding = harmony_encoding() if harmony else None
    p = path(encoding, cut=not no_cut)
    consumer = asyncio.get_running_loop().create_task(p.pushing.__anext__())
    await asyncio.sleep(0)  # the reader is attached and waiting
    reads = harmony_frames(n, encoding) if encoding is not None else frames(n, reasoning)
    list(map(p.conn.data_received, reads))  # callgrind counts inside map's calls only
    consumer.cancel()
    return p.socket.writes


def run(n: int, reasoning: bool = False, harmony: bool = False) -> list[bytes]:
    import uvloop
    return uvloop.run(stream(n, reasoning, harmony))


def count(src: Path, n: int, reasoning: bool, harmony: bool = False) -> float:
    """Instructions per token for the tree at ``src``."""
    cmd = ["valgrind", "--tool=callgrind", "--toggle-collect=map_next", "--callgrind-out-file=/dev/null",
           sys.executable, str(Path(__file__).resolve()), "--run", str(n), *(["--reasoning"] if reasoning else []),
           *(["--harmony"] if harmony else [])]
    done = subprocess.run(cmd, cwd=src, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
    for line in done.stderr.splitlines():
        if "Collected :" in line:
            return int(line.split()[-1]) / n
    raise RuntimeError(f"callgrind gave no count:\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="also count this git revision, and print the ratio")
    p.add_argument("--tokens", type=int, default=5000)
    p.add_argument("--reasoning", action="store_true", help="reasoning chunks instead of answer text")
    p.add_argument("--harmony", action="store_true", help="a harmony pool's generate frames (answer text)")
    p.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        writes = run(args.run, args.reasoning, args.harmony)
        return 0 if len(writes) >= args.run else 1
    rows = {"working tree": count(ROOT, args.tokens, args.reasoning, args.harmony)}
    if args.baseline:
        from bench.procs import export_rev
        src = export_rev(args.baseline, Path(tempfile.mkdtemp(prefix="responses-router-token-path-")))
        rows[f"baseline {args.baseline}"] = count(src, args.tokens, args.reasoning, args.harmony)
    kind = "reasoning" if args.reasoning else "harmony" if args.harmony else "streamed"
    print(f"| router | instructions / {kind} token (in-process path) |")
    print("|---|---:|")
    for name, value in rows.items():
        print(f"| {name} | {value:,.0f} |")
    if args.baseline:
        print(f"\nworking tree / baseline: {rows['working tree'] / rows[f'baseline {args.baseline}']:.3f}x")
    return 0


if __name__ == "__main__":
    if "--run" not in sys.argv and str(ROOT) not in sys.path:  # with --run, PYTHONPATH says which tree
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
