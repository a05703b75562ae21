"""Server processes started the way users start them: spawning, waiting for health, stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.net import http_status

ROOT = Path(__file__).resolve().parent.parent  # the checkout


def die_with_parent() -> None:
    """In a child before it execs: die with the process that started it, however that one ends
    (PR_SET_PDEATHSIG; a router's workers follow it)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: Sequence[str], log_path: Path, *, cwd: Path = ROOT, env: Mapping[str, str] | None = None,
          stdin: int | None = None, cpus: Sequence[int] | None = None, with_parent: bool = False,
          nofile: int | None = None) -> subprocess.Popen[bytes]:
    """Popen ``argv`` in ``cwd``, stdout and stderr appended to ``log_path``, unbuffered, ``env`` over
    this process's environment. Before it execs the child dies with this process (``with_parent``),
    gets at most ``nofile`` file descriptors and is pinned to ``cpus``, each only when asked."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pin = set(cpus) if cpus else None

    def preexec() -> None:
        if with_parent:
            die_with_parent()
        if nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if pin:
            os.sched_setaffinity(0, pin)

    return subprocess.Popen(
        list(argv), cwd=cwd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, stdin=stdin,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=preexec if with_parent or nofile is not None or pin else None,
    )


def spawn_in(src: Path, argv: Sequence[str], log_path: Path, cpus: Sequence[int] | None) -> subprocess.Popen[bytes]:
    """``spawn`` from the tree ``src`` (the checkout or an exported revision: its packages shadow the
    editable install), stdin closed, pinned to ``cpus`` when given."""
    return spawn(argv, log_path, cwd=src, env={"PYTHONPATH": str(src)}, stdin=subprocess.DEVNULL, cpus=cpus)


@dataclass
class Proc:
    """A started server process: its name, Popen, port on loopback and log file."""

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

    @property
    def base_url(self) -> str:
        return self.url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log().splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 60.0, *, any_answer: bool = False, interval_s: float = 0.05,
                     whole_log: bool = False) -> None:
        """Poll GET /health until 200 (any answer at all, with ``any_answer``); raise with the log's
        tail (all of it, with ``whole_log``) if the process dies or the time runs out (stopping it)."""
        deadline = time.monotonic() + timeout_s
        while (status := http_status(self.url + "/health")) is None or not (any_answer or status == 200):
            if self.popen.poll() is not None:
                log = self.log() if whole_log else self.log_tail()
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{log}")
            if time.monotonic() > deadline:
                self.stop()
                log = self.log() if whole_log else self.log_tail()
                raise RuntimeError(f"{self.name} not healthy after {timeout_s:g} s:\n{log}")
            time.sleep(interval_s)

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
