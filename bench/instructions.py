"""Instructions per request and per streamed token, counted by callgrind: the repeatable reading.

    .venv/bin/python bench/instructions.py [--baseline REV] [--requests 50] [--streams 10] [--harmony]
                                           [--write-reference "why"]

Seconds on this machine move by 30-50% from one hour to the next (a shared
VM: the same code and load read 30 or 47 us per token). Instruction counts
do not: the same tree reads the same count to about 0.5% (984.7k and 989.0k
per create in two runs of one tree), so an A/B of two trees is this script,
run once, and ``bench/run.py`` gives the seconds.

The router runs under ``valgrind --tool=callgrind`` (user-space instructions
of every thread; the kernel's share of a syscall is not counted), the sim
runs natively. After a warm-up the counters are zeroed, N requests are sent
one at a time, and the counters are dumped. Streams are paced (5 ms/token)
so that the router, slowed ~50x, still reads one token per read as it does
natively. Beside the router, ``bench/relay.py`` (a byte relay) is counted
the same way on the same streams: the floor per token. With ``--baseline``,
the router of that git revision is counted too and the table prints ratios.
With ``--harmony`` the pool is a harmony (gpt-oss) one, on a sim speaking vLLM's
generate API with real harmony tokens (a streamed answer also holds a few
reasoning tokens); there is no relay row then.

Three counts are read: a create (store: true, 16 tokens), a chat-completions passthrough
request (16 tokens), and a streamed token. Every run prints each against the committed
reference, ``bench/instructions.json`` (the counts at a named revision): run it before
resolving anything that touches the hot path, and keep each ratio within 1.05x.
``--write-reference "why"`` records this run's counts as the new reference; commit that only
in a commit that says why (a saving won, or a cost accepted for a feature).
Nothing is written to bench/RESULTS.md (paste the table there when it matters).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from bench import procs  # noqa: E402
from bench.scenarios import chat_body, responses_body  # noqa: E402

STREAM_TOKENS = 200
STREAM_ITL_MS = 5
REFERENCE = ROOT / "bench" / "instructions.json"
COUNTS = ("create", "passthrough", "stream")  # per create, per passthrough request, per streamed token


def callgrind(argv: list[str], cwd: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]
    return subprocess.Popen(cmd, cwd=cwd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(cwd), "PYTHONUNBUFFERED": "1"})


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while harness.http_status(url + "/health", timeout=5.0) != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"not up under callgrind:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


def count(proc: subprocess.Popen[bytes], out: Path, url: str, path: str, bodies: list[bytes], warmup: int) -> int:
    """Instructions spent serving ``bodies`` one after another (after ``warmup`` requests of the first)."""
    for _ in range(warmup):
        harness.http_post(url + path, bodies[0], timeout=120)
    subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
    for body in bodies:
        status, answer = harness.http_post(url + path, body, timeout=120)
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {answer[:300]!r}")
    dumps_before = set(out.parent.glob(out.name + ".*"))
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    for _ in range(100):
        new = set(out.parent.glob(out.name + ".*")) - dumps_before
        if new:
            time.sleep(0.5)  # written in one go, but give it a moment
            for line in max(new).read_text().splitlines():
                if line.startswith("summary:"):
                    return int(line.split()[1])
        time.sleep(0.2)
    raise RuntimeError("callgrind wrote no dump")


def measure_router(src: Path, sim: harness.Proc, work: Path, n_requests: int, n_streams: int,
                   harmony_vocab: str | None = None) -> dict[str, float]:
    port = harness.kernel_port()
    cfg = work / f"router-{port}.toml"
    cfg.write_text(harness.router_config(port=port, sim_urls=[sim.url], db_path=str(work / f"r-{port}.db"),
                                       harmony_vocab=harmony_vocab))
    out, log = work / f"router-{port}.cg", work / f"router-{port}.log"
    proc = callgrind([sys.executable, "-m", "router", "--config", str(cfg)], src, out, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, log)
        create = count(proc, out, url, "/v1/responses", [responses_body(16).encode()] * n_requests, warmup=20)
        passthrough = 0
        if harmony_vocab is None:  # a harmony pool has no chat passthrough
            passthrough = count(proc, out, url, "/v1/chat/completions", [chat_body(16).encode()] * n_requests, warmup=20)
        stream = responses_body(STREAM_TOKENS, stream=True, itl_ms=STREAM_ITL_MS).encode()
        streamed = count(proc, out, url, "/v1/responses", [stream] * n_streams, warmup=3)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"create": create / n_requests, "passthrough": passthrough / n_requests,
            "stream": streamed / (n_streams * STREAM_TOKENS)}


def measure_relay(sim: harness.Proc, work: Path, n_streams: int) -> float:
    port = harness.kernel_port()
    out, log = work / f"relay-{port}.cg", work / f"relay-{port}.log"
    argv = [sys.executable, "-m", "bench.relay", "--port", str(port), "--upstream-port", str(sim.port)]
    proc = callgrind(argv, ROOT, out, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, log)
        body = chat_body(STREAM_TOKENS, stream=True, itl_ms=STREAM_ITL_MS).encode()
        total = count(proc, out, url, "/v1/chat/completions", [body] * n_streams, warmup=3)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return total / (n_streams * STREAM_TOKENS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="also count the router of this git revision, and print ratios")
    p.add_argument("--requests", type=int, default=50, help="non-stream requests counted (store: true, 16 tokens)")
    p.add_argument("--streams", type=int, default=10, help=f"streams of {STREAM_TOKENS} tokens counted")
    p.add_argument("--harmony", action="store_true",
                   help="a harmony (gpt-oss) pool on a sim speaking vLLM's generate API; no relay row")
    p.add_argument("--write-reference", metavar="WHY",
                   help="record this run's counts in bench/instructions.json (commit it saying why)")
    args = p.parse_args(argv)
    measured = revision()  # before the router loads the tree
    work = Path(tempfile.mkdtemp(prefix="responses-router-instructions-"))
    vocab = None
    if args.harmony:
        from router.dialects.harmony_vocab import ensure_vocab
        vocab = str(ensure_vocab(Path.home() / ".cache" / "responses-router" / "harmony").parent)
    sim = harness.start_sim(work, cpus=None, extra=harness.harmony_sim_args(vocab) if vocab else ())
    try:
        rows = {"working tree": measure_router(ROOT, sim, work, args.requests, args.streams, vocab)}
        if args.baseline:
            src = procs.export_rev(args.baseline, work / "baseline")
            rows[f"baseline {args.baseline}"] = measure_router(src, sim, work, args.requests, args.streams, vocab)
        relay = None if vocab else measure_relay(sim, work, args.streams)
    finally:
        sim.stop()
    kind = "harmony" if vocab else "chat"
    print(table(rows, relay, kind))
    if args.baseline:
        new, old = rows["working tree"], rows[f"baseline {args.baseline}"]
        print(f"\nworking tree / baseline: {ratios(new, old)}")
    reference = read_reference(REFERENCE).get(kind)
    if reference:
        print(f"\nworking tree / reference ({reference['revision']}, bench/instructions.json): "
              f"{ratios(rows['working tree'], reference)}")
    print(f"\n({args.requests} requests and {args.streams} streams of {STREAM_TOKENS} tokens at {STREAM_ITL_MS} ms/token, "
          f"one at a time, after a warm-up; work folder {work})")
    if args.write_reference:
        write_reference(REFERENCE, kind, rows["working tree"], args.write_reference, measured)
        print(f"wrote the {kind} reference to {REFERENCE}")
    return 0


def table(rows: dict[str, dict[str, float]], relay: float | None, kind: str) -> str:
    lines = [f"| router ({kind} pool) | instructions / create (store: true) | / passthrough request | / streamed token "
             "| token vs relay |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        ratio = f"{r['stream'] / relay:.2f}x" if relay else ""
        passthrough = f"{r['passthrough']:,.0f}" if r.get("passthrough") else ""
        lines.append(f"| {name} | {r['create']:,.0f} | {passthrough} | {r['stream']:,.0f} | {ratio} |")
    if relay:
        lines.append(f"| byte relay (bench/relay.py, the floor) | | | {relay:,.0f} | 1.00x |")
    return "\n".join(lines)


def ratios(new: dict[str, float], old: dict[str, float]) -> str:
    """``create 1.012x, passthrough 0.990x, streamed token 1.003x``: each count both sides have."""
    names = {"create": "create", "passthrough": "passthrough", "stream": "streamed token"}
    return ", ".join(f"{names[k]} {new[k] / old[k]:.3f}x" for k in COUNTS if new.get(k) and old.get(k))


def read_reference(path: Path) -> dict[str, dict[str, object]]:
    """The committed reference: for each pool kind, the counts, the revision and why it was set."""
    return json.loads(path.read_text()) if path.exists() else {}


def revision() -> str:
    """The working tree's revision, as the router under count loaded it (``+changes``: uncommitted ones)."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip()
    return rev + ("+changes" if dirty else "")


def write_reference(path: Path, kind: str, counts: dict[str, float], why: str, measured: str) -> None:
    reference = read_reference(path)
    reference[kind] = {"revision": measured, "why": why, **{k: round(counts[k]) for k in COUNTS if counts.get(k)}}
    path.write_text(json.dumps(reference, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
