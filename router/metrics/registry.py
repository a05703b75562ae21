"""A small Prometheus registry for one asyncio process.

Recording is a dict lookup keyed by a tuple of label values plus one add:
no locks (one thread), no string formatting, no validation after the first
sample of a series (the label count is checked once, when a series is new).
Everything textual happens in ``Registry.render()``, at scrape time, in the
text exposition format 0.0.4.

Label values are passed positionally, in the order of ``labelnames``::

    requests = Counter("x_requests_total", "Requests.", ("model", "status"))
    requests.inc(("gpt", "completed"))
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import TypeVar

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


class CounterFunc(GaugeFunc):
    """A counter whose samples come from ``fn()`` at render time (a count kept elsewhere, only ever rising)."""

    type = "counter"
    __slots__ = ()


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

    def counter_func(self, name: str, help: str, labelnames: Sequence[str],
                     fn: Callable[[], Iterable[tuple[Labels, float]]]) -> CounterFunc:
        return self.register(CounterFunc(name, help, labelnames, fn))

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
