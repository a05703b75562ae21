"""The simulated worker as a process (``python -m backends.sim``), for the benchmarks."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from harness.net import kernel_port
from harness.procs import ROOT, Proc, spawn_in

MODEL = "sim-model"  # served by the sim AND the router's public name, so one body fits both


def harmony_sim_args(vocab_dir: str) -> list[str]:
    """A sim speaking vLLM's generate API with gpt-oss's harmony tokens (for ``router_config(harmony_vocab=...)``)."""
    return ["--engine", "vllm", "--dialect", "harmony", "--harmony-vocab-dir", vocab_dir, "--max-model-len", "8192"]


def start_sim(workdir: Path, *, cpus: Sequence[int] | None, itl_ms: float = 0.0,
              max_concurrency: int = 2000, extra: Sequence[str] = (), src: Path = ROOT) -> Proc:
    """A sim worker in zero-latency mode (unless ``itl_ms``) from the tree ``src``, pinned to ``cpus``,
    on a port the kernel chose; healthy on return."""
    port = kernel_port()
    argv = [sys.executable, "-m", "backends.sim", "--port", str(port), "--model", MODEL,
            "--max-concurrency", str(max_concurrency)]
    if itl_ms:
        argv += ["--itl-ms", str(itl_ms)]
    argv += list(extra)
    log_path = workdir / f"sim-{port}.log"
    proc = Proc("sim", spawn_in(src, argv, log_path, cpus), port, log_path)
    proc.wait_healthy()
    return proc
