"""Real processes for end-to-end tests: a router started the way users start it."""

from __future__ import annotations

import json
import os
import random
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_START = _ephemeral_start()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) may be handed out again before the process
    the test starts binds it: to another process's bind to 0 or outgoing connection (a
    vLLM worker makes many while the router waits for it). Ports below that range are
    only ever taken by name, so a free one stays free until the test's process takes it.
    """
    low = 10000
    for _ in range(200):
        port = random.randrange(low, max(low + 1000, _EPHEMERAL_START))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every try taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_range(width: int = 20) -> tuple[int, int]:
    """A port range unlikely to collide with other tests' ranges."""
    base = free_port()
    base = min(base, 65535 - width)
    return base, base + width - 1


def http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


@dataclass
class RouterProcess:
    proc: subprocess.Popen[bytes]
    port: int
    dir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _die_with_pytest() -> None:
    """A router started by a test dies with the test process, however that ends (its workers follow)."""
    import ctypes
    import signal as _signal

    ctypes.CDLL(None, use_errno=True).prctl(1, _signal.SIGTERM)  # PR_SET_PDEATHSIG


def _limit_files(nofile: int) -> None:
    import resource

    _die_with_pytest()
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


def sim_pool_toml(*, name: str = "sim", model: str = "sim-model", replicas: int = 2, extra_args: str = "[]") -> str:
    first, last = free_range()
    return f"""
[[pools]]
name = "{name}"
engine = "sim"
model = "{model}"
health_interval_s = 0.5
[pools.managed]
replicas = {replicas}
port_range = [{first}, {last}]
extra_args = {extra_args}
log_dir = "logs"
"""


def engine_pool_toml(name: str, engine: str, *, honor_service_tier: bool = False) -> str:
    """A managed chat pool of one sim worker speaking ``engine``'s wire (``vllm`` or ``sglang``), the
    pool's engine ``engine`` too, so the router talks to it as to that engine (its options' names)."""
    return sim_engine_pool_toml(name, engine, model="sim-model", honor_service_tier=honor_service_tier)


def sim_engine_pool_toml(name: str, engine: str, *, model: str, sim_args: Sequence[str] = (), settings: str = "",
                         honor_service_tier: bool = False) -> str:
    """A managed pool of one sim worker started with ``--engine engine`` and ``sim_args``, the pool's
    engine ``engine`` too; ``settings``: more lines of the pool's table (its dialect, context length)."""
    first, last = free_range()
    command = [sys.executable, "-m", "backends.sim", "--host", "{host}", "--port", "{port}", "--model", "{model}",
               "--engine", engine, *sim_args]
    return f"""
[[pools]]
name = "{name}"
engine = "{engine}"
model = "{model}"
{settings}health_interval_s = 0.5
honor_service_tier = {"true" if honor_service_tier else "false"}
[pools.managed]
replicas = 1
port_range = [{first}, {last}]
command = {json.dumps(command)}
log_dir = "logs"
"""


def start_router(tmp: Path, body: str, *, server: str = "", store: str = '[store]\npath = "responses.db"\n',
                 wait: bool = True, nofile: int | None = None) -> RouterProcess:
    """Write ``cfg.toml`` into ``tmp`` and start ``python -m router --config`` on a free port
    (with at most ``nofile`` file descriptors, when given)."""
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "cfg.toml"
    config.write_text(f'[server]\nport = {port}\nlog_level = "info"\n{server}\n{store}\n{body}')
    log_path = tmp / "router.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--config", str(config)],
        cwd=ROOT, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=_die_with_pytest if nofile is None else lambda: _limit_files(nofile),
    )
    router = RouterProcess(proc, port, tmp, log_path)
    if wait:
        deadline = time.monotonic() + 60
        # The router listens only once its managed workers are ready: any answer means up.
        while http_status(router.base_url + "/health") is None:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}:\n{router.log()}")
            if time.monotonic() > deadline:
                router.stop()
                raise RuntimeError(f"router not healthy after 60 s:\n{router.log()}")
            time.sleep(0.1)
    return router


def load_script(path: Path) -> Any:
    """A script of scripts/ imported as a module (once), so tests use the very code users run."""
    import importlib.util

    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
