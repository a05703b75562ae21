"""The router's metric families, and ``RequestTimer``, which measures one response (time to first
token, mean inter-token latency, duration, tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from router.metrics.keys import KeyMeters
from router.metrics.registry import Labels, Registry

# "rejected": failed through the request's fault (the engine called it bad, it does not fit the
# context): counted apart, never against an arm (router/report.py).
STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled", "rejected", "error"})

# Roughly 1-2.5-5 steps; finer where LLM latencies cluster.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
                    120.0, 180.0, 300.0, 450.0, 600.0)

STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_P = "responses_router_"
_MAP = ("model", "arm", "pool")


class RouterMetrics:
    """The router's metric families on one ``Registry``.

    ``model`` is the public model name, ``arm`` the experiment arm (the pool's
    name when the model has no experiment), ``pool`` the pool that served.
    Worker gauges come from ``watch_pools``: nothing is recorded for them.
    """

    def __init__(self, registry: Registry | None = None) -> None:
        r = self.registry = registry if registry is not None else Registry()
        self.requests = r.counter(_P + "requests_total", "Responses finished, by terminal status.", (*_MAP, "status"))
        self.errors = r.counter(_P + "errors_total", "Errors, by kind.", (*_MAP, "kind"))
        self.ttft = r.histogram(_P + "time_to_first_token_seconds", "Time from request to first output token.",
                                _MAP, TTFT_BUCKETS)
        self.itl = r.histogram(_P + "inter_token_latency_seconds",
                               "Mean time per output token after the first, one sample per response.", _MAP, ITL_BUCKETS)
        self.duration = r.histogram(_P + "request_duration_seconds", "Time from request to terminal status.",
                                    _MAP, DURATION_BUCKETS)
        self.output_tokens = r.counter(_P + "output_tokens_total", "Output tokens generated.", _MAP)
        self.input_tokens = r.counter(_P + "input_tokens_total", "Input (prompt) tokens.", _MAP)
        self.cached_tokens = r.counter(_P + "cached_tokens_total", "Input tokens served from the prefix cache.", _MAP)
        self.arm_failovers = r.counter(_P + "arm_failovers_total", "Requests moved from their arm to another.",
                                       ("model", "from_arm", "to_arm"))
        self.affinity_moves = r.counter(_P + "affinity_moves_total",
                                        "Continuations not sent to the worker holding their prefix.", ("pool", "why"))
        self._pools: Callable[[], Iterable[Any]] = tuple
        self.worker_healthy = r.gauge_func(_P + "worker_healthy", "1 when the worker takes requests.", ("pool", "worker"),
                                           lambda: self._worker_rows(_healthy))
        self.worker_in_flight = r.gauge_func(_P + "worker_in_flight", "Requests in flight on the worker.",
                                             ("pool", "worker"), lambda: self._worker_rows(_in_flight))
        self.worker_restarts = r.gauge_func(_P + "worker_restarts", "Restarts of a managed worker.", ("pool", "worker"),
                                            lambda: self._worker_rows(_restarts))
        self.kv_index_blocks = r.gauge_func(
            _P + "kv_index_blocks", "KV-cache blocks the pool's index holds for the worker, from its engine's KV events.",
            ("pool", "worker"), lambda: self._kv_rows(lambda feed, url: feed.held(url)))
        self.kv_event_messages = r.counter_func(
            _P + "kv_event_messages_total", "KV-event messages received from the worker (replayed ones included).",
            ("pool", "worker"), lambda: self._kv_rows(lambda feed, url: _kv_count(feed, url, "messages")))
        self.kv_event_problems = r.counter_func(
            _P + "kv_event_problems_total", "What went wrong with the worker's KV events, by kind: gap (messages "
            "missed), bad (did not decode), dropped (its entries dropped: a gap not replayed, a restart).",
            ("pool", "worker", "kind"), self._kv_problem_rows)
        self.kv_decisions = r.counter_func(
            _P + "kv_decisions_total", "kv_aware picks by reason: cache (a cached prefix decided), load (no worker "
            "within the load window held any of the prompt).", ("pool", "reason"),
            lambda: [((p.name, reason), n) for p in self._pools() for reason, n in getattr(p, "kv_decisions", {}).items()])
        self.kv_expected_cached = r.counter_func(
            _P + "kv_expected_cached_tokens_total", "Prompt tokens kv_aware picks expected cached on the worker they "
            "chose; against the engines' own report, cached_tokens_total.", ("pool",),
            lambda: [((p.name,), p.kv_expected_tokens) for p in self._pools() if getattr(p, "kv_policy", None) is not None])
        route = (*_MAP, "route")
        self.passthrough_requests = r.counter(
            _P + "passthrough_requests_total", "Relayed chat/completions requests, by the answer's HTTP status "
            "(the worker's, or the router's own when no worker answered).", (*route, "code"))
        self.passthrough_duration = r.histogram(_P + "passthrough_duration_seconds",
                                                "Time from a relayed request to its answer's end.", route, DURATION_BUCKETS)
        self.passthrough_tokens = r.counter(_P + "passthrough_tokens_total",
                                            "Tokens of relayed answers that report usage, by kind (input, output).",
                                            (*route, "kind"))
        shadow = ("model", "pool")
        self.shadow_requests = r.counter(_P + "shadow_requests_total", "Requests mirrored to a shadow pool, by outcome "
                                         "(completed, incomplete, failed; skipped: at its concurrency limit).",
                                         (*shadow, "outcome"))
        self.shadow_duration = r.histogram(_P + "shadow_duration_seconds", "Time a mirrored request took.", shadow,
                                           DURATION_BUCKETS)
        self.shadow_output_tokens = r.counter(_P + "shadow_output_tokens_total", "Output tokens of mirrored requests.", shadow)
        self.shadow_differences = r.counter(
            _P + "shadow_differences_total", "Mirrored answers unlike the client's: in length (output tokens differ by "
            "more than 20%) or in how they ended (status or incomplete reason).", (*shadow, "what"))
        self.tool_calls = r.counter(_P + "tool_calls_total", "Tool calls the router ran, by tool type and outcome (ok, error).",
                                    ("tool", "outcome"))
        self.tool_duration = r.histogram(_P + "tool_call_duration_seconds", "Time a tool call the router ran took.",
                                         ("tool",), DURATION_BUCKETS)
        self.store_duration = r.histogram(_P + "store_operation_seconds", "Time of a store call, its retries included.",
                                          ("operation",), STORE_BUCKETS)
        self.store_errors = r.counter(_P + "store_errors_total", "Store calls that failed (the store unreachable or broken).",
                                      ("operation",))
        self._in_flight: Callable[[], int] = lambda: 0
        self.requests_in_flight = r.gauge_func(_P + "requests_in_flight", "Requests being answered by the router (HTTP "
                                               "requests and WebSocket response.create), streams included.", (),
                                               lambda: [((), float(self._in_flight()))])
        self.limits = KeyMeters(r)
        self.loop_lag = r.histogram(_P + "event_loop_lag_seconds", "How late the router's event loop ran a timer "
                                    "(sampled twice a second): what every request queues behind.", (), LAG_BUCKETS)

    # -- worker gauges

    def watch_pools(self, pools: Callable[[], Iterable[Any]] | Iterable[Any]) -> None:
        """Where the worker gauges read from at render time: pools (or a callable returning them).

        Duck-typed: ``pool.name``, ``pool.workers``; ``worker.url``, ``worker.healthy``,
        ``worker.in_flight``, ``worker.process.restarts`` (0 without a process).
        """
        if callable(pools):
            self._pools = pools
        else:
            fixed = list(pools)
            self._pools = lambda: fixed

    def _worker_rows(self, value: Callable[[Any], float]) -> Iterable[tuple[Labels, float]]:
        for pool in self._pools():
            for worker in pool.workers:
                yield (pool.name, worker.url), value(worker)

    def _kv_rows(self, value: Callable[[Any, str], float]) -> Iterable[tuple[Labels, float]]:
        for pool in self._pools():
            feed = getattr(pool, "kv", None)
            if feed is not None:
                for worker in pool.workers:
                    yield (pool.name, worker.url), value(feed, worker.url)

    def _kv_problem_rows(self) -> Iterable[tuple[Labels, float]]:
        for (pool, url), _ in self._kv_rows(lambda feed, url: 0.0):
            feed = next(p.kv for p in self._pools() if p.name == pool)
            for kind, field_name in (("gap", "gaps"), ("bad", "bad"), ("dropped", "dropped")):
                yield (pool, url, kind), _kv_count(feed, url, field_name)

    def watch_requests(self, in_flight: Callable[[], int]) -> None:
        """Where ``requests_in_flight`` reads from at render time."""
        self._in_flight = in_flight

    # -- recording

    def timer(self, model: str, arm: str, pool: str, *, clock: Callable[[], float] = time.perf_counter,
              start: float | None = None) -> RequestTimer:
        return RequestTimer(self, model, arm, pool, clock=clock, start=start)

    def error(self, model: str, arm: str, pool: str, kind: str) -> None:
        self.errors.inc((model, arm, pool, kind))

    def failover(self, model: str, from_arm: str, to_arm: str) -> None:
        self.arm_failovers.inc((model, from_arm, to_arm))

    def affinity_move(self, pool: str, why: str) -> None:
        self.affinity_moves.inc((pool, why))

    def passthrough(self, labels: tuple[str, str, str, str], code: int, seconds: float,
                    usage: Mapping[str, Any] | None) -> None:
        """One relayed request (model, arm, pool, route) ended with ``code`` after ``seconds``."""
        self.passthrough_requests.inc((*labels, str(code)))
        self.passthrough_duration.observe(labels, seconds)
        inp, out, _ = _usage_counts(usage)
        if inp:
            self.passthrough_tokens.inc((*labels, "input"), inp)
        if out:
            self.passthrough_tokens.inc((*labels, "output"), out)

    def shadow(self, model: str, pool: str, outcome: str, seconds: float | None = None, output_tokens: int | None = None,
               differences: Iterable[str] = ()) -> None:
        labels = (model, pool)
        self.shadow_requests.inc((*labels, outcome))
        if seconds is not None:
            self.shadow_duration.observe(labels, seconds)
        if output_tokens:
            self.shadow_output_tokens.inc(labels, output_tokens)
        for what in differences:
            self.shadow_differences.inc((*labels, what))

    def tool_call(self, tool: str, seconds: float, error: bool) -> None:
        self.tool_calls.inc((tool, "error" if error else "ok"))
        self.tool_duration.observe((tool,), seconds)

    def store_call(self, operation: str, seconds: float, failed: bool) -> None:
        self.store_duration.observe((operation,), seconds)
        if failed:
            self.store_errors.inc((operation,))

    async def sample_loop_lag(self, every_s: float = 0.5) -> None:
        """Forever: how late the loop wakes a sleeper, into ``event_loop_lag_seconds``."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(every_s)
            self.loop_lag.observe((), max(0.0, loop.time() - start - every_s))

    def render(self) -> bytes:
        return self.registry.render()


