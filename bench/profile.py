"""Where the router's CPU goes: py-spy on the router process under item 2 and item 3 load.

``.venv/bin/python bench/profile.py [--rev HEAD] [--append]`` starts a fresh sim
and router per scenario (same pinning as bench/run.py), runs
``py-spy record --format raw --threads --full-filenames`` (native frames
off, idle samples off) on the router while the load generator drives it,
then groups the samples by the frame that was on CPU (the leaf):
uvicorn/httptools, starlette, anyio, pydantic, our assembler, orjson,
aiohttp client, the SQLite store thread, the event loop, ... Time in a C
extension shows on the Python line that called it, so a leaf line that calls
``orjson.`` counts as orjson and one that calls ``transport.write`` as socket
writes. Each group's share times the router's measured CPU per request (or
per token) gives microseconds.

Needs ``pip install py-spy`` in the venv. Raw stacks go to bench/out/.
"""

from __future__ import annotations

import argparse
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from bench import procs, scenarios  # noqa: E402
from bench.load import Job  # noqa: E402
from bench.run import choose_layout  # noqa: E402

OUT = ROOT / "bench" / "out"
FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


@dataclass(frozen=True)
class Frame:
    func: str
    file: str
    line: int

    @property
    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def short(self) -> str:
        """``func (path:line)`` with the path cut to its package (site-packages, stdlib or this repo)."""
        f = self.file
        for marker in ("site-packages/", "/python3.11/", "/python3.12/", "/python3.13/"):
            if marker in f:
                f = f.split(marker, 1)[1]
                break
        else:
            for pkg in ("/router/", "/backends/", "/policies/"):
                if pkg in f:
                    f = pkg[1:] + f.split(pkg, 1)[1]
                    break
        return f"{self.func} ({f}:{self.line})"


def parse_raw(path: Path) -> list[tuple[str, list[Frame], int]]:
    """py-spy raw (collapsed) output -> (thread name, frames root..leaf, samples)."""
    out = []
    for line in path.read_text().split("\n"):  # not splitlines(): a frame name may hold \x0c or \x1c
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        thread = parts[0].split(": ", 1)[-1] if parts[0].startswith("thread (") else "?"
        frames = []
        for p in parts[1:] if parts[0].startswith("thread (") else parts:
            m = FRAME_RE.match(p)
            frames.append(Frame(m["func"], m["file"], int(m["line"])) if m else Frame(p, "?", 0))
        out.append((thread, frames, int(count)))
    return out


GROUPS = [
    "uvicorn/httptools (HTTP server, parsing, ASGI send/receive)",
    "socket writes (transport.write: the send syscalls)",
    "starlette routing + middleware",
    "starlette Request/Response/StreamingResponse",
    "anyio (StreamingResponse task group, disconnect listener)",
    "pydantic validation",
    "our assembler (router/turns/assembler.py)",
    "orjson (dumps/loads, on the calling line)",
    "router other (api, runner, dialect, ids, items, pools; dataclass __init__)",
    "aiohttp client (upstream request, response, SSE reads)",
    "store calls on the event loop (run_in_executor, futures)",
    "sqlite store thread (SQL + orjson of rows)",
    "event loop (uvloop C: epoll, socket reads, callbacks)",
    "asyncio Python (tasks, futures, queues, locks)",
    "logging",
    "other threads",
    "other",
]


