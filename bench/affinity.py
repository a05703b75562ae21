"""Routing policies on prefix-caching sims: ``.venv/bin/python bench/affinity.py``.

A multi-turn workload: N conversations of M turns run concurrently, each turn
chained on the previous one with ``previous_response_id`` so its prompt
extends the last; with ``--shared-prompts K`` every conversation begins with
one of K long instructions (an agent fleet: each Codex conversation starts with
the same thousands of tokens), else each has its own. The pool is several sim
workers with a prefix cache (``--kv-cache-blocks``) and a prefill cost per
uncached token, so a turn that lands on the worker holding its prefix reaches
its first token sooner; they publish their KV-cache events and serve
``/tokenize``, which ``kv_aware`` reads. The same workload runs once per policy
(``--policies``) on fresh workers; the client measures time to first text delta
(streamed) and sums the usage's ``cached_tokens`` / ``input_tokens``; max/mean
is the busiest worker's share of the turns over the mean's. Also item 7 of
``bench/run.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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
from bench import procs  # noqa: E402
from harness.sim import MODEL  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
POLICIES = ("round_robin", "affinity")  # bench/run.py's item 7; --policies for more (least_in_flight, kv_aware)
_WORDS = ("pool worker cache prefix block token router stream turn answer queue batch latency model "
          "engine prompt conversation chain").split()


@dataclass
class Settings:
    workers: int = 4
    conversations: int = 32
    turns: int = 6
    concurrency: int = 16  # conversations in flight at once
    instructions_words: int = 300  # a long system prompt per conversation
    input_words: int = 40  # each user turn
    answer_tokens: int = 24
    kv_cache_blocks: int = 1024  # per worker, 16 tokens each
    prefill_us_per_token: float = 500.0  # 2,000 prompt tokens/s per worker: a large model on one GPU
    ttft_ms: float = 5.0
    itl_ms: float = 2.0
    shared_prompts: int = 0  # 0: each conversation its own instructions; K: one of K shared ones
    kv_tokens_per_request: float = 1024.0  # kv_aware's: prompt tokens that cost as much as a request running


def _text(conv: int, turn: int, words: int) -> str:
    return " ".join(_WORDS[(conv * 7 + turn * 3 + i * (i % 5 + 1)) % len(_WORDS)] for i in range(words))


def router_toml(port: int, urls: list[str], policy: str, events: list[str] | None = None,
                tokens_per_request: float = 1024.0) -> str:
    """The harness's router config (harness/router.py) with the pool's policy set (and, for
    kv_aware, the workers' KV-event endpoints, one per url)."""
    cfg = harness.router_config(port=port, sim_urls=urls, db_path=f"responses-{port}.db")
    cfg = cfg.replace('engine = "sim"\n', f'engine = "sim"\npolicy = "{policy}"\n', 1)
    if policy == "kv_aware" and events is not None:
        cfg = cfg.replace("\n[[models]]", f"\n[pools.kv_events]\nenabled = true\nendpoints = {events!r}\n"
                          f"tokens_per_request = {tokens_per_request}\n\n[[models]]", 1)
    return cfg.replace("'", '"')


def start_router(workdir: Path, urls: list[str], policy: str, cpus: list[int] | None,
                 events: list[str] | None = None, tokens_per_request: float = 1024.0) -> harness.Proc:
    port = harness.kernel_port()
    cfg = workdir / f"router-{port}.toml"
    cfg.write_text(router_toml(port, urls, policy, events, tokens_per_request))
    log_path = workdir / f"router-{port}.log"
    argv = [sys.executable, "-m", "router", "--config", str(cfg)]
    proc = harness.Proc("router", harness.spawn_in(harness.ROOT, argv, log_path, cpus), port, log_path)
    proc.wait_healthy()
    return proc


async def _conversation(client: Any, s: Settings, conv: int, out: dict[str, list]) -> None:
    if s.shared_prompts:
        shared = conv % s.shared_prompts
        instructions = f"agent {shared}: " + _text(shared, 0, s.instructions_words)
    else:
        instructions = f"conversation {conv}: " + _text(conv, 0, s.instructions_words)
    previous = None
    for turn in range(s.turns):
        started = time.perf_counter()
        first = None
        stream = await client.responses.create(
            model=MODEL, instructions=instructions, previous_response_id=previous, stream=True,
            input=f"turn {turn}: {_text(conv, turn + 1, s.input_words)} [sim:tokens={s.answer_tokens}]")
        async for event in stream:
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - started
            elif event.type == "response.completed":
                usage = event.response.usage
                previous = event.response.id
                out["input"].append(usage.input_tokens)
                out["workers"].append(stream.response.headers.get("x-router-worker"))
                out["cached"].append(usage.input_tokens_details.cached_tokens)
            elif event.type in ("response.failed", "error"):
                out["errors"].append(event.type)
        if first is not None:
            out["ttft"].append(first)
        if previous is None:  # the chain broke: no later turn can chain on it
            return


async def _drive(base_url: str, s: Settings) -> dict[str, Any]:
    """Warm the router's connections (one short unstored request per worker), then the measured run."""
    import openai

    out: dict[str, Any] = {"ttft": [], "input": [], "cached": [], "errors": [], "workers": []}
    gate = asyncio.Semaphore(s.concurrency)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        for _ in range(s.workers):
            await client.responses.create(model=MODEL, input="warm up [sim:tokens=1]", store=False)

        async def one(conv: int) -> None:
            async with gate:
                await _conversation(client, s, conv, out)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(s.conversations)))
        out["wall_s"] = time.perf_counter() - t0
    return out


