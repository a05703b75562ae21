"""A small Prometheus registry for one asyncio process, and the router's metrics.

Recording is a dict lookup keyed by a tuple of label values plus one add:
no locks (one thread), no string formatting, no validation after the first
sample of a series (the label count is checked once, when a series is new).
Everything textual happens in ``Registry.render()``, at scrape time, in the
text exposition format 0.0.4.

Label values are passed positionally, in the order of ``labelnames``::

    requests = Counter("x_requests_total", "Requests.", ("model", "status"))
    requests.inc(("gpt", "completed"))

``RouterMetrics`` creates the router's metrics; ``RequestTimer`` measures one
response (time to first token, mean inter-token latency, duration, tokens).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import pairwise
from typing import Any, TypeVar

__all__ = [
    "CONTENT_TYPE",
    "DURATION_BUCKETS",
    "ITL_BUCKETS",
    "STATUSES",
    "TTFT_BUCKETS",
    "Counter",
    "Gauge",
    "GaugeFunc",
    "Histogram",
    "Registry",
    "RequestTimer",
    "RouterMetrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[str, ...]


# --- formatting (render time only) -------------------------------------------------------------


def format_value(value: float) -> str:
    """A sample value or ``le`` bound: integers without a fraction, ``+Inf``/``-Inf``/``NaN`` spelled out."""
    if math.isnan(value):
        return "NaN"
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[object], extra: str = "") -> str:
    parts = [f'{n}="{escape_label_value(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _check_name(name: str) -> None:
    ok = bool(name) and not name[0].isdigit() and all((c.isalnum() and c.isascii()) or c in "_:" for c in name)
    if not ok:
        raise ValueError(f"invalid metric name {name!r}")


# --- metrics -----------------------------------------------------------------------------------


class _Metric:
    type = "untyped"
    __slots__ = ("help", "labelnames", "name")

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        _check_name(name)
        for label in labelnames:
            _check_name(label)
            if label.startswith("__") or label == "le" or ":" in label:
                raise ValueError(f"invalid label name {label!r}")
        self.name = name
        self.help = help
        self.labelnames: tuple[str, ...] = tuple(labelnames)

    def _new_series(self, labels: Labels) -> None:
        if type(labels) is not tuple or len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected label values for {self.labelnames}, got {labels!r}")

    def samples(self) -> Iterable[tuple[str, str, float]]:
        """(sample name, rendered labels, value) for each sample line."""
        raise NotImplementedError

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {escape_help(self.help)}\n# TYPE {self.name} {self.type}\n")
        for name, labels, value in self.samples():
            out.append(f"{name}{labels} {format_value(value)}\n")


class _Values(_Metric):
    """One float per label tuple: what a counter and a gauge both keep."""

    __slots__ = ("_values",)

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[Labels, float] = {}

    def inc(self, labels: Labels = (), value: float = 1.0) -> None:
        values = self._values
        old = values.get(labels)
        if old is None:
            self._new_series(labels)
            old = 0.0
        values[labels] = old + value

    def get(self, labels: Labels = ()) -> float:
        return self._values.get(labels, 0.0)

    def samples(self) -> Iterable[tuple[str, str, float]]:
        names = self.labelnames
        for labels, value in list(self._values.items()):
            yield self.name, _label_text(names, labels), value


class Counter(_Values):
    """A monotonically increasing sum per label tuple; ``name`` should end in ``_total``."""

    type = "counter"
    __slots__ = ()


class Gauge(_Values):
    """A value that goes up and down, set by the process."""

    type = "gauge"
    __slots__ = ()

    def set(self, labels: Labels, value: float) -> None:
        values = self._values
        if labels not in values:
            self._new_series(labels)
        values[labels] = value

    def dec(self, labels: Labels = (), value: float = 1.0) -> None:
        self.inc(labels, -value)

    def remove(self, labels: Labels) -> None:
        self._values.pop(labels, None)


class GaugeFunc(_Metric):
    """A gauge whose samples come from ``fn()`` at render time: an iterable of (label values, value).

    Meant for state that already lives elsewhere (worker health, in-flight
    counts, restarts): nothing is recorded on the hot path. If ``fn`` raises,
    the family is rendered without samples rather than failing the scrape.
    """

    type = "gauge"
    __slots__ = ("fn",)

    def __init__(self, name: str, help: str, labelnames: Sequence[str],
                 fn: Callable[[], Iterable[tuple[Labels, float]]]) -> None:
        super().__init__(name, help, labelnames)
        self.fn = fn

    def samples(self) -> Iterable[tuple[str, str, float]]:
        names = self.labelnames
        try:
            rows = list(self.fn())
        except Exception:  # noqa: BLE001 - a broken callback must not take the whole scrape down
            return
        for labels, value in rows:
            if len(labels) != len(names):
                continue
            yield self.name, _label_text(names, labels), float(value)


class Histogram(_Metric):
    """Cumulative-bucket histogram. ``buckets`` are the finite upper bounds (``le``), ascending; ``+Inf`` is implied.

    Per series the state is one list of floats: a count per bucket (not cumulative; the
    last slot is the ``+Inf`` overflow), then the sum. ``observe`` is a bisect
    and two adds; the counts are accumulated at render time.
    """

    type = "histogram"
    __slots__ = ("_series", "buckets")

    def __init__(self, name: str, help: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, help, labelnames)
        bounds = [float(b) for b in buckets if b != math.inf]
        if not bounds or any(not a < b for a, b in pairwise(bounds)) or any(math.isnan(b) for b in bounds):
            raise ValueError(f"{name}: buckets must be non-empty and strictly increasing")
        self.buckets: tuple[float, ...] = tuple(bounds)
        self._series: dict[Labels, list[float]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        state = self._series.get(labels)
        if state is None:
            self._new_series(labels)
            state = self._series[labels] = [0.0] * (len(self.buckets) + 2)
        state[bisect_left(self.buckets, value)] += 1  # first bound >= value: le is inclusive
        state[-1] += value

    def count(self, labels: Labels) -> int:
        state = self._series.get(labels)
        return 0 if state is None else int(sum(state[:-1]))

    def sum(self, labels: Labels) -> float:
        state = self._series.get(labels)
        return 0.0 if state is None else state[-1]

    def samples(self) -> Iterable[tuple[str, str, float]]:
        names = self.labelnames
        bounds = [*(format_value(b) for b in self.buckets), "+Inf"]
        bucket = self.name + "_bucket"
        for labels, state in list(self._series.items()):
            cumulative = 0.0
            for bound, n in zip(bounds, state):
                cumulative += n
                yield bucket, _label_text(names, labels, f'le="{bound}"'), cumulative
            yield self.name + "_sum", _label_text(names, labels), state[-1]
            yield self.name + "_count", _label_text(names, labels), cumulative


_MetricT = TypeVar("_MetricT", bound="_Metric")


class Registry:
    """Holds metric families in registration order and renders them."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _MetricT) -> _MetricT:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name!r} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self.register(Gauge(name, help, labelnames))

    def gauge_func(self, name: str, help: str, labelnames: Sequence[str],
                   fn: Callable[[], Iterable[tuple[Labels, float]]]) -> GaugeFunc:
        return self.register(GaugeFunc(name, help, labelnames, fn))

    def histogram(self, name: str, help: str, labelnames: Sequence[str], buckets: Sequence[float]) -> Histogram:
        return self.register(Histogram(name, help, labelnames, buckets))

    def get(self, name: str) -> _Metric | None:
        return self._metrics.get(name)

    def __iter__(self) -> Iterator[_Metric]:
        return iter(list(self._metrics.values()))

    def render(self) -> bytes:
        out: list[str] = []
        for metric in list(self._metrics.values()):
            metric.render(out)
        return "".join(out).encode()


# --- the router's metrics ----------------------------------------------------------------------

STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled", "error"})

# Roughly 1-2.5-5 steps; finer where LLM latencies cluster.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
                    120.0, 180.0, 300.0, 450.0, 600.0)

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

    def render(self) -> bytes:
        return self.registry.render()


def _healthy(worker: Any) -> float:
    return 1.0 if worker.healthy else 0.0


def _in_flight(worker: Any) -> float:
    return float(worker.in_flight)


def _restarts(worker: Any) -> float:
    process = getattr(worker, "process", None)
    return float(getattr(process, "restarts", 0) or 0)


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
