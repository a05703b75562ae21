"""The router's metrics: a small Prometheus registry (``registry``) and the router's families
(``families``: ``RouterMetrics``, ``RequestTimer``)."""

from router.metrics.families import (
    DURATION_BUCKETS,
    ITL_BUCKETS,
    STATUSES,
    TTFT_BUCKETS,
    RequestTimer,
    RouterMetrics,
)
from router.metrics.registry import CONTENT_TYPE, Counter, Gauge, GaugeFunc, Histogram, Registry

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
