"""What a long stored stream's checkpoints write, and what its whole stream costs the router.

    .venv/bin/python bench/checkpoint.py [--tokens 10000] [--every 50]
    .venv/bin/python bench/checkpoint.py --router [--baseline REV] [--tokens 10000] [--itl-ms 2]

A stored stream is checkpointed once a second (router/turns/record.py). The first form
runs the real assembler over a ``--tokens`` answer, checkpointed every ``--every`` tokens
(a second at that many tokens a second), and prints the bytes the checkpoints write: the
whole output each time, as a put of it did, against what ``router.protocol.replay.growth``
appends. Pure, no processes: the same numbers every run.

``--router`` sends one such stream (``store: true``, paced at ``--itl-ms``) through a router
under callgrind, as bench/instructions.py counts, and prints its instructions per token;
with ``--baseline`` the router of that revision too, in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def written(tokens: int, every: int) -> tuple[int, int, int]:
    """(checkpoints, bytes of whole outputs, bytes of growth events) over one answer."""
    from router.dialects.deltas import TextDelta
    from router.protocol.replay import growth, output_of
    from router.protocol.requests import CreateResponse
    from router.protocol.shapes import response_object
    from router.protocol.tools import build_toolset
    from router.turns.assembler import Assembler

    asm = Assembler(response_object(CreateResponse(model="m", input="hi"), response_id="resp_" + "ab" * 24, created_at=1),
                    tools=build_toolset([], "auto"))
    asm.start()
    whole = grown = checkpoints = 0
    logged: list[dict] = []
    last: list[dict] = []
    for i in range(1, tokens + 1):
        asm.feed([TextDelta(f" word{i % 97}")])
        if i % every == 0:
            now = asm.checkpoint()
            events = growth(last, now)
            whole += len(orjson.dumps(now))
            grown += len(orjson.dumps(events))
            logged += events
            last, checkpoints = now, checkpoints + 1
    assert output_of(logged) == last  # what the log holds is the last checkpoint's output
    return checkpoints, whole, grown


def router_run(srcs: dict[str, Path], tokens: int, itl_ms: int) -> dict[str, float]:
    """Instructions per token of one stored stream, for each tree (one sim for all)."""
    import harness
    from bench import instructions
    from bench.scenarios import responses_body

    work = Path(tempfile.mkdtemp(prefix="responses-router-checkpoint-"))
    sim = harness.start_sim(work, cpus=None)
    rows = {}
    try:
        for name, src in srcs.items():
            port = harness.kernel_port()
            cfg = work / f"router-{port}.toml"
            cfg.write_text(harness.router_config(port=port, sim_urls=[sim.url], db_path=str(work / f"r-{port}.db")))
            out, log = work / f"router-{port}.cg", work / f"router-{port}.log"
            proc = instructions.callgrind([sys.executable, "-m", "router", "--config", str(cfg)], src, out, log)
            url = f"http://127.0.0.1:{port}"
            try:
                instructions.wait_up(url, proc, log)
                body = responses_body(tokens, stream=True, itl_ms=itl_ms).encode()
                rows[name] = instructions.count(proc, out, url, "/v1/responses", [body], warmup=1) / tokens
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    finally:
        sim.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--every", type=int, default=50, help="tokens between checkpoints (the first form)")
    p.add_argument("--router", action="store_true", help="count a router's instructions for one such stream")
    p.add_argument("--baseline", help="with --router: also the router of this git revision")
    p.add_argument("--itl-ms", type=int, default=2)
    args = p.parse_args(argv)
    if not args.router:
        n, whole, grown = written(args.tokens, args.every)
        print(f"{args.tokens} tokens, {n} checkpoints: whole outputs {whole:,} bytes, growth {grown:,} bytes "
              f"({whole / max(grown, 1):.1f}x less)")
        return 0
    srcs = {"working tree": ROOT}
    if args.baseline:
        from bench.procs import export_rev
        srcs[f"baseline {args.baseline}"] = export_rev(args.baseline, Path(tempfile.mkdtemp()) / "baseline")
    for name, per_token in router_run(srcs, args.tokens, args.itl_ms).items():
        print(f"| {name} | {per_token:,.0f} instructions / token ({args.tokens} tokens at {args.itl_ms} ms) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