def classify(thread: str, frames: list[Frame]) -> str:
    """The group of one sample, from its leaf frame (and thread)."""
    if thread != "MainThread":
        if thread.startswith("sqlite") or any("/router/state/" in f.file for f in frames):
            return "sqlite store thread (SQL + orjson of rows)"
        return "other threads"
    leaf = frames[-1] if frames else Frame("?", "?", 0)
    file, src = leaf.file, leaf.source
    if leaf.func in ("Runner.run", "run_until_complete") or "/uvloop/" in file:
        # uvloop's loop is C: its own work (epoll, socket reads, handles, callbacks into C
        # protocols) shows on the Python frame that started the loop
        return "event loop (uvloop C: epoll, socket reads, callbacks)"
    if "orjson." in src:
        return "orjson (dumps/loads, on the calling line)"
    if "transport.write" in src or "self._transport.write" in src or "writelines(" in src:
        return "socket writes (transport.write: the send syscalls)"
    if "/uvicorn/" in file or "/httptools/" in file:
        return "uvicorn/httptools (HTTP server, parsing, ASGI send/receive)"
    if "/starlette/" in file:
        if file.endswith(("routing.py", "applications.py", "_exception_handler.py")) or "/middleware/" in file:
            return "starlette routing + middleware"
        return "starlette Request/Response/StreamingResponse"
    if "/anyio/" in file:
        return "anyio (StreamingResponse task group, disconnect listener)"
    if "/pydantic" in file or "model_validate" in src:
        return "pydantic validation"
    if file.endswith("router/turns/assembler.py"):
        return "our assembler (router/turns/assembler.py)"
    if any(p in file for p in ("/aiohttp/", "/yarl/", "/multidict/", "/aiohappyeyeballs/", "backends/client.py")):
        return "aiohttp client (upstream request, response, SSE reads)"
    if "/router/state/" in file or file.endswith("concurrent/futures/thread.py"):
        return "store calls on the event loop (run_in_executor, futures)"
    if "/router/" in file or "/backends/" in file or "/policies/" in file or file == "<string>":
        return "router other (api, runner, dialect, ids, items, pools; dataclass __init__)"
    if "/asyncio/" in file or file.endswith(("contextvars", "<frozen runpy>")):
        return "asyncio Python (tasks, futures, queues, locks)"
    if "/logging/" in file:
        return "logging"
    return "other"


INCLUSIVE = {
    "aiohttp client (any frame in aiohttp or backends/client.py)":
        lambda fs: any("/aiohttp/" in f.file or "backends/client.py" in f.file for f in fs),
    "our assembler (any frame)": lambda fs: any(f.file.endswith("router/turns/assembler.py") for f in fs),
    "ResponseRun (router/turns/runner.py, any frame)": lambda fs: any(f.file.endswith("router/turns/runner.py") for f in fs),
    "SSE encode_events (router/api/sse.py)": lambda fs: any(f.func.startswith("encode_events") for f in fs),
    "pydantic (any frame, or model_validate line)":
        lambda fs: any("/pydantic" in f.file or "model_validate" in f.source for f in fs),
    "starlette (any frame below uvicorn's run_asgi)": lambda fs: any("/starlette/" in f.file for f in fs),
}


