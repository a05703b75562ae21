"""The benchmark suite, one command: ``.venv/bin/python bench/run.py [--quick]``.

Starts sim workers (zero-latency unless a request's marker paces them) and
the router as real processes, drives them from a pinned load-generator
process, prints a table of ratios against the targets of the performance
issue and writes it, with the machine's description, to bench/RESULTS.md in place of the last one.

Phases: (A) one sim + one router: direct chat baseline, chat passthrough
(when the route exists), /v1/responses non-stream, c=1 again in alternating
blocks (the latency verdict: no drift between baseline and router), streaming CPU per token;
(B) a fresh sim + router: 1,000 concurrent open streams (RSS per stream);
(C) bench/chain_load.py's run() when that file exists; (D) item 7: bench/affinity.py,
affinity vs round robin on prefix-caching sims (its own workers and routers).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from bench import affinity, procs, report, scenarios  # noqa: E402
from bench.scenarios import Layout, Settings  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"


def choose_layout(kind: str) -> Layout:
    """CPU pinning. 'auto': the load generator alone on the last CPU; with 3+ CPUs the router
    and the sim get one each, with 2 they share CPU 0. 'router-alone' (2+ CPUs): the router
    alone on CPU 0, sim and load generator share the rest. 'none': nothing pinned."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if kind == "none" or not procs.can_pin():
        return Layout()
    if kind == "router-alone":
        return Layout(loadgen=cpus[1:], router=cpus[:1], sim=cpus[1:])
    if len(cpus) >= 3:
        return Layout(loadgen=[cpus[2]], router=[cpus[0]], sim=[cpus[1]])
    return Layout(loadgen=[cpus[-1]], router=[cpus[0]], sim=[cpus[0]])


