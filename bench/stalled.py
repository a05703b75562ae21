"""Tens of thousands of stalled connections against a real router: ``python bench/stalled.py [--connections N]``.

The heavy variant of tests/fault/test_connections.py. Starts a sim and a router
(harness/), opens N connections that each send half a request head and
stop, and, while they are held, times ordinary requests over new connections;
then reports how many of the stalled ones the router closed, and when. Prints
one table; nothing is written to bench/RESULTS.md. The router keeps its default
limits: the connection cap (half its file-descriptor limit) and the 10 s head
deadline; this process raises its own descriptor limit as far as it may.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from bench import procs  # noqa: E402

HALF_HEAD = b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Ty"


def _timed_request(port: int) -> float | None:
    """Seconds for GET /health over a new connection; None when it got no 200 within 10 s."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            ok = sock.recv(65536).startswith(b"HTTP/1.1 200")
    except OSError:
        return None
    return time.monotonic() - started if ok else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=20_000, help="stalled connections to open")
    p.add_argument("--probes", type=int, default=20, help="ordinary requests timed while they are held")
    args = p.parse_args()
    limit = procs.raise_nofile(args.connections + 1024)
    work = Path(tempfile.mkdtemp(prefix="rr-stalled-"))
    sim = harness.start_sim(work, cpus=None)
    router = harness.start_router_for(work, [f"http://127.0.0.1:{sim.port}"], cpus=None)
    stalled: list[socket.socket] = []
    refused = 0
    try:
        started = time.monotonic()
        for _ in range(min(args.connections, limit - 256)):
            try:
                sock = socket.create_connection(("127.0.0.1", router.port), timeout=10)
                sock.sendall(HALF_HEAD)
                stalled.append(sock)
            except OSError:
                refused += 1
        opened = time.monotonic() - started
        probes = [_timed_request(router.port) for _ in range(args.probes)]
        answered = [t for t in probes if t is not None]
        sel = selectors.DefaultSelector()
        for sock in stalled:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        closed, deadline = 0, time.monotonic() + 30
        while closed < len(stalled) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
                    closed += 1
        closed_after = time.monotonic() - started
        rows = [
            ("stalled connections opened", f"{len(stalled)} in {opened:.1f} s ({refused} refused at connect)"),
            ("ordinary requests answered meanwhile", f"{len(answered)}/{len(probes)}"),
            ("their latency, median / max", f"{statistics.median(answered) * 1000:.1f} / {max(answered) * 1000:.1f} ms"
             if answered else "n/a"),
            ("stalled connections closed by the router", f"{closed}/{len(stalled)}, {closed_after:.1f} s after the first"),
            ("router RSS", f"{procs.rss_kb(router.pid) // 1024} MiB"),
        ]
        width = max(len(r[0]) for r in rows)
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
        return 0 if len(answered) == len(probes) and closed == len(stalled) else 1
    finally:
        for sock in stalled:
            sock.close()
        router.stop()
        sim.stop()


if __name__ == "__main__":
    raise SystemExit(main())
