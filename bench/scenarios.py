"""The measurements (items 1-6 of the benchmark), each a function over running processes.

Every function takes the processes it drives plus ``Settings`` and returns
plain dicts; ``bench/report.py`` turns them into the table. The load itself
always runs in a separate, pinned process (``bench/load.py``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.load import Job
from harness import ROOT, Proc, http_post
from harness.sim import MODEL

BENCH = Path(__file__).resolve().parent


@dataclass
class Layout:
    """Which CPUs each process is pinned to (empty list: not pinned)."""

    loadgen: list[int] = field(default_factory=list)
    router: list[int] = field(default_factory=list)
    sim: list[int] = field(default_factory=list)

    def describe(self) -> str:
        def cpus(c: list[int]) -> str:
            return "cpu " + ",".join(map(str, c)) if c else "unpinned"
        return f"load generator: {cpus(self.loadgen)}; router: {cpus(self.router)}; sim: {cpus(self.sim)}"


@dataclass
class Settings:
    """Request counts and stream shapes; ``--quick`` shrinks them."""

    nonstream_tokens: int = 16
    c1_requests: int = 2000
    c1_warmup: int = 200
    c32_requests: int = 10000
    c32_warmup: int = 1000
    stream_tokens: int = 1000
    stream_c1_rounds: int = 4  # sequential 1-stream runs (CPU ticks are 10 ms: give them enough work)
    stream_c1_itl_ms: int = 1
    stream_c64: int = 64
    stream_c64_itl_ms: int = 12
    open_streams: int = 1000
    # 4a: paced so that all streams are open at once without overloading 2 cores (RSS per stream)
    open_tokens: int = 40
    open_itl_ms: int = 250
    open_ramp_s: float = 2.0  # the 1,000 requests are sent evenly over this long
    # 4b: the burst shape of the issue (20 ms x 200 tokens: ~50k tokens/s asked); 0 tokens skips it
    burst_tokens: int = 200
    burst_itl_ms: int = 20
    # Beside items 1 and 2: c=1 in alternating blocks (direct, passthrough, create, create store=false)
    paired_blocks: int = 8
    paired_requests: int = 250
    max_s: float = 90.0

    @classmethod
    def quick(cls) -> Settings:
        return cls(c1_requests=500, c1_warmup=100, c32_requests=3000, c32_warmup=300, stream_c1_rounds=2,
                   stream_c64_itl_ms=8, burst_tokens=0, paired_blocks=4, paired_requests=100)


def run_load(job: Job) -> dict[str, Any]:
    """Run one job in a fresh load-generator process; its JSON result."""
    argv = [sys.executable, "-m", "bench.load", json.dumps(asdict(job))]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=job.max_s + 120)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return dict(orjson.loads(out.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------- request bodies


def chat_body(tokens: int, *, stream: bool = False, itl_ms: int | None = None) -> str:
    """A chat-completions body; the sim reads its markers from the last user message."""
    text = f"Benchmark request, answer briefly [sim:tokens={tokens}]" + (f" [sim:itl_ms={itl_ms}]" if itl_ms else "")
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
    return json.dumps(body)


def responses_body(tokens: int, *, stream: bool = False, itl_ms: int | None = None, store: bool = True) -> str:
    """A /v1/responses body (``store: true`` unless told); it reaches the sim as the same user message as ``chat_body``."""
    text = f"Benchmark request, answer briefly [sim:tokens={tokens}]" + (f" [sim:itl_ms={itl_ms}]" if itl_ms else "")
    return json.dumps({"model": MODEL, "input": text, "store": store, "stream": stream})


def _closed(port: int, path: str, body: str, concurrency: int, requests: int, warmup: int,
            layout: Layout, watch: dict[str, int], max_s: float) -> dict[str, Any]:
    return run_load(Job(kind="closed", port=port, path=path, body=body, concurrency=concurrency, requests=requests,
                        warmup=warmup, cpus=layout.loadgen, watch=watch, max_s=max_s))


def _levels(s: Settings) -> list[tuple[int, int, int]]:
    return [(1, s.c1_requests, s.c1_warmup), (32, s.c32_requests, s.c32_warmup)]


# ---------------------------------------------------------------- items 1, 2, 6


def direct_chat(sim: Proc, s: Settings, layout: Layout) -> dict[int, dict[str, Any]]:
    """The baseline: POST /v1/chat/completions straight to the sim, at concurrency 1 and 32."""
    body = chat_body(s.nonstream_tokens)
    return {c: _closed(sim.port, "/v1/chat/completions", body, c, n, w, layout, {"sim": sim.pid}, s.max_s)
            for c, n, w in _levels(s)}


def router_has_chat_route(router: Proc) -> bool:
    """True once the router answers POST /v1/chat/completions with anything but 404/405."""
    status, _ = http_post(router.url + "/v1/chat/completions", chat_body(4).encode())
    return status not in (0, 404, 405)


def chat_passthrough(router: Proc, sim: Proc, s: Settings, layout: Layout) -> dict[int, dict[str, Any]] | None:
    """Item 1: the same chat body through the router's passthrough route; None while the route is missing."""
    if not router_has_chat_route(router):
        return None
    body = chat_body(s.nonstream_tokens)
    watch = {"router": router.pid, "sim": sim.pid}
    return {c: _closed(router.port, "/v1/chat/completions", body, c, n, w, layout, watch, s.max_s)
            for c, n, w in _levels(s)}