def summarize(samples: list[tuple[str, list[Frame], int]], us_per_unit: float, unit: str,
              rate: int, cpu_s: float, gil: bool) -> str:
    """Markdown: self time by group, some inclusive shares, the top leaf lines.

    Shares are of the samples; microseconds scale the shares to the router's measured CPU per
    unit. Without ``--gil`` py-spy counts a thread as active when the OS says it is runnable,
    which includes waiting for a CPU, so ``sampled s`` above the CPU seconds means preemption
    inflated the samples at syscall lines. With ``--gil`` only the GIL holder is sampled, so
    C code that releases the GIL (SQLite's own work, epoll) is missing from the samples: the
    microseconds then scale to the sampled seconds, and the rest of the CPU is shown apart."""
    total = sum(n for _, _, n in samples) or 1
    sampled_s = total / rate
    if gil and sampled_s < cpu_s:
        scale = us_per_unit * sampled_s / cpu_s  # us per unit that the samples stand for
        released = us_per_unit - scale
    else:
        scale, released = us_per_unit, 0.0
    groups: Counter[str] = Counter()
    leaves: Counter[tuple[str, str, str]] = Counter()
    inclusive: Counter[str] = Counter()
    for thread, frames, n in samples:
        group = classify(thread, frames)
        groups[group] += n
        leaf = frames[-1] if frames else Frame("?", "?", 0)
        leaves[(group.split(" (")[0], leaf.short(), leaf.source[:70])] += n
        if thread == "MainThread":
            for name, pred in INCLUSIVE.items():
                if pred(frames):
                    inclusive[name] += n
    mode = "GIL holder only" if gil else "every runnable thread"
    lines = [f"py-spy ({mode}): {total} samples = {sampled_s:.1f} sampled s vs {cpu_s:.1f} s router CPU (/proc) in "
             f"py-spy's window; router CPU {us_per_unit:.0f} us/{unit} in the measured phase", "",
             f"| group (self time, leaf frame) | share of samples | ~us/{unit} |", "|---|---:|---:|"]
    for group, n in groups.most_common():
        lines.append(f"| {group} | {n / total:.1%} | {n / total * scale:.1f} |")
    if released:
        lines.append(f"| not sampled: CPU with the GIL released (SQLite's C work, epoll and other syscalls "
                     f"outside the GIL, GIL hand-offs) | | {released:.1f} |")
    lines += ["", f"| inclusive (main thread) | share of samples | ~us/{unit} |", "|---|---:|---:|"]
    for name, n in inclusive.most_common():
        lines.append(f"| {name} | {n / total:.1%} | {n / total * scale:.1f} |")
    lines += ["", "| top leaf lines | group | share | source |", "|---|---|---:|---|"]
    for (group, frame, src), n in leaves.most_common(25):
        lines.append(f"| `{frame}` | {group} | {n / total:.1%} | `{src.replace('|', '/')}` |")
    return "\n".join(lines)