def describe_source(rev: str | None) -> str:
    """Which router code ran: a git revision, or the working tree (read-only git queries)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.rstrip()  # not strip(): a porcelain line may begin with a space
    if rev:
        return f"git revision {rev} ({git('rev-parse', '--short', rev)}), exported with git archive"
    dirty = [line for line in git("status", "--porcelain").splitlines() if not line[3:].startswith("bench/")]
    return f"working tree at {git('rev-parse', '--short', 'HEAD')}" + (
        f" with {len(dirty)} uncommitted changes outside bench/" if dirty else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller counts (~1 minute)")
    p.add_argument("--rev", help="run the router and sim of this git revision (git archive) "
                                 "instead of the working tree, e.g. HEAD while the tree is mid-edit")
    p.add_argument("--layout", choices=("auto", "router-alone", "none"), default="auto", help="CPU pinning")
    p.add_argument("--no-append", action="store_true", help="print only; do not write bench/RESULTS.md")
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs, SQLite files)")
    p.add_argument("--items", default="1,2,3,4,5,7,8",
                   help="which items to run, e.g. 2,3 (6 comes with 1 and 2; 8: items 2 and 3 on a harmony pool)")
    for name, default in vars(Settings()).items():
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            p.add_argument("--" + name.replace("_", "-"), type=type(default), default=None,
                           help=f"default {default} ({getattr(Settings.quick(), name)} with --quick)")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings.quick() if args.quick else Settings()
    for name in vars(s):
        value = getattr(args, name, None)
        if value is not None:
            setattr(s, name, value)
    return s


def _step(msg: str) -> float:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
    return time.perf_counter()


def run_all(s: Settings, layout: Layout, src: Path, workdir: Path, items: set[str]) -> dict[str, Any]:
    """Phases A, B, C (those ``items`` need); every process stopped on the way out."""
    res: dict[str, Any] = {}
    if items & {"1", "2", "3"}:
        sim = harness.start_sim(workdir, cpus=layout.sim, src=src)
        try:
            router = harness.start_router_for(workdir, [sim.url], cpus=layout.router, src=src)
            try:
                if items & {"1", "2"}:
                    _step("direct chat completions to the sim (baseline), c=1 and c=32")
                    res["direct"] = scenarios.direct_chat(sim, s, layout)
                if "1" in items:
                    _step("item 1: chat passthrough through the router")
                    res["chat"] = scenarios.chat_passthrough(router, sim, s, layout)
                if "2" in items:
                    _step("item 2: /v1/responses non-stream, store=true, c=1 and c=32")
                    res["responses"] = scenarios.responses_nonstream(router, sim, s, layout)
                    _step("beside item 2: the same with store=false at c=32")
                    res["nostore"] = scenarios.responses_nostore(router, sim, s, layout)
                if items & {"1", "2"}:
                    _step("beside items 1 and 2: c=1 in alternating blocks (direct, passthrough, create, store=false)")
                    res["paired"] = scenarios.c1_paired(router, sim, s, layout)
                if "3" in items:
                    _step(f"item 3: streaming, 1 and {s.stream_c64} streams of {s.stream_tokens} tokens")
                    res["streaming"] = scenarios.streaming_cpu(router, sim, s, layout)
                    _step("beside item 3: the same streams through a byte relay (bench/relay.py), the floor")
                    relay = procs.start_relay(workdir, sim, cpus=layout.router, src=src)
                    try:
                        res["floor"] = scenarios.streaming_floor(relay, sim, s, layout)
                    finally:
                        relay.stop()
            finally:
                router.stop()
        finally:
            sim.stop()

    shapes = [("open", s.open_tokens, s.open_itl_ms, s.open_ramp_s), ("burst", s.burst_tokens, s.burst_itl_ms, 0.0)]
    for key, tokens, itl, ramp in shapes if "4" in items else []:
        if not tokens:
            continue
        _step(f"item 4 ({key}): {s.open_streams} concurrent streams of {tokens} tokens at {itl} ms/token "
              "(fresh sim and router)")
        sim = harness.start_sim(workdir, cpus=layout.sim, src=src, max_concurrency=max(2000, s.open_streams * 2))
        try:
            router = harness.start_router_for(workdir, [sim.url], cpus=layout.router, src=src)
            try:
                res[key] = scenarios.open_streams(router, sim, s, layout, tokens=tokens, itl_ms=itl, ramp_s=ramp)
                res[key]["router_log"] = router.log_tail(5)
            finally:
                router.stop()
        finally:
            sim.stop()

    if "8" in items:
        _step("item 8: items 2 and 3 on a harmony (gpt-oss) pool: a sim speaking vLLM's generate API")
        from router.dialects.harmony_vocab import ensure_vocab
        vocab = str(ensure_vocab(Path.home() / ".cache" / "responses-router" / "harmony").parent)
        sim = harness.start_sim(workdir, cpus=layout.sim, src=src, extra=harness.harmony_sim_args(vocab))
        try:
            router = harness.start_router_for(workdir, [sim.url], cpus=layout.router, src=src, harmony_vocab=vocab)
            try:
                res["harmony_responses"] = scenarios.responses_nonstream(router, sim, s, layout)
                res["harmony_streaming"] = scenarios.streaming_cpu(router, sim, s, layout, harmony=True)
            finally:
                router.stop()
        finally:
            sim.stop()

    if "5" in items:
        _step("item 5: chain load (bench/chain_load.py)")
        if src != harness.ROOT and str(src) not in sys.path:
            sys.path.insert(0, str(src))  # chain_load imports the store in this process: the same code as above
        res["chain"] = scenarios.chain_load()
    if "7" in items:
        _step("item 7: affinity vs round robin on prefix-caching sims (bench/affinity.py)")
        res["affinity"] = affinity.run(affinity.Settings(), workdir)  # not pinned: five processes
    return res


def affinity_rows(res: dict[str, Any]) -> list[report.Row]:
    """Item 7 in the main table: round robin in the baseline column, affinity in the router column."""
    if "affinity" not in res:
        return []
    out = []
    for measure, rr, af in affinity.rows(res["affinity"]):
        value, ratio = (af[:-1].rsplit(" (", 1)) if af.endswith("x)") else (af, "")
        out.append(report.Row("7", f"affinity vs round robin: {measure}", rr, value, ratio))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from(args)
    layout = choose_layout(args.layout)
    nofile = procs.raise_nofile(max(8192, s.open_streams * 4 + 256))  # the router holds 2 sockets per stream
    workdir = Path(tempfile.mkdtemp(prefix="responses-router-bench-"))
    load_before = procs.loadavg()
    t0 = _step(f"work folder {workdir}; {layout.describe()}; RLIMIT_NOFILE {nofile}; load average {load_before}")
    src = procs.export_rev(args.rev, workdir / "src") if args.rev else harness.ROOT
    source = describe_source(args.rev)
    ok = False
    try:
        res = run_all(s, layout, src, workdir, set(args.items.split(",")))
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"[bench] logs kept in {workdir}", file=sys.stderr)
    elapsed = time.perf_counter() - t0

    table = report.markdown_table(report.build_rows(res) + affinity_rows(res))
    print(table)
    info = procs.machine_info()
    notes = [
        f"router code: {source}",
        f"pinning: {layout.describe()}",
        f"mode: {'--quick' if args.quick else 'full'}, {elapsed:.0f} s; non-stream answers {s.nonstream_tokens} "
        f"tokens; c=1: {s.c1_requests} requests after {s.c1_warmup} warm-up, c=32: {s.c32_requests} after "
        f"{s.c32_warmup}",
        f"sim: zero-latency (`--max-concurrency 2000`), streams paced per request with `[sim:itl_ms=N]` (same "
        f"as `--itl-ms N`): {s.stream_c1_itl_ms} ms/token for 1 stream ({s.stream_c1_rounds} in a row), "
        f"{s.stream_c64_itl_ms} ms/token for {s.stream_c64} streams; item 4: {s.open_streams} streams of "
        f"{s.open_tokens} tokens at {s.open_itl_ms} ms/token sent over {s.open_ramp_s:g} s (all open at once "
        "without overloading the machine)"
        + (f", then {s.open_streams} sent at once of {s.burst_tokens} tokens at {s.burst_itl_ms} ms/token (burst)"
           if s.burst_tokens else ""),
        f"load generator busy: {report.loadgen_busy(res)}",
        f"machine load average (1 min) before/after: {load_before} / {procs.loadavg()} "
        "(other work on the machine skews req/s and latency; CPU per request/token much less)",
        "CPU: router /proc/PID/stat utime+stime delta over the measured phase (schedstat ns sum as a cross-check), "
        "divided by requests or by tokens delivered (output_text.delta events counted by the client)",
    ]
    if "affinity" in res:
        notes.append(f"item 7 (bench/affinity.py): {affinity.describe(res['affinity']['settings'])}; "
                     "round robin in the sim column, affinity in the router column")
    print("\n".join(f"- {n}" for n in notes))
    if not args.no_append:
        report.replace_section(RESULTS, "Latest full run", report.results_entry(info, table, notes))
        print(f"\nwritten to {RESULTS.relative_to(ROOT)} (Latest full run)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