def responses_nonstream(router: Proc, sim: Proc, s: Settings, layout: Layout) -> dict[int, dict[str, Any]]:
    """Item 2: POST /v1/responses, non-stream, store: true (SQLite), at concurrency 1 and 32."""
    body = responses_body(s.nonstream_tokens)
    watch = {"router": router.pid, "sim": sim.pid}
    return {c: _closed(router.port, "/v1/responses", body, c, n, w, layout, watch, s.max_s)
            for c, n, w in _levels(s)}


def responses_nostore(router: Proc, sim: Proc, s: Settings, layout: Layout) -> dict[str, Any]:
    """Beside item 2: the same at c=32 with ``store: false``, so the difference is what persisting costs."""
    return _closed(router.port, "/v1/responses", responses_body(s.nonstream_tokens, store=False), 32,
                   s.c32_requests // 2, s.c32_warmup, layout, {"router": router.pid, "sim": sim.pid}, s.max_s)


def c1_paired(router: Proc, sim: Proc, s: Settings, layout: Layout) -> dict[str, list[dict[str, float]]]:
    """Beside items 1 and 2: c=1 in ``paired_blocks`` rounds of four short runs back to back (direct
    chat, the passthrough, create with store: true, create with store: false).

    The c=1 phases of items 1 and 2 run minutes after the baseline, and this host's speed
    drifts by a third in that time; a block's runs see the same host, so the median of the
    blocks' differences is the added latency without the drift. Each run also reads the
    CPU per request of the router and of the sim: the sim, alone on its CPU in the
    baseline, shares it with the router behind it."""
    kinds = {"direct": (sim.port, "/v1/chat/completions", chat_body(s.nonstream_tokens)),
             "passthrough": (router.port, "/v1/chat/completions", chat_body(s.nonstream_tokens)),
             "create": (router.port, "/v1/responses", responses_body(s.nonstream_tokens)),
             "create_nostore": (router.port, "/v1/responses", responses_body(s.nonstream_tokens, store=False))}
    watch = {"router": router.pid, "sim": sim.pid}
    out: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(s.paired_blocks):
        for kind, (port, path, body) in kinds.items():
            r = _closed(port, path, body, 1, s.paired_requests, 20, layout, watch, s.max_s)
            n = r["requests"]
            out[kind].append({"p50_ms": r["p50_ms"], "ok": r["ok"], "requests": n,
                              "router_us": r["procs"]["router"]["sched_s"] / n * 1e6,
                              "sim_us": r["procs"]["sim"]["sched_s"] / n * 1e6})
    return out


# ---------------------------------------------------------------- items 3, 4


def streaming_cpu(router: Proc, sim: Proc, s: Settings, layout: Layout, *,
                  harmony: bool = False) -> dict[int, dict[str, Any]]:
    """Item 3: router CPU per streamed token at 1 and ``stream_c64`` concurrent streams of ``stream_tokens``.

    Pacing comes from the sim's ``[sim:itl_ms=N]`` marker (the per-request form of
    ``--itl-ms``): one token per upstream write, so one per router read as long as
    the router keeps up; ``chunks`` (router writes seen by the client) tells.
    ``harmony``: the sim's N words are real o200k tokens there, a few words two of them
    (which words depends on the prompt, and harmony's holds the date), so a complete
    stream has at least N text deltas, not exactly N."""
    watch = {"router": router.pid, "sim": sim.pid}
    out = {}
    for streams, rounds, itl in ((1, s.stream_c1_rounds, s.stream_c1_itl_ms), (s.stream_c64, 1, s.stream_c64_itl_ms)):
        job = Job(kind="streams", port=router.port, path="/v1/responses",
                  body=responses_body(s.stream_tokens, stream=True, itl_ms=itl), streams=streams, rounds=rounds,
                  warmup_streams=min(streams, 4), warmup_body=responses_body(50, stream=True, itl_ms=1),
                  expect_tokens=s.stream_tokens, at_least=harmony, cpus=layout.loadgen, watch=watch, max_s=s.max_s)
        result = run_load(job)
        result["itl_ms"] = itl
        out[streams] = result
    return out


def streaming_floor(relay: Proc, sim: Proc, s: Settings, layout: Layout) -> dict[int, dict[str, Any]]:
    """Beside item 3: the same streams as chat completions through ``bench/relay.py`` (a byte relay):
    the CPU per token of one read and one write in this interpreter, the floor for the router's figure."""
    watch = {"router": relay.pid, "sim": sim.pid}  # "router": the process in the middle
    out = {}
    for streams, rounds, itl in ((1, s.stream_c1_rounds, s.stream_c1_itl_ms), (s.stream_c64, 1, s.stream_c64_itl_ms)):
        job = Job(kind="streams", port=relay.port, path="/v1/chat/completions",
                  body=chat_body(s.stream_tokens, stream=True, itl_ms=itl), streams=streams, rounds=rounds,
                  warmup_streams=min(streams, 4), warmup_body=chat_body(50, stream=True, itl_ms=1),
                  expect_tokens=s.stream_tokens, cpus=layout.loadgen, watch=watch, max_s=s.max_s,
                  token_pattern='"delta":{"content":"', done_pattern="data: [DONE]")
        result = run_load(job)
        result["itl_ms"] = itl
        out[streams] = result
    return out


def open_streams(router: Proc, sim: Proc, s: Settings, layout: Layout, *, tokens: int, itl_ms: int,
                 ramp_s: float) -> dict[str, Any]:
    """Item 4: ``open_streams`` concurrent streams of ``tokens`` at ``itl_ms``, sent over ``ramp_s``;
    router VmRSS at peak vs idle (sampled every 50 ms), and how many complete."""
    job = Job(kind="streams", port=router.port, path="/v1/responses",
              body=responses_body(tokens, stream=True, itl_ms=itl_ms), streams=s.open_streams,
              rounds=1, warmup_streams=8, warmup_body=responses_body(10, stream=True, itl_ms=1),
              expect_tokens=tokens, cpus=layout.loadgen,
              watch={"router": router.pid, "sim": sim.pid}, max_s=s.max_s, rss_interval_s=0.05,
              nofile=s.open_streams * 2 + 256, ramp_s=ramp_s)
    result = run_load(job)
    result["itl_ms"] = itl_ms
    result["ramp_s"] = ramp_s
    return result


# ---------------------------------------------------------------- item 5


def chain_load() -> dict[str, Any]:
    """Item 5: ``bench/chain_load.py``'s ``run()`` when that file exists (someone else writes it)."""
    path = BENCH / "chain_load.py"
    if not path.exists():
        return {"status": "n/a", "why": "bench/chain_load.py does not exist yet"}
    t0 = time.perf_counter()
    try:
        spec = importlib.util.spec_from_file_location("bench.chain_load", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        rows = list(module.run())
    except Exception as exc:  # noqa: BLE001 - someone else's code: report, never crash the suite
        return {"status": "error", "why": f"{type(exc).__name__}: {exc}"}
    return {"status": "ok", "rows": [dict(r) for r in rows], "wall_s": time.perf_counter() - t0}
