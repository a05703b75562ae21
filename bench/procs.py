"""Start and stop the benchmark's processes (sim workers, the router) and read /proc.

Everything here is plain subprocess + /proc: the processes are started the
way users start them (``python -m backends.sim``, ``python -m router``), each
optionally pinned to a set of CPUs before it execs.
"""

from __future__ import annotations

import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "sim-model"  # served by the sim AND the router's public name, so one body fits both


def free_port() -> int:
    """A free TCP port on loopback (racy, as always; good enough on a quiet machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def http_post(url: str, body: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    """One JSON POST; (status, body), status 0 when nothing answers."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except OSError:
        return 0, b""


@dataclass
class Proc:
    """A started server process: its name, Popen, base URL and log file."""

    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Poll GET /health until 200; raise with the log tail if the process dies or times out."""
        deadline = time.monotonic() + timeout_s
        while http_status(self.url + "/health") != 200:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} not healthy after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return int(self.popen.returncode)


def export_rev(rev: str, dest: Path) -> Path:
    """The tree of git revision ``rev`` unpacked into ``dest`` (``git archive``: read-only, no git state changes).

    Lets the benchmark run a committed router while the working tree is mid-edit."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _spawn(name: str, argv: list[str], log_path: Path, cpus: Sequence[int] | None,
           src: Path = ROOT) -> subprocess.Popen[bytes]:
    """Popen in ``src`` (its packages shadow the editable install) with stdout+stderr to
    ``log_path``, pinned to ``cpus`` before exec (when given)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pin = set(cpus) if cpus else None

    def preexec() -> None:
        if pin:
            os.sched_setaffinity(0, pin)

    return subprocess.Popen(
        argv, cwd=src, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(src)}, preexec_fn=preexec if pin else None,
    )


def harmony_sim_args(vocab_dir: str) -> list[str]:
    """A sim speaking vLLM's generate API with gpt-oss's harmony tokens (for ``router_config(harmony_vocab=...)``)."""
    return ["--engine", "vllm", "--dialect", "harmony", "--harmony-vocab-dir", vocab_dir, "--max-model-len", "8192"]


def start_sim(workdir: Path, *, cpus: Sequence[int] | None, itl_ms: float = 0.0,
              max_concurrency: int = 2000, extra: Sequence[str] = (), src: Path = ROOT) -> Proc:
    """A sim worker in zero-latency mode (unless ``itl_ms``), healthy on return."""
    port = free_port()
    argv = [sys.executable, "-m", "backends.sim", "--port", str(port), "--model", MODEL,
            "--max-concurrency", str(max_concurrency)]
    if itl_ms:
        argv += ["--itl-ms", str(itl_ms)]
    argv += list(extra)
    log_path = workdir / f"sim-{port}.log"
    proc = Proc("sim", _spawn("sim", argv, log_path, cpus, src), port, log_path)
    proc.wait_healthy()
    return proc


def router_config(*, port: int, sim_urls: Sequence[str], db_path: str = "responses.db",
                  harmony_vocab: str | None = None) -> str:
    """A router TOML: one external sim pool, the public model named like the sim's, SQLite store.

    With ``harmony_vocab`` (the vocabulary's folder) the pool is a harmony one on vLLM's
    generate API, for sims started with ``HARMONY_SIM_ARGS``."""
    urls = ", ".join(f'"{u}"' for u in sim_urls)
    harmony = (f'[harmony]\nvocab_dir = "{harmony_vocab}"\n\n' if harmony_vocab else "")
    pool = ('engine = "vllm"\ndialect = "harmony"\ncontext_length = 8192' if harmony_vocab else 'engine = "sim"')
    return f"""[server]
port = {port}
log_level = "warning"

[store]
path = "{db_path}"

{harmony}[[pools]]
name = "sim"
{pool}
model = "{MODEL}"
urls = [{urls}]

[[models]]
name = "{MODEL}"
pool = "sim"
"""


def start_router(workdir: Path, sim_urls: Sequence[str], *, cpus: Sequence[int] | None, src: Path = ROOT,
                 harmony_vocab: str | None = None) -> Proc:
    """``python -m router --config cfg.toml`` on a free port, healthy on return (see ``router_config``)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / f"router-{port}.toml"
    cfg.write_text(router_config(port=port, sim_urls=sim_urls, db_path=f"responses-{port}.db",
                                 harmony_vocab=harmony_vocab))
    log_path = workdir / f"router-{port}.log"
    argv = [sys.executable, "-m", "router", "--config", str(cfg)]
    proc = Proc("router", _spawn("router", argv, log_path, cpus, src), port, log_path)
    proc.wait_healthy()
    return proc


def start_relay(workdir: Path, sim: Proc, *, cpus: Sequence[int] | None, src: Path = ROOT) -> Proc:
    """``bench/relay.py`` in front of ``sim``: the floor for streamed tokens (a byte relay, nothing parsed)."""
    port = free_port()
    log_path = workdir / f"relay-{port}.log"
    argv = [sys.executable, "-m", "bench.relay", "--port", str(port), "--upstream-port", str(sim.port)]
    proc = Proc("relay", _spawn("relay", argv, log_path, cpus, ROOT), port, log_path)
    proc.wait_healthy()  # the sim's /health, through the relay
    return proc
