"""The router's CPU beside the Rust routers', in one run: sglang-router and vllm-router in
front of the same sim, under the same load generator and pinning.

    .venv/bin/python bench/peers.py [--rounds 2] [--requests 6000] [--rev REV]

The peers are the ``sglang-router`` and ``vllm-router`` packages (their Rust binaries), in a
virtual environment of their own (``--peers-venv``, default
``~/.cache/responses-router/peers``), made and filled by the first run (``pip install``;
nothing else is downloaded). Each round starts one zero-latency sim and, one at a time,
each router in front of it (round robin, one worker), and drives a closed loop of chat
completions at ``--concurrency`` (32) through it; the router's and the sim's CPU per
request come from /proc (utime+stime), as bench/run.py reads them. The responses-router
also serves a Responses create (``store: true``, SQLite) under the same load.

Printed per round: CPU per request of each, that divided by the sim's own CPU per request
in the same phase (the "sim-normalised" figure, which carries across hosts whose speed
varies), and the ratios the performance issue sets goals on: passthrough / sglang-router,
passthrough / vllm-router, create / the best Rust router's passthrough. Targets are
printed for reading, never asserted.
"""

from __future__ import annotations

import argparse
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
from bench.load import Job  # noqa: E402
from bench.run import choose_layout  # noqa: E402
from bench.scenarios import Layout, chat_body, responses_body, run_load  # noqa: E402

PEERS = ("sglang-router", "vllm-router")
DEFAULT_VENV = Path.home() / ".cache" / "responses-router" / "peers"
GOALS = {"passthrough / sglang-router": 0.8, "passthrough / vllm-router": 0.9, "create / best Rust passthrough": 2.0}


def peers_venv(venv: Path) -> Path:
    """The peers' bin folder; the venv is made and filled when missing."""
    bin_dir = venv / "bin"
    if not all((bin_dir / name).exists() for name in PEERS):
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", *PEERS], check=True)
    return bin_dir


def start_peer(name: str, bin_dir: Path, sim_url: str, work: Path, cpus: list[int]) -> harness.Proc:
    """One Rust router in front of the sim, round robin, its own metrics port out of the way."""
    port, metrics = harness.kernel_port(), harness.kernel_port()
    if name == "sglang-router":
        argv = [str(bin_dir / name), "launch", "--worker-urls", sim_url, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--log-level", "warn", "--prometheus-port", str(metrics)]
    else:
        argv = [str(bin_dir / name), "--worker-urls", sim_url, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(metrics)]
    log = work / f"{name}-{port}.log"
    proc = harness.Proc(name, harness.spawn(argv, log, cpus=cpus, with_parent=True), port, log)
    deadline = time.monotonic() + 60
    while harness.http_post(proc.url + "/v1/chat/completions", chat_body(2).encode(), timeout=5)[0] != 200:
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{name} did not serve:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.5)
    return proc


def measure(proc: harness.Proc, sim: harness.Proc, path: str, body: str, args: argparse.Namespace,
            layout: Layout) -> dict[str, float]:
    """CPU per request (us) of the router and of the sim, under the closed loop."""
    job = Job(kind="closed", port=proc.port, path=path, body=body, concurrency=args.concurrency,
              requests=args.requests, warmup=args.requests // 10, cpus=layout.loadgen,
              watch={"router": proc.pid, "sim": sim.pid}, max_s=120.0)
    out = run_load(job)
    if out["ok"] != out["requests"]:
        raise RuntimeError(f"{proc.name} {path}: {out['statuses']}")
    n = out["requests"]
    router, sim_cpu = out["procs"]["router"]["cpu_s"] / n * 1e6, out["procs"]["sim"]["cpu_s"] / n * 1e6
    return {"router_us": router, "sim_us": sim_cpu, "normalised": router / sim_cpu, "rps": out["rps"]}


def one_round(args: argparse.Namespace, bin_dir: Path, src: Path, layout: Layout) -> dict[str, dict[str, float]]:
    work = Path(tempfile.mkdtemp(prefix="responses-router-peers-"))
    sim = harness.start_sim(work, cpus=layout.sim, src=src)
    rows: dict[str, dict[str, float]] = {}
    chat = chat_body(args.tokens)
    try:
        ours = harness.start_router_for(work, [sim.url], cpus=layout.router, src=src)
        try:
            rows["responses-router passthrough"] = measure(ours, sim, "/v1/chat/completions", chat, args, layout)
            rows["responses-router create (store)"] = measure(ours, sim, "/v1/responses", responses_body(args.tokens),
                                                              args, layout)
        finally:
            ours.stop()
        for name in PEERS:
            peer = start_peer(name, bin_dir, sim.url, work, layout.router)
            try:
                rows[name] = measure(peer, sim, "/v1/chat/completions", chat, args, layout)
            finally:
                peer.stop()
    finally:
        sim.stop()
    return rows


def ratios(rows: dict[str, dict[str, float]], key: str) -> dict[str, float]:
    best = min(rows[name][key] for name in PEERS)
    ours = rows["responses-router passthrough"][key]
    return {"passthrough / sglang-router": ours / rows["sglang-router"][key],
            "passthrough / vllm-router": ours / rows["vllm-router"][key],
            "create / best Rust passthrough": rows["responses-router create (store)"][key] / best}


def table(rounds: list[dict[str, dict[str, float]]]) -> str:
    lines = ["| round | router | CPU us / request | / the sim's CPU | req/s |", "|---|---|---:|---:|---:|"]
    for i, rows in enumerate(rounds, 1):
        for name, r in rows.items():
            lines.append(f"| {i} | {name} | {r['router_us']:.0f} | {r['normalised']:.2f} | {r['rps']:.0f} |")
    lines += ["", "| ratio | goal | " + " | ".join(f"round {i} (CPU; sim-normalised)" for i in range(1, len(rounds) + 1))
              + " |", "|---|---:|" + "---:|" * len(rounds)]
    for name, goal in GOALS.items():
        cells = [f"{ratios(rows, 'router_us')[name]:.2f}x; {ratios(rows, 'normalised')[name]:.2f}x" for rows in rounds]
        lines.append(f"| {name} | <= {goal}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=6000, help="measured requests per router and round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--rev", help="run the router of this git revision (exported), not the working tree")
    p.add_argument("--peers-venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--layout", default="auto", choices=["auto", "router-alone", "none"])
    args = p.parse_args(argv)
    bin_dir = peers_venv(args.peers_venv)
    src = procs.export_rev(args.rev, Path(tempfile.mkdtemp()) / "tree") if args.rev else ROOT
    layout = choose_layout(args.layout)
    versions = subprocess.run([str(bin_dir / "pip"), "list", "--format=freeze"], capture_output=True, text=True).stdout
    print(f"peers: {', '.join(v for v in versions.split() if v.split('==')[0] in PEERS)}; {layout.describe()}; "
          f"c={args.concurrency}, {args.requests} requests of {args.tokens} tokens per router and round; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rounds = [one_round(args, bin_dir, src, layout) for _ in range(args.rounds)]
    print(table(rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