def run_policy(policy: str, s: Settings, workdir: Path, cpus: list[int] | None = None) -> dict[str, Any]:
    """One policy on fresh (cold) workers."""
    extra = ["--kv-cache-blocks", str(s.kv_cache_blocks), "--prefill-us-per-token", str(s.prefill_us_per_token),
             "--ttft-ms", str(s.ttft_ms), "--tokenize"]
    events = [f"tcp://127.0.0.1:{harness.kernel_port()}" for _ in range(s.workers)]
    sims = [harness.start_sim(workdir, cpus=cpus, itl_ms=s.itl_ms, extra=[
        *extra, "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": e.replace("127.0.0.1", "*"),
                                                  "topic": "kv"})]) for e in events]
    try:
        router = start_router(workdir, [p.url for p in sims], policy, cpus, events, s.kv_tokens_per_request)
        try:
            out = asyncio.run(_drive(router.url, s))
        finally:
            router.stop()
    finally:
        for p in sims:
            p.stop()
    ttft = sorted(out["ttft"])
    return {"policy": policy, "turns": len(out["input"]), "errors": len(out["errors"]), "wall_s": out["wall_s"],
            "ttft_mean_ms": statistics.fmean(ttft) * 1000 if ttft else float("nan"),
            "ttft_p50_ms": ttft[len(ttft) // 2] * 1000 if ttft else float("nan"),
            "ttft_p95_ms": ttft[int(len(ttft) * 0.95)] * 1000 if ttft else float("nan"),
            "cached_ratio": sum(out["cached"]) / sum(out["input"]) if out["input"] else 0.0,
            "input_tokens": sum(out["input"]), "max_over_mean": _max_over_mean(out["workers"], s.workers)}


def _max_over_mean(served: list[str | None], workers: int) -> float:
    """The busiest worker's turns over the mean worker's (1.0: even)."""
    counts = Counter(served)
    return max(counts.values()) / (len(served) / workers) if served else float("nan")


def run(s: Settings, workdir: Path, cpus: list[int] | None = None,
        policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Each policy in turn, round robin first; -> {"settings", "policies", and one entry a policy}."""
    res: dict[str, Any] = {"settings": vars(s).copy(), "policies": policies}
    for policy in policies:
        print(f"[bench] affinity: {policy}, {s.conversations} conversations x {s.turns} turns on "
              f"{s.workers} workers", file=sys.stderr, flush=True)
        res[policy] = run_policy(policy, s, workdir, cpus)
    return res


MEASURES = (("mean TTFT ms", "ttft_mean_ms", "{:.1f}"), ("p50 TTFT ms", "ttft_p50_ms", "{:.1f}"),
            ("p95 TTFT ms", "ttft_p95_ms", "{:.1f}"), ("cached-token ratio", "cached_ratio", "{:.3f}"),
            ("max/mean worker turns", "max_over_mean", "{:.2f}"))


def rows(res: dict[str, Any]) -> list[tuple[str, ...]]:
    """(measure, each policy's value with its ratio to round robin's) per measure, then the turn counts."""
    names = res.get("policies", POLICIES)
    base = res[names[0]]
    out: list[tuple[str, ...]] = []
    for label, key, fmt in MEASURES:
        cells = [fmt.format(res[name][key]) + (f" ({res[name][key] / base[key]:.2f}x)" if i and base[key] else "")
                 for i, name in enumerate(names)]
        out.append((label, *cells))
    out.append(("turns completed (errors)", *(f"{res[n]['turns']} ({res[n]['errors']})" for n in names)))
    return out


def describe(s: dict[str, Any]) -> str:
    return (f"{s['workers']} sim workers (`--kv-cache-blocks {s['kv_cache_blocks']}` of 16 tokens, "
            f"`--prefill-us-per-token {s['prefill_us_per_token']:g}`, `--ttft-ms {s['ttft_ms']:g}`, "
            f"`--itl-ms {s['itl_ms']:g}`), fresh per policy; {s['conversations']} conversations x {s['turns']} "
            f"turns chained by previous_response_id, {s['concurrency']} at once, streamed; ~{s['instructions_words']}"
            f"-word instructions" + (f" (one of {s['shared_prompts']} shared)" if s.get("shared_prompts") else "")
            + f", {s['input_words']}-word turns, {s['answer_tokens']}-token answers; kv_aware's tokens_per_request "
            f"{s.get('kv_tokens_per_request', 1024):g} (about the prefill tokens that cost one request's decode here)")


def markdown(res: dict[str, Any]) -> str:
    head = ("measure", *(f"{name}" + (f" (x {res['policies'][0]})" if i else "") for i, name in enumerate(res["policies"])))
    cells = [head, *rows(res)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c[i].ljust(widths[i]) for i in range(len(head))) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/affinity.py", description=__doc__.split("\n")[0])
    p.add_argument("--no-append", action="store_true", help="print only; do not write bench/RESULTS.md")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, the first the ratios' base")
    for name, default in vars(Settings()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = p.parse_args(argv)
    s = Settings(**{k: getattr(args, k) for k in vars(Settings())})
    load_before = procs.loadavg()
    with tempfile.TemporaryDirectory(prefix="responses-router-affinity-") as tmp:
        res = run(s, Path(tmp), policies=tuple(args.policies.split(",")))
    table = markdown(res)
    from bench.run import describe_source  # here: bench/run.py imports this module

    notes = [f"router code: {describe_source(None)}", f"bench/affinity.py: {describe(res['settings'])}",
             "wall: " + ", ".join(f"{n} {res[n]['wall_s']:.1f} s" for n in res["policies"]) + "; "
             f"nothing pinned; machine load average (1 min) before/after: {load_before} / {procs.loadavg()}",
             "TTFT: client-side, request sent to first response.output_text.delta; cached-token ratio: sum of "
             "usage.input_tokens_details.cached_tokens / sum of usage.input_tokens; every conversation's first "
             "turn is cold under both policies, which bounds the ratio"]
    print(table)
    print("\n".join(f"- {n}" for n in notes))
    if not args.no_append:
        info = procs.machine_info()
        head = [f"Run {info['date']}", "",
                f"- machine: nproc {info['nproc']}, CPU {info['cpu']}, Python {info['python']}, kernel {info['kernel']}"]
        from bench.report import replace_section

        replace_section(RESULTS, "Latest affinity run", "\n".join(head + [f"- {n}" for n in notes] + ["", table]))
        print(f"\nwritten to {RESULTS.relative_to(ROOT)} (Latest affinity run)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
