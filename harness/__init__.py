"""Router and worker processes for the tests (tests/) and the benchmarks (bench/), started the
way users start them.

- ``harness.net``: free loopback ports (``free_port`` below the kernel's ephemeral range, so a
  port stays free until the process given it binds; ``kernel_port``, the kernel's choice) and
  one-shot HTTP checks.
- ``harness.procs``: ``spawn`` (log file, dies with its parent, file limit, CPU pinning) and
  ``Proc``, a started server: wait for ``/health``, read its log, stop it.
- ``harness.router``: the router from a config body (``start_router``, with the managed sim
  pool tables the tests use) or in front of running sims (``start_router_for``, the benchmarks').
- ``harness.sim``: a sim worker for the benchmarks (``start_sim``).

Repository tooling like tests/ and bench/, not installed: it imports neither of them, and the
packages (router, backends, policies) never import it.
"""

from harness.net import free_port, free_range, http_post, http_status, kernel_port
from harness.procs import ROOT, Proc, die_with_parent, spawn, spawn_in
from harness.router import (
    RouterProcess,
    engine_pool_toml,
    router_config,
    sim_engine_pool_toml,
    sim_pool_toml,
    start_router,
    start_router_for,
)
from harness.sim import harmony_sim_args, start_sim

__all__ = [
    "ROOT",
    "Proc",
    "RouterProcess",
    "die_with_parent",
    "engine_pool_toml",
    "free_port",
    "free_range",
    "harmony_sim_args",
    "http_post",
    "http_status",
    "kernel_port",
    "router_config",
    "sim_engine_pool_toml",
    "sim_pool_toml",
    "spawn",
    "spawn_in",
    "start_router",
    "start_router_for",
    "start_sim",
]
