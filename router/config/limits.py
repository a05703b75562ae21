"""Per-key limits: what one key may take of the pools, and how replicas share the budgets.

``[limits]`` holds every key's defaults; a key's own ``[auth.keys.limits]`` overrides field by
field (a field it leaves out is the default's, 0 is "no limit"). With no keys configured every
client is one anonymous key. README.md "Limits per key" says what each answer means.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.config.base import Section

# A request's priority band: interactive before batch; any key's service_tier "flex" after both.
Priority = Literal["interactive", "batch"]


class RateLimits(Section):
    """Limits that apply per key, to all its traffic or to one model's. None: inherited; 0: none."""

    # Requests answered at once (streams included), and streams open at once, on this replica.
    max_in_flight: int | None = Field(default=None, ge=0)
    max_streams: int | None = Field(default=None, ge=0)
    # Per minute (a sliding window), shared by the replicas when [limits.shared] names a service.
    requests_per_minute: int | None = Field(default=None, ge=0)
    # A request reserves its prompt's tokens (estimated) plus max_output_tokens (or
    # default_output_tokens) as it is admitted; what it really used settles at its end.
    tokens_per_minute: int | None = Field(default=None, ge=0)


class KeyLimits(RateLimits):
    """A key's limits: rates and concurrency, its priority band."""

    priority: Priority | None = None
    # Per model name, for a small pool shared by many keys: applied beside the key's own.
    models: dict[str, RateLimits] = {}


class SharedLimits(Section):
    # Where the replicas keep one budget per key: a Redis URL (redis://host:port/db). Empty: each
    # process keeps its own (the embedded default). Unreachable: each replica keeps its own until
    # it is back, with one log line; no request is refused because of it.
    redis_url: str = ""
    # Every Redis key the router writes starts with this (several routers may share a server).
    key_prefix: str = Field(default="responses-router", min_length=1)
    # A replica claims this share of a limit at a time and spends it locally, so most requests
    # need no round trip; what it holds unspent is returned as the window rolls over.
    lease_fraction: float = Field(default=0.05, gt=0, le=1)
    # After the service fails, how long before it is tried again.
    retry_s: float = Field(default=5.0, gt=0)


class QueueLimits(Section):
    # A saturated pool's fair queue (router/README "Limits per key"): requests wait in the router,
    # the key served least recently first. Beyond these, 429 (the key's share) or 503 (the pool's).
    max_queued: int = Field(default=1024, ge=0)
    max_queued_per_key: int = Field(default=64, ge=0)
    max_wait_s: float = Field(default=30.0, gt=0)
    # Service counted for fairness fades with this half-life.
    half_life_s: float = Field(default=60.0, gt=0)


class LimitsConfig(KeyLimits):
    """``[limits]``: every key's defaults, and the sharing and queueing of them."""

    # What a request reserves for its answer when it does not set max_output_tokens.
    default_output_tokens: int = Field(default=1024, ge=0)
    shared: SharedLimits = SharedLimits()
    queue: QueueLimits = QueueLimits()
