"""Per-key metrics: what each key was admitted, refused, queued and served, by the key's name
(never the key). ``router/limits/admission.py`` and the pools' fair queues count into it."""

from __future__ import annotations

from router.metrics.registry import Registry

_P = "responses_router_"
# Waits in a saturated pool's fair queue: from a few ms to its bound (30 s by default).
WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class KeyMeters:
    def __init__(self, r: Registry) -> None:
        self.admitted_total = r.counter(_P + "key_requests_admitted_total", "Requests admitted under their key's limits.",
                                        ("key",))
        self.rejected_total = r.counter(
            _P + "key_requests_rejected_total", "Requests refused for their key, by reason: max_in_flight, max_streams, "
            "requests_per_minute, tokens_per_minute, request_too_large, queue_key_full (429); queue_queue_full, "
            "queue_timeout (503); queue_client_left (left while it waited).", ("key", "reason"))
        self.queued_total = r.counter(_P + "key_requests_queued_total",
                                      "Requests that waited in a saturated pool's fair queue.", ("key",))
        self.queue_wait = r.histogram(_P + "key_queue_wait_seconds", "Time a request waited in a saturated pool's "
                                      "fair queue before a worker took it.", ("key",), WAIT_BUCKETS)
        self.tokens_total = r.counter(_P + "key_tokens_total", "Tokens served (prompt and output) to requests of the key.",
                                      ("key",))

    def admitted(self, key: str) -> None:
        self.admitted_total.inc((key,))

    def rejected(self, key: str, reason: str) -> None:
        self.rejected_total.inc((key, reason))

    def tokens(self, key: str, n: int) -> None:
        self.tokens_total.inc((key,), n)

    def queued(self, key: str, seconds: float) -> None:
        self.queued_total.inc((key,))
        self.queue_wait.observe((key,), seconds)
