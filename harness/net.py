"""Loopback ports and one-shot HTTP checks for the processes the harness starts."""

from __future__ import annotations

import random
import socket
import urllib.error
import urllib.request
from pathlib import Path


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
    return kernel_port()  # every try taken: let the kernel choose


def kernel_port() -> int:
    """A free TCP port on loopback, the kernel's choice (racy, as always; good enough on a quiet machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_range(width: int = 20) -> tuple[int, int]:
    """A port range unlikely to collide with other tests' ranges."""
    base = free_port()
    base = min(base, 65535 - width)
    return base, base + width - 1


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
