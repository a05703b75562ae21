"""The benchmark's own process tools: /proc readers, CPU pinning, the machine's description,
a committed tree to run, and the byte relay in front of a sim.

The router and sim processes themselves are started by the harness (harness/: ``start_sim``,
``start_router_for``), the way users start them, each optionally pinned to a set of CPUs.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harness import ROOT, Proc, kernel_port, spawn_in

CLK_TCK = os.sysconf("SC_CLK_TCK")


def can_pin() -> bool:
    """True when sched_setaffinity exists and there are at least two CPUs to split."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def raise_nofile(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


# ---------------------------------------------------------------- /proc readers


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads) from /proc/PID/stat, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # after "pid (comm)": state is fields[0], utime is field 14 overall -> index 11 here
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def sched_seconds(pid: int) -> float:
    """On-CPU time summed over the live threads from /proc/PID/task/*/schedstat (ns precision).

    A cross-check for ``cpu_seconds`` on short runs (10 ms ticks); threads that
    exited are missing from it."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """utime + stime per live thread, keyed "name/tid": "main" for the main thread, else the
    kernel's comm (Python 3.11 does not name OS threads, so mostly "python")."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        head, _, rest = raw.rpartition(b")")
        name = "main" if int(tid) == pid else head.split(b"(", 1)[1].decode(errors="replace")
        fields = rest.split()
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def pin_threads(pid: int, main: set[int], others: set[int]) -> dict[str, list[int]]:
    """Pin the main thread of ``pid`` to ``main`` and every other live thread to ``others``."""
    done: dict[str, list[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        cpus = main if int(tid) == pid else others
        try:
            os.sched_setaffinity(int(tid), cpus)
            done[tid] = sorted(cpus)
        except OSError:
            continue
    return done


def rss_kb(pid: int) -> int:
    """VmRSS of the process in KiB, from /proc/PID/status."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1])
    return 0


def loadavg() -> str:
    """The 1-minute load average, from /proc/loadavg."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def machine_info() -> dict[str, str]:
    """nproc, CPU model, Python version, kernel, date: the header of a results entry."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


# ---------------------------------------------------------------- processes


def export_rev(rev: str, dest: Path) -> Path:
    """The tree of git revision ``rev`` unpacked into ``dest`` (``git archive``: read-only, no git state changes).

    Lets the benchmark run a committed router while the working tree is mid-edit."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def start_relay(workdir: Path, sim: Proc, *, cpus: Sequence[int] | None, src: Path = ROOT) -> Proc:
    """``bench/relay.py`` in front of ``sim``: the floor for streamed tokens (a byte relay, nothing parsed)."""
    port = kernel_port()
    log_path = workdir / f"relay-{port}.log"
    argv = [sys.executable, "-m", "bench.relay", "--port", str(port), "--upstream-port", str(sim.port)]
    proc = Proc("relay", spawn_in(ROOT, argv, log_path, cpus), port, log_path)
    proc.wait_healthy()  # the sim's /health, through the relay
    return proc
