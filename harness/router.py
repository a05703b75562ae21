"""The router as a process (``python -m router --config cfg.toml``) and the pool tables tests give it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.net import free_port, free_range, kernel_port
from harness.procs import ROOT, Proc, spawn, spawn_in
from harness.sim import MODEL


@dataclass
class RouterProcess(Proc):
    """A router a test started, and the folder of its config, store and log."""

    dir: Path

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.popen  # by the name the tests use


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
    (with at most ``nofile`` file descriptors, when given); it dies with this process."""
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "cfg.toml"
    config.write_text(f'[server]\nport = {port}\nlog_level = "info"\n{server}\n{store}\n{body}')
    log_path = tmp / "router.log"
    proc = spawn([sys.executable, "-m", "router", "--config", str(config)], log_path, with_parent=True, nofile=nofile)
    router = RouterProcess("router", proc, port, log_path, tmp)
    if wait:
        # The router listens only once its managed workers are ready: any answer means up.
        router.wait_healthy(60, any_answer=True, interval_s=0.1, whole_log=True)
    return router


def router_config(*, port: int, sim_urls: Sequence[str], db_path: str = "responses.db",
                  harmony_vocab: str | None = None) -> str:
    """A router TOML: one external sim pool, the public model named like the sim's, SQLite store.

    With ``harmony_vocab`` (the vocabulary's folder) the pool is a harmony one on vLLM's
    generate API, for sims started with ``harmony_sim_args``."""
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


def start_router_for(workdir: Path, sim_urls: Sequence[str], *, cpus: Sequence[int] | None, src: Path = ROOT,
                     harmony_vocab: str | None = None) -> Proc:
    """``python -m router --config`` in front of the sims at ``sim_urls`` (see ``router_config``), from
    the tree ``src``, pinned to ``cpus``, on a port the kernel chose; healthy on return."""
    port = kernel_port()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / f"router-{port}.toml"
    cfg.write_text(router_config(port=port, sim_urls=sim_urls, db_path=f"responses-{port}.db",
                                 harmony_vocab=harmony_vocab))
    log_path = workdir / f"router-{port}.log"
    argv = [sys.executable, "-m", "router", "--config", str(cfg)]
    proc = Proc("router", spawn_in(src, argv, log_path, cpus), port, log_path)
    proc.wait_healthy()
    return proc
