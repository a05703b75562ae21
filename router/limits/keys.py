"""Each key's limits as they apply: its own fields over ``[limits]``, per model beside them."""

from __future__ import annotations

from dataclasses import dataclass

from router.config import Config
from router.config.limits import KeyLimits, LimitsConfig, RateLimits

BANDS = {"interactive": 0, "batch": 1}
FLEX_BAND = 2  # service_tier "flex", any key's: after both


@dataclass(frozen=True, slots=True)
class Rates:
    """One scope's rates and concurrency; 0: no limit."""

    max_in_flight: int = 0
    max_streams: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0

    @property
    def any(self) -> bool:
        return bool(self.max_in_flight or self.max_streams or self.requests_per_minute or self.tokens_per_minute)


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """What applies to one key: its rates, per model, and its band."""

    rates: Rates
    models: dict[str, Rates]
    band: int = 0

    @property
    def limited(self) -> bool:
        """Whether any rate or concurrency limit applies (else admission costs nothing)."""
        return self.rates.any or any(r.any for r in self.models.values())


def _rates(*layers: RateLimits | None) -> Rates:
    """Field by field, the first layer that sets it (None: not set)."""
    out = {}
    for name in ("max_in_flight", "max_streams", "requests_per_minute", "tokens_per_minute"):
        value = next((getattr(layer, name) for layer in layers if layer is not None and getattr(layer, name) is not None), None)
        out[name] = value or 0
    return Rates(**out)


def key_policy(own: KeyLimits, defaults: LimitsConfig) -> KeyPolicy:
    models = {name: _rates(own.models.get(name), defaults.models.get(name)) for name in {*own.models, *defaults.models}}
    priority = own.priority or defaults.priority or "interactive"
    return KeyPolicy(
        rates=_rates(own, defaults),
        models={name: rates for name, rates in models.items() if rates.any},
        band=BANDS[priority],
    )


def policies(config: Config) -> dict[str, KeyPolicy]:
    """Every key's policy by its name; the anonymous owner ("", no keys configured) and any
    owner not listed get ``[limits]`` alone (``default_policy``)."""
    return {key.name: key_policy(key.limits, config.limits) for key in config.auth.keys}


def default_policy(config: Config) -> KeyPolicy:
    return key_policy(KeyLimits(), config.limits)