def _healthy(worker: Any) -> float:
    return 1.0 if worker.healthy else 0.0


def _in_flight(worker: Any) -> float:
    return float(worker.in_flight)


def _restarts(worker: Any) -> float:
    process = getattr(worker, "process", None)
    return float(getattr(process, "restarts", 0) or 0)


def _kv_count(feed: Any, url: str, name: str) -> float:
    counts = feed.counts(url)
    return float(getattr(counts, name)) if counts is not None else 0.0


def _usage_counts(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """(input, output, cached) tokens from a Responses usage (or a chat-completions one); None when absent."""
    if not usage:
        return None, None, None
    inp = usage.get("input_tokens", usage.get("prompt_tokens"))
    out = usage.get("output_tokens", usage.get("completion_tokens"))
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return inp, out, cached


class RequestTimer:
    """Times one response and records it into ``RouterMetrics``.

    ``first_token()`` when the first output arrives (records TTFT at once),
    ``token(n)`` for each output chunk (one clock read and one add),
    ``finish(status, usage)`` once at the end (later calls are ignored).

    Inter-token latency is recorded as ONE sample per response: the mean
    time per output token after the first, ``(t_last - t_first) / (tokens - 1)``,
    vLLM's TPOT definition; ``tokens`` is ``usage.output_tokens`` when the
    usage has it (engines stream several tokens per chunk, so counted chunks
    undercount), else the count given to ``token()``. Why the mean and not
    every gap: per-token observations cost a bisect and a dict lookup per
    token, weigh long answers over short ones, and with multi-token chunks
    mostly measure the engine's stream interval (gaps of zero, then one long
    one). Per-response means make the p50/p95 across responses comparable
    between arms whatever the answer lengths. It hides stalls inside one
    response; the duration histogram still shows them.
    """

    __slots__ = ("clock", "done", "first", "labels", "last", "metrics", "start", "tokens")

    def __init__(self, metrics: RouterMetrics, model: str, arm: str, pool: str, *,
                 clock: Callable[[], float] = time.perf_counter, start: float | None = None) -> None:
        self.metrics = metrics
        self.labels: Labels = (model, arm, pool)
        self.clock = clock
        self.start = clock() if start is None else start
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.done = False

    def first_token(self) -> None:
        """Marks the first output (text, reasoning or a tool call's arguments); later calls do nothing."""
        if self.first is None:
            now = self.last = self.first = self.clock()
            self.metrics.ttft.observe(self.labels, now - self.start)

    def token(self, n: int = 1) -> None:
        """``n`` output tokens just arrived (the first call also marks the first token)."""
        if self.first is None:
            self.first_token()
        else:
            self.last = self.clock()
        self.tokens += n

    def error(self, kind: str) -> None:
        self.metrics.errors.inc((*self.labels, kind))

    def finish(self, status: str, usage: Mapping[str, Any] | None = None) -> None:
        """Records the response: status (one of STATUSES; anything else counts as ``error``), duration, tokens, ITL."""
        if self.done:
            return
        self.done = True
        m, labels = self.metrics, self.labels
        m.requests.inc((*labels, status if status in STATUSES else "error"))
        m.duration.observe(labels, self.clock() - self.start)
        inp, out, cached = _usage_counts(usage)
        tokens = out if out is not None else self.tokens
        if tokens:
            m.output_tokens.inc(labels, tokens)
        if inp:
            m.input_tokens.inc(labels, inp)
        if cached:
            m.cached_tokens.inc(labels, cached)
        if self.first is not None and tokens > 1 and self.last > self.first:
            m.itl.observe(labels, (self.last - self.first) / (tokens - 1))
