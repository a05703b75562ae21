"""Waiting for a condition, never for a fixed time, and the readings the waits poll: the
kernel's view of TCP connections, the sim workers' own counts."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from harness import RouterProcess

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], within_s: float, what: str, interval: float = 0.05) -> T:
    """Polls ``predicate`` until it returns something true, and returns that; at the deadline the
    test fails, saying ``what`` did not happen."""
    deadline = time.monotonic() + within_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        time.sleep(interval)
    return value


async def async_wait_until(predicate: Callable[[], T], within_s: float, what: str, interval: float = 0.001) -> T:
    """``wait_until`` on an event loop: the loop runs (other tasks, I/O) between the polls."""
    deadline = time.monotonic() + within_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        await asyncio.sleep(interval)
    return value


def tcp_connections() -> list[tuple[int, int, int, int]]:
    """Every established TCP connection's end on this machine, as (local port, remote port, bytes in
    its send queue, bytes in its receive queue): what the kernel says in /proc/net/tcp{,6}. A send
    queue that stays full is a peer that does not read; a receive queue, a process that does not."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path("/proc/net", name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "01":  # ESTABLISHED
                continue
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            out.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16), tx, rx))
    return out


def worker_urls(router: RouterProcess) -> list[str]:
    """The router's workers' URLs, every pool's (its /health)."""
    with urllib.request.urlopen(router.base_url + "/health") as resp:
        return [w["url"] for p in json.loads(resp.read())["pools"] for w in p["workers"]]


def running_on_workers(router: RouterProcess) -> int:
    """Requests the sim workers say they are generating right now (their own /metrics)."""
    total = 0
    for url in worker_urls(router):
        with urllib.request.urlopen(url + "/metrics") as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total
