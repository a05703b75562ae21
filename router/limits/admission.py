"""A request admitted against its key's limits, or refused with 429 before any worker call.

In order, for the key and for the key on this model (``[limits.models]``):

1. concurrency: requests in flight, and streams open, on this replica;
2. requests per minute: one request taken from the window;
3. tokens per minute (``Ticket.reserve``, once the prompt is known): the prompt's tokens, estimated,
   plus what the answer may use (``max_output_tokens``, else ``default_output_tokens``).

A refusal gives back what the request had taken. What a request reserved settles at its end
against its usage (tool turns included: the Response's usage is their sum). Every answer of an
admitted request carries OpenAI's ``x-ratelimit-*`` headers, read as it was admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from policies.limits import duration
from policies.tenant import Tenant
from router.limits.budgets import Budgets, Taken
from router.limits.keys import FLEX_BAND, KeyPolicy, Rates
from router.protocol.errors import RateLimited

# A concurrency refusal has no window to wait for: a slot frees when a request ends.
CONCURRENCY_RETRY_S = 1.0


class LimitMeters(Protocol):
    """Where admission's outcomes are counted, per key name (router/metrics/families.py)."""

    def admitted(self, key: str) -> None: ...

    def rejected(self, key: str, reason: str) -> None: ...

    def tokens(self, key: str, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Scope:
    """One set of rates a request counts against: the key's, or the key's on one model."""

    name: str  # budget names start with it: "key" or "key@model"
    what: str  # for messages: "key 'k'" or "key 'k' on model 'm'"
    rates: Rates


@dataclass(slots=True)
class Ticket:
    """One admitted request: what it took, to give back or settle at its end."""

    admission: Admission
    key: str
    scopes: list[Scope]
    stream: bool
    tenant: Tenant
    requests: list[tuple[str, Taken]] = field(default_factory=list)
    tokens: list[tuple[str, Taken]] = field(default_factory=list)
    reserved: int = 0
    held: bool = True  # counted in flight
    settled: bool = False

    async def reserve(self, tokens: int) -> None:
        """Take ``tokens`` from each tokens-per-minute window; refused, the request gives back all
        it took (it is not counted) and 429 is raised."""
        self.tenant.tokens = tokens  # what the fair queue of a saturated pool charges the key per call
        budgets = self.admission.budgets
        for scope in self.scopes:
            limit = scope.rates.tokens_per_minute
            if not limit:
                continue
            name = f"{scope.name}:tpm"
            taken = await budgets.take(name, limit, tokens)
            if not taken.ok:
                self.refuse()
                if tokens > limit:
                    self.admission.count_rejected(self.key, "request_too_large")
                    raise RateLimited(f"Request too large for {scope.what}: it may use {tokens} tokens (its prompt, "
                                      f"estimated, and max_output_tokens) and the limit is {limit} tokens per minute. "
                                      "Send less, or set a lower max_output_tokens.", retry_after_s=60.0, type="tokens",
                                      headers={"x-should-retry": "false"})
                self.admission.count_rejected(self.key, "tokens_per_minute")
                raise RateLimited(f"Rate limit reached for {scope.what} on tokens per minute: limit {limit}, "
                                  f"requested {tokens}. Please try again in {duration(taken.wait_s)}.",
                                  retry_after_s=taken.wait_s, type="tokens")
            self.tokens.append((name, taken))
        self.reserved = tokens

    def settle(self, usage: Mapping[str, Any] | None) -> None:
        """The request is over: what it reserved corrected by what it used. Idempotent."""
        if self.settled:
            return
        self.settled = True
        self.release()
        used = 0
        if usage:
            used = int(usage.get("input_tokens") or usage.get("prompt_tokens") or 0) + int(
                usage.get("output_tokens") or usage.get("completion_tokens") or 0)
        meters = self.admission.meters
        if meters is not None and used:
            meters.tokens(self.key, used)
        self.tenant.settle(used)
        if self.tokens and used != self.reserved:
            for name, taken in self.tokens:
                self.admission.budgets.settle(name, taken, used - self.reserved)

    def release(self) -> None:
        """No longer in flight (its answer is over, or it runs in the background). Idempotent."""
        if self.held:
            self.held = False
            self.admission.leave(self)

    def refuse(self) -> None:
        """Refused after admission (a later check, a saturated pool's queue): what it took given
        back, nothing counted. After ``settle`` its tokens are already what it used."""
        budgets = self.admission.budgets
        for name, taken in self.requests:
            budgets.settle(name, taken, -1)
        if not self.settled:
            for name, taken in self.tokens:
                budgets.settle(name, taken, -self.reserved)
        self.requests, self.tokens, self.settled = [], [], True
        self.release()

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, for the first scope that limits each (empty: none does)."""
        out: dict[str, str] = {}
        budgets = self.admission.budgets
        for scope in self.scopes:
            for kind, limit, suffix in (("requests", scope.rates.requests_per_minute, "rpm"),
                                        ("tokens", scope.rates.tokens_per_minute, "tpm")):
                if limit and f"x-ratelimit-limit-{kind}" not in out:
                    standing = budgets.standing(f"{scope.name}:{suffix}", limit)
                    out[f"x-ratelimit-limit-{kind}"] = str(limit)
                    out[f"x-ratelimit-remaining-{kind}"] = str(standing.remaining)
                    out[f"x-ratelimit-reset-{kind}"] = duration(standing.reset_s)
        return out


class Admission:
    """Every key's policy and what each has in flight on this replica."""

    def __init__(self, policies: dict[str, KeyPolicy], default: KeyPolicy, budgets: Budgets, *,
                 default_output_tokens: int, meters: LimitMeters | None = None) -> None:
        self.policies = policies
        self.default = default
        self.budgets = budgets
        self.default_output_tokens = default_output_tokens
        self.meters = meters
        self._in_flight: dict[str, int] = {}
        self._streams: dict[str, int] = {}

    def policy(self, key: str) -> KeyPolicy:
        return self.policies.get(key, self.default)

    def in_flight(self, scope: str) -> int:
        return self._in_flight.get(scope, 0)

    async def admit(self, key: str, model: str, *, stream: bool, service_tier: str | None = None,
                    gone: Callable[[], bool] | None = None) -> Ticket:
        """The request's ticket; 429 (``RateLimited``) when the key is over a limit. Nothing is
        counted for a refused request. ``service_tier`` "flex" waits after both bands in a
        saturated pool's queue; ``gone``: whether the client has left (it leaves the queue)."""
        policy = self.policy(key)
        tenant = Tenant(key, FLEX_BAND if service_tier == "flex" else policy.band, gone=gone)
        if not policy.limited:
            if self.meters is not None:
                self.meters.admitted(key)
            return Ticket(self, key, [], stream, tenant, held=False)
        scopes = [Scope(key, f"key {key!r}" if key else "this router", policy.rates)]
        on_model = policy.models.get(model)
        if on_model is not None:
            scopes.append(Scope(f"{key}@{model}", f"key {key!r} on model {model!r}" if key else f"model {model!r}", on_model))
        for scope in scopes:
            rates = scope.rates
            if rates.max_in_flight and self._in_flight.get(scope.name, 0) >= rates.max_in_flight:
                self.count_rejected(key, "max_in_flight")
                raise RateLimited(f"Too many requests in flight for {scope.what}: the limit is {rates.max_in_flight} "
                                  "at once. Try again when one has finished.", retry_after_s=CONCURRENCY_RETRY_S)
            if stream and rates.max_streams and self._streams.get(scope.name, 0) >= rates.max_streams:
                self.count_rejected(key, "max_streams")
                raise RateLimited(f"Too many streams open for {scope.what}: the limit is {rates.max_streams} at once. "
                                  "Try again when one has finished.", retry_after_s=CONCURRENCY_RETRY_S)
        ticket = Ticket(self, key, scopes, stream, tenant)
        for scope in scopes:
            limit = scope.rates.requests_per_minute
            if not limit:
                continue
            name = f"{scope.name}:rpm"
            taken = await self.budgets.take(name, limit, 1)
            if not taken.ok:
                ticket.held = False
                ticket.refuse()
                self.count_rejected(key, "requests_per_minute")
                raise RateLimited(f"Rate limit reached for {scope.what} on requests per minute: limit {limit}. "
                                  f"Please try again in {duration(taken.wait_s)}.", retry_after_s=taken.wait_s)
            ticket.requests.append((name, taken))
        for scope in scopes:
            self._in_flight[scope.name] = self._in_flight.get(scope.name, 0) + 1
            if stream:
                self._streams[scope.name] = self._streams.get(scope.name, 0) + 1
        if self.meters is not None:
            self.meters.admitted(key)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        for scope in ticket.scopes:
            self._in_flight[scope.name] -= 1
            if ticket.stream:
                self._streams[scope.name] -= 1

    def count_rejected(self, key: str, reason: str) -> None:
        if self.meters is not None:
            self.meters.rejected(key, reason)

    def output_tokens(self, max_output_tokens: int | None) -> int:
        return max_output_tokens if max_output_tokens is not None else self.default_output_tokens