def profile_one(name: str, job: Job, unit_of: Any, layout: Any, src: Path, workdir: Path,
                rate: int, split_threads: bool, gil: bool) -> tuple[str, dict[str, Any]]:
    """Fresh sim + router, py-spy on the router while ``job`` runs; the markdown summary and the load result."""
    sim = harness.start_sim(workdir, cpus=layout.sim, src=src)
    try:
        router = harness.start_router_for(workdir, [sim.url], cpus=layout.router, src=src)
        try:
            if split_threads and procs.can_pin():
                # the event-loop thread alone on CPU 0; the store thread, sim and load generator on
                # the rest: otherwise py-spy counts the loop thread as active while it waits for the
                # CPU the store thread holds (it shows up at GIL-releasing syscalls such as getrandom)
                cpus = sorted(os.sched_getaffinity(0))
                procs.pin_threads(router.pid, {cpus[0]}, set(cpus[1:]))
            OUT.mkdir(parents=True, exist_ok=True)
            raw = OUT / f"profile-{name}.txt"
            spy_log = open(workdir / f"py-spy-{name}.log", "w")
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(router.pid),
                                    "--rate", str(rate), "--format", "raw", "--threads", "--full-filenames",
                                    # nonblocking: blocking mode pauses the process, and paused threads
                                    # waiting in epoll or on the executor queue were counted as active
                                    "--nonblocking", *(["--gil"] if gil else []),
                                    "-o", str(raw)], stdout=spy_log, stderr=subprocess.STDOUT)
            time.sleep(1.0)  # py-spy attaches
            cpu0 = procs.cpu_seconds(router.pid)
            job.port = router.port
            job.watch = {"router": router.pid, "sim": sim.pid}
            job.cpus = layout.loadgen
            result = scenarios.run_load(job)
            window_cpu_s = procs.cpu_seconds(router.pid) - cpu0  # warm-up included, like py-spy's window
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        finally:
            router.stop()
    finally:
        sim.stop()
    units, unit = unit_of(result)
    us = result["procs"]["router"]["cpu_s"] / max(units, 1) * 1e6
    threads = result["procs"]["router"]["threads_cpu_s"]
    split = ", ".join(f"{'main' if t.startswith('main/') else 'other'} thread {v / max(units, 1) * 1e6:.0f} us/{unit}"
                      for t, v in sorted(threads.items(), key=lambda kv: -kv[1]))
    behind = [line.strip() for line in (workdir / f"py-spy-{name}.log").read_text().splitlines() if "behind" in line]
    summary = summarize(parse_raw(raw), us, unit, rate, window_cpu_s, gil)
    head = f"router CPU by thread (/proc/PID/task, measured phase): {split}"
    if behind:
        head += f"\n\npy-spy: {behind[-1]}"
    return f"{head}\n\n{summary}", result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/profile.py", description=__doc__.split("\n")[0])
    p.add_argument("--rev", help="profile this git revision (git archive) instead of the working tree")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--requests", type=int, default=8000, help="non-stream requests")
    p.add_argument("--concurrency", type=int, default=32, help="of the non-stream requests")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="profile the non-stream scenario only")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--itl-ms", type=int, default=12, help="stream pacing, ms/token")
    p.add_argument("--layout", choices=("auto", "router-alone", "none"), default="router-alone",
                   help="CPU pinning; router-alone by default so py-spy's samples are not inflated by the "
                        "router waiting for a CPU the sim holds")
    p.add_argument("--split-threads", action="store_true",
                   help="pin the router's event-loop thread alone on CPU 0, its other threads elsewhere")
    p.add_argument("--no-gil", dest="gil", action="store_false",
                   help="sample every runnable thread, not only the GIL holder (counts a thread that waits "
                        "for the CPU as busy: preemption points such as getrandom get inflated)")
    p.add_argument("--append", action="store_true", help="write the summaries to bench/RESULTS.md (in place of the last profile)")
    args = p.parse_args(argv)
    if shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        print("py-spy is not installed in this venv: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    layout = choose_layout(args.layout)
    procs.raise_nofile(8192)
    workdir = Path(tempfile.mkdtemp(prefix="responses-router-profile-"))
    src = procs.export_rev(args.rev, workdir / "src") if args.rev else harness.ROOT
    s = scenarios.Settings()
    jobs = [
        (f"nonstream-c{args.concurrency}", Job(kind="closed", port=0, path="/v1/responses",
                                               body=scenarios.responses_body(s.nonstream_tokens),
                                               concurrency=args.concurrency, requests=args.requests, warmup=500),
         lambda r: (r["requests"], "request")),
        (f"stream-c{args.streams}", Job(kind="streams", port=0, path="/v1/responses",
                                        body=scenarios.responses_body(s.stream_tokens, stream=True, itl_ms=args.itl_ms),
                                        streams=args.streams, warmup_streams=4, expect_tokens=s.stream_tokens,
                                        warmup_body=scenarios.responses_body(50, stream=True, itl_ms=1)),
         lambda r: (r["tokens"], "token")),
    ]
    if not args.stream:
        jobs = jobs[:1]
    sections = []
    for name, job, unit_of in jobs:
        print(f"[profile] {name}", file=sys.stderr, flush=True)
        summary, result = profile_one(name, job, unit_of, layout, src, workdir, args.rate, args.split_threads,
                                      args.gil)
        extra = (f"{result['rps']:.0f} req/s" if job.kind == "closed"
                 else f"{result['tokens_per_s']:.0f} tokens/s, {result['chunks'] / max(result['tokens'], 1):.2f} writes/token")
        sections.append(f"### {name} ({extra}; {layout.describe()})\n\n{summary}\n")
        print(sections[-1])
    shutil.rmtree(workdir, ignore_errors=True)
    if args.append:
        from bench.report import replace_section

        replace_section(ROOT / "bench" / "RESULTS.md", "Latest profile",
                        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} (py-spy {args.rate} Hz, native off)\n\n"
                        + "\n".join(sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
