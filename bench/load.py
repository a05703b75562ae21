"""The load generator: a small HTTP/1.1 client on asyncio (uvloop) + httptools.

It runs in its own process (``python -m bench.load JOB_JSON``), pins itself to
the CPUs the job names, and prints one JSON line with the results. It is
lighter than aiohttp's client (one Protocol per keep-alive connection,
prebuilt request bytes, httptools parsing), so a single core of it drives the
router and the sim without being the bottleneck.

Two jobs:

- ``closed``: ``concurrency`` connections each sending the next request as
  soon as the last answered, until ``requests`` are done (after ``warmup``);
  latency percentiles, req/s.
- ``streams``: ``streams`` concurrent SSE requests, each connection doing
  ``rounds`` of them in a row; counts token events in the bodies, how many
  HTTP body chunks (= router writes) arrived, and how many streams completed.

Both read the watched processes' CPU time (/proc/PID/stat utime+stime, and
schedstat) right before and after the measured phase, and sample their VmRSS
while it runs, so warm-up never counts.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httptools
import orjson

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.procs import cpu_seconds, rss_kb, sched_seconds, thread_cpu_seconds


@dataclass
class Job:
    """What to run; sent as JSON on the command line."""

    kind: str  # "closed" | "streams"
    port: int
    path: str
    body: str
    host: str = "127.0.0.1"
    cpus: list[int] = field(default_factory=list)  # pin the load generator here
    watch: dict[str, int] = field(default_factory=dict)  # name -> pid, CPU and RSS read around the phase
    # closed
    concurrency: int = 1
    requests: int = 1000
    warmup: int = 100
    max_s: float = 60.0
    # streams
    streams: int = 1
    rounds: int = 1
    warmup_streams: int = 0
    warmup_body: str = ""  # streams: a shorter body for the warm-up round ("" = ``body``)
    token_pattern: str = "event: response.output_text.delta"
    done_pattern: str = "event: response.completed"
    expect_tokens: int = 0
    at_least: bool = False  # expect_tokens is a floor, not the exact count
    ramp_s: float = 0.0  # spread the first round's sends evenly over this long (0: all at once)
    rss_interval_s: float = 0.02
    nofile: int = 8192


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """One POST with a JSON body, keep-alive (HTTP/1.1 default)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: */*\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class Conn(asyncio.Protocol):
    """One keep-alive connection; ``request()`` sends prebuilt bytes and waits for the whole answer."""

    def __init__(self, token: bytes | None = None, done: bytes | None = None) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.token, self.done = token, done
        self._keep = max(len(token or b""), len(done or b"")) - 1
        self.tail = b""
        self.tokens = 0
        self.saw_done = False
        self.chunks = 0  # on_body calls: one per HTTP chunk (a router write), more if a chunk is split
        self.nbytes = 0
        self.headers_at = 0.0
        self.on_headers: Any = None  # callable, for counting open streams
        self.failing = False  # the answer's status is not 200
        self.failure = b""  # the start of such a body: the error saying why

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("connection closed"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.headers_at = time.perf_counter()
        self.failing = self.parser.get_status_code() != 200
        if self.on_headers is not None:
            self.on_headers()

    def on_body(self, body: bytes) -> None:
        self.chunks += 1
        self.nbytes += len(body)
        if self.failing and len(self.failure) < 512:
            self.failure += body[:512]
        if self.token is None:
            return
        buf = self.tail + body if self.tail else body
        self.tokens += buf.count(self.token)
        if self.done is not None and not self.saw_done and self.done in buf:
            self.saw_done = True
        self.tail = buf[-self._keep:] if self._keep > 0 else b""

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    async def request(self, raw: bytes) -> int:
        """Send one request; the status once the whole answer is in."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.tail, self.tokens, self.saw_done, self.chunks, self.nbytes = b"", 0, False, 0, 0
        self.headers_at, self.failing, self.failure = 0.0, False, b""
        self.transport.write(raw)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(host: str, port: int, **kw: Any) -> Conn:
    _, conn = await asyncio.get_running_loop().create_connection(lambda: Conn(**kw), host, port)
    return conn


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 when empty)."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


class Watcher:
    """CPU before/after and VmRSS samples of the watched processes."""

    def __init__(self, watch: dict[str, int], interval_s: float) -> None:
        self.watch = watch
        self.interval_s = interval_s
        self.cpu0: dict[str, tuple[float, float]] = {}
        self.rss_idle: dict[str, int] = {}
        self.rss_peak: dict[str, int] = {}
        self.at_peak: dict[str, dict[str, int]] = {}
        # streams the router holds now: requests sent and not answered; and those past their headers
        self.counts = {"in_flight": 0, "open": 0}
        self.max_in_flight = 0
        self.max_open = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        for name, pid in self.watch.items():
            self.rss_idle[name] = self.rss_peak[name] = rss_kb(pid)
            self.at_peak[name] = dict(self.counts)
        self.cpu0 = {name: (cpu_seconds(pid), sched_seconds(pid)) for name, pid in self.watch.items()}
        self.threads0 = {name: thread_cpu_seconds(pid) for name, pid in self.watch.items()}
        self._task = asyncio.get_running_loop().create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for name, pid in self.watch.items():
                rss = rss_kb(pid)
                if rss > self.rss_peak[name]:
                    self.rss_peak[name], self.at_peak[name] = rss, dict(self.counts)

    async def stop(self) -> dict[str, Any]:
        cpu1 = {name: (cpu_seconds(pid), sched_seconds(pid)) for name, pid in self.watch.items()}
        threads1 = {name: thread_cpu_seconds(pid) for name, pid in self.watch.items()}
        if self._task is not None:
            self._task.cancel()
        out: dict[str, Any] = {}
        for name, pid in self.watch.items():
            out[name] = {
                "cpu_s": cpu1[name][0] - self.cpu0[name][0],
                "sched_s": cpu1[name][1] - self.cpu0[name][1],
                "rss_idle_kb": self.rss_idle[name],
                "rss_peak_kb": self.rss_peak[name],
                "in_flight_at_peak": self.at_peak[name]["in_flight"],
                "max_in_flight": self.max_in_flight,
                "max_open": self.max_open,
                "open_at_peak": self.at_peak[name]["open"],
                "rss_after_kb": rss_kb(pid),
                "threads_cpu_s": {t: round(v - self.threads0[name].get(t, 0.0), 3)
                                  for t, v in threads1[name].items() if v - self.threads0[name].get(t, 0.0) > 0},
            }
        return out


async def run_closed(job: Job) -> dict[str, Any]:
    """Closed loop: ``concurrency`` connections, ``warmup`` then ``requests`` answers."""
    raw = build_request(job.host, job.port, job.path, job.body.encode())
    conns = list(await asyncio.gather(*(connect(job.host, job.port) for _ in range(job.concurrency))))
    statuses: dict[int, int] = {}
    latencies: list[float] = []

    async def phase(total: int, record: bool, deadline: float) -> None:
        left = [total]

        async def worker(i: int) -> None:
            while left[0] > 0 and time.perf_counter() < deadline:
                left[0] -= 1
                t0 = time.perf_counter()
                try:
                    status = await conns[i].request(raw)
                except (OSError, httptools.HttpParserError):
                    status = 0  # counted as an error; a fresh connection for the next request
                    conns[i].close()
                    conns[i] = await connect(job.host, job.port)
                if record:
                    latencies.append(time.perf_counter() - t0)
                    statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(worker(i) for i in range(len(conns))))

    await phase(job.warmup, False, time.perf_counter() + job.max_s)
    watcher = Watcher(job.watch, job.rss_interval_s)
    watcher.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    await phase(job.requests, True, t0 + job.max_s)
    elapsed, own_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    procs = await watcher.stop()
    for c in conns:
        c.close()
    lat = sorted(latencies)
    n = len(lat)
    return {
        "requests": n, "ok": statuses.get(200, 0), "statuses": {str(k): v for k, v in statuses.items()},
        "elapsed_s": elapsed, "rps": n / elapsed if elapsed else 0.0,
        "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
        "mean_ms": (sum(lat) / n * 1e3) if n else 0.0, "procs": procs, "loadgen_busy": own_cpu / elapsed,
    }


def error_message(body: bytes) -> str:
    """An OpenAI error body's message (else its first bytes), for telling failures apart."""
    if not body:
        return ""
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


async def run_streams(job: Job) -> dict[str, Any]:
    """``streams`` concurrent SSE requests x ``rounds``; tokens, chunks, completions, RSS at peak."""
    raw = build_request(job.host, job.port, job.path, job.body.encode())
    token, done = job.token_pattern.encode(), job.done_pattern.encode()

    async def one_round(conns: list[Conn], watcher: Watcher | None, ramp_s: float = 0.0) -> list[dict[str, Any]]:
        async def one(i: int, conn: Conn) -> dict[str, Any]:
            if ramp_s:
                await asyncio.sleep(ramp_s * i / len(conns))
            t0 = time.perf_counter()
            if watcher is not None:
                watcher.counts["in_flight"] += 1
                watcher.max_in_flight = max(watcher.max_in_flight, watcher.counts["in_flight"])
            try:
                status = await conn.request(raw)
            except (OSError, httptools.HttpParserError) as exc:
                return {"status": 0, "error": repr(exc), "tokens": conn.tokens, "chunks": conn.chunks, "done": False,
                        "ok": False, "s": time.perf_counter() - t0}
            finally:
                if watcher is not None:
                    watcher.counts["in_flight"] -= 1
                    if conn.headers_at:
                        watcher.counts["open"] -= 1
            enough = conn.tokens >= job.expect_tokens if job.at_least else conn.tokens == job.expect_tokens
            ok = status == 200 and conn.saw_done and (not job.expect_tokens or enough)
            return {"status": status, "tokens": conn.tokens, "chunks": conn.chunks, "done": conn.saw_done,
                    "ok": ok, "bytes": conn.nbytes, "s": time.perf_counter() - t0, "why": error_message(conn.failure)}

        return await asyncio.gather(*(one(i, c) for i, c in enumerate(conns)))

    async def open_conns(watcher: Watcher | None) -> list[Conn]:
        conns = await asyncio.gather(*(connect(job.host, job.port, token=token, done=done) for _ in range(job.streams)))
        if watcher is not None:
            def opened() -> None:
                watcher.counts["open"] += 1
                watcher.max_open = max(watcher.max_open, watcher.counts["open"])
            for c in conns:
                c.on_headers = opened
        return conns

    if job.warmup_streams:
        warm = await asyncio.gather(*(connect(job.host, job.port, token=token, done=done)
                                      for _ in range(min(job.warmup_streams, job.streams))))
        warm_raw = build_request(job.host, job.port, job.path, (job.warmup_body or job.body).encode())
        for c in warm:
            await c.request(warm_raw)
        for c in warm:
            c.close()
    watcher = Watcher(job.watch, job.rss_interval_s)
    watcher.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    conns = await open_conns(watcher)
    results: list[dict[str, Any]] = []
    for k in range(job.rounds):
        results += await one_round(conns, watcher, job.ramp_s if k == 0 else 0.0)
    elapsed, own_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    procs = await watcher.stop()
    for c in conns:
        c.close()
    complete = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in results)
    durations = sorted(r["s"] for r in results)
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            key = r.get("error") or f"status {r['status']}, done={r['done']}, tokens={r['tokens']}" + (
                f", {r['why']}" if r.get("why") else "")
            errors[key[:120]] = errors.get(key[:120], 0) + 1
    return {
        "streams": len(results), "complete": len(complete), "tokens": tokens,
        "chunks": sum(r["chunks"] for r in results), "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "stream_p50_s": percentile(durations, 50), "stream_max_s": durations[-1] if durations else 0.0,
        "errors": errors, "procs": procs, "loadgen_busy": own_cpu / elapsed,
    }


def pin_self(cpus: list[int]) -> list[int]:
    """Pin this process to ``cpus`` where the OS allows; returns the affinity now in force."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError:
            pass
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    job = Job(**orjson.loads(argv[0]))
    affinity = pin_self(job.cpus)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < job.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(job.nofile, hard), hard))
    coro = run_closed(job) if job.kind == "closed" else run_streams(job)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    result["loadgen_cpus"] = affinity
    result["job"] = {k: v for k, v in asdict(job).items() if k != "body"}
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
