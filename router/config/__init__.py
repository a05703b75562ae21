"""The router's TOML configuration, validated by pydantic.

A wrong key, type or reference stops start-up with ONE readable line that
names the key (``ConfigError``), never a traceback.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from router.config.base import FieldReference, Reference, Section
from router.config.limits import KeyLimits, LimitsConfig
from router.config.pools import ChatConfig, ManagedConfig, PoolConfig
from router.config.tools import CodeInterpreterConfig, McpConfig, McpServerConfig, ToolsConfig, WebSearchConfig

__all__ = [
    "STOP_MARGIN_S",
    "ApiKey",
    "ArmConfig",
    "AuthConfig",
    "BackgroundConfig",
    "ChatConfig",
    "CodeInterpreterConfig",
    "Config",
    "ConfigError",
    "HarmonyConfig",
    "KeyLimits",
    "LimitsConfig",
    "ManagedConfig",
    "McpConfig",
    "McpServerConfig",
    "ModelConfig",
    "PoolConfig",
    "SealingConfig",
    "ServerConfig",
    "ShadowConfig",
    "StoreConfig",
    "TelemetryConfig",
    "ToolsConfig",
    "WebSearchConfig",
    "load_config",
    "parse_config",
]

# After the grace, the requests still running get this long to say so and be stored.
STOP_MARGIN_S = 2.0


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Every log line as text (a terminal) or as one JSON object (a log pipeline): router/api/access.py.
    log_format: Literal["text", "json"] = "text"
    # One line per request (and WebSocket response.create) at info, on the logger router.access.
    access_log: bool = True
    # WebSocket connections to /v1/responses are closed (code 1000) after this long.
    websocket_max_age_s: float = Field(default=3600.0, gt=0)
    # On SIGTERM, requests and background responses running get this long to finish; then a stream
    # ends with error + response.failed (code router_stopped, stored failed), a create answers 503,
    # a background response is stored failed. The listening socket closes at once.
    shutdown_grace_s: float = Field(default=5.0, ge=0, le=3600)
    # SIGTERM to exit, all of it: the grace, STOP_MARGIN_S to end what is left and store it, then
    # managed workers get what remains before SIGKILL. Fits a 10 s stop (docker, systemd's default is 90).
    stop_timeout_s: float = Field(default=9.0, gt=0, le=7200)
    # A request's head must arrive within header_timeout_s of the connection (or of its first
    # byte after an idle keep-alive), its body within body_timeout_s of the head: else 408, closed.
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # An idle kept-alive connection is closed after this long, said in every answer's
    # Keep-Alive: timeout=N. Longer than clients keep theirs (httpx and the openai SDK: 5 s), so
    # a request sent on a reused connection never meets the router's close (nginx's default: 75).
    keep_alive_s: float = Field(default=75.0, ge=1, le=3600)
    # Open connections at most; past it the one waiting longest for its client is closed.
    # Default: what the file-descriptor limit allows (half of it, the rest for worker calls).
    max_connections: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _stop_budget(self) -> ServerConfig:
        if self.shutdown_grace_s + STOP_MARGIN_S > self.stop_timeout_s:
            raise ValueError(f"shutdown_grace_s ({self.shutdown_grace_s:g}) + {STOP_MARGIN_S:g} s to end what is left "
                             f"does not fit in stop_timeout_s ({self.stop_timeout_s:g})")
        return self


class StoreConfig(Section):
    # sqlite: one embedded file (one router process); postgres: shared by several replicas.
    kind: Literal["sqlite", "postgres"] = "sqlite"
    # sqlite: relative paths are resolved against the config file's folder.
    path: str = "responses.db"
    # postgres: the DSN itself, or the name of an environment variable holding it
    # (keeps a password out of the config file). Exactly one of the two.
    dsn: str | None = None
    dsn_env: str | None = None
    pool_min: int = Field(default=1, ge=0)
    pool_max: int = Field(default=10, ge=1)
    # postgres: a call that loses the server (a restart, an outage) is retried, with backoff, for
    # this long; past it, 503 store_unavailable (a stream: error + response.failed).
    retry_s: float = Field(default=30.0, ge=0, le=3600)
    # Stored responses expire this many seconds after they are created; None keeps them forever.
    ttl_s: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _kind(self) -> StoreConfig:
        if self.kind == "postgres":
            if (self.dsn is None) == (self.dsn_env is None):
                raise ValueError("a postgres store needs exactly one of dsn or dsn_env")
        elif self.dsn is not None or self.dsn_env is not None:
            raise ValueError("dsn and dsn_env are for kind = \"postgres\"")
        if self.pool_min > self.pool_max:
            raise ValueError(f"pool_min ({self.pool_min}) is above pool_max ({self.pool_max})")
        return self

    def resolved_dsn(self) -> str:
        """The postgres DSN, read from the environment when ``dsn_env`` names it."""
        if self.dsn is not None:
            return self.dsn
        import os

        value = os.environ.get(self.dsn_env or "")
        if not value:
            raise ConfigError(f"store.dsn_env: environment variable {self.dsn_env!r} is not set")
        return value


class ApiKey(Section):
    """One client key, given exactly one way: plain, as its sha256 (hex), or by an env var holding it."""

    name: str = Field(min_length=1)
    key: str | None = Field(default=None, min_length=8)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    key_env: str | None = Field(default=None, min_length=1)
    # The names of this key's streamed reasoning events (docs/api.md "Reasoning event names"); unset: the model's.
    reasoning_events: Literal["openai", "open-responses"] | None = None
    # Its own limits, field by field over [limits] (router/config/limits.py).
    limits: KeyLimits = KeyLimits()

    @model_validator(mode="after")
    def _one_way(self) -> ApiKey:
        if sum(v is not None for v in (self.key, self.key_sha256, self.key_env)) != 1:
            raise ValueError("give exactly one of key, key_sha256 or key_env")
        return self

    def digest(self) -> str:
        """The key's sha256, hex: what the router compares (it never needs the key itself)."""
        import hashlib
        import os

        if self.key_sha256 is not None:
            return self.key_sha256.lower()
        value = self.key if self.key is not None else os.environ.get(self.key_env or "")
        if not value:
            raise ConfigError(f"auth.keys: environment variable {self.key_env!r} (key {self.name!r}) is not set")
        return hashlib.sha256(value.encode()).hexdigest()


class AuthConfig(Section):
    # No keys: the router is open (fine on loopback, not elsewhere).
    keys: list[ApiKey] = []
    # Guards /admin (adding and removing workers); empty: /admin is closed.
    admin_key: str = ""

    @field_validator("admin_key")
    @classmethod
    def _long_enough(cls, value: str) -> str:
        if value and len(value) < 8:
            raise ValueError("must be at least 8 characters, as client keys are")
        return value

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        names = [k.name for k in self.keys]
        if len(names) != len(set(names)):
            raise ValueError("two keys share a name")
        return self


class ArmConfig(Section):
    pool: str = Field(min_length=1)
    weight: float = Field(default=1.0, gt=0)
    name: str = ""  # empty: the pool's name


class ShadowConfig(Section):
    # Mirror this fraction of requests to a candidate pool; its answers are discarded.
    pool: str = Field(min_length=1)
    rate: float = Field(gt=0, le=1)
    max_concurrency: int = Field(default=4, ge=1)


class ModelConfig(Section):
    # The public name clients send as "model".
    name: str = Field(min_length=1)
    # One pool, or weighted arms (an A/B experiment, sticky per conversation).
    pool: str = ""
    arms: list[ArmConfig] = []
    shadow: ShadowConfig | None = None
    # The names of its streamed reasoning events: OpenAI's (response.reasoning_text.*) or the Open
    # Responses specification's (response.reasoning.*); a request's reasoning_events or its key's win.
    reasoning_events: Literal["openai", "open-responses"] = "openai"

    @model_validator(mode="after")
    def _one_target(self) -> ModelConfig:
        if bool(self.pool) == bool(self.arms):
            raise ValueError("give exactly one of pool or arms")
        names = [a.name or a.pool for a in self.arms]
        if len(names) != len(set(names)):
            raise ValueError("two arms share a name")
        return self

    @property
    def arm_list(self) -> list[ArmConfig]:
        return self.arms or [ArmConfig(pool=self.pool)]


class BackgroundConfig(Section):
    # A replica renews its lease on the background responses it runs; one that stops renewing
    # (it died) has its responses marked failed by any replica once the lease runs out.
    lease_s: float = Field(default=30.0, gt=0)
    # How many events one response's replay log keeps (the terminal event always).
    max_events: int = Field(default=100_000, ge=10)


class HarmonyConfig(Section):
    # The folder holding o200k_base.tiktoken (`responses-router harmony-vocab DIR` builds it);
    # empty: $TIKTOKEN_ENCODINGS_BASE. Relative to the config file.
    vocab_dir: str = ""


class SealingConfig(Section):
    """Keys for blobs the router seals for clients (compaction items): AES-256-GCM.

    Each key is base64 of 32 random bytes (`python -c "import base64,os;print(base64.b64encode(os.urandom(32)).decode())"`).
    The first key seals, all keys open: to rotate, put the new key first and keep the old one a while.
    Every replica needs the same keys. None at all: a random per-process key (blobs die with the process).
    """

    keys: list[str] = []
    # The name of an environment variable holding the keys, comma-separated (keeps them out of the file).
    keys_env: str | None = None

    @model_validator(mode="after")
    def _keys(self) -> SealingConfig:
        from router.protocol.sealing import decode_key

        if self.keys and self.keys_env is not None:
            raise ValueError("give at most one of keys or keys_env")
        for i, key in enumerate(self.keys):
            try:
                decode_key(key)
            except ValueError as exc:
                raise Reference(f"sealing.keys[{i}]", str(exc)) from None
        return self

    def resolved_keys(self) -> list[bytes]:
        """The keys as bytes, read from the environment when ``keys_env`` names them; [] when none."""
        from router.protocol.sealing import decode_key

        texts = list(self.keys)
        if self.keys_env is not None:
            import os

            value = os.environ.get(self.keys_env)
            if not value or not value.strip():
                raise ConfigError(f"sealing.keys_env: environment variable {self.keys_env!r} is not set")
            texts = [t for t in value.split(",") if t.strip()]
        out = []
        for i, text in enumerate(texts):
            try:
                out.append(decode_key(text))
            except ValueError as exc:
                where = f"sealing.keys_env ({self.keys_env}) key {i}" if self.keys_env else f"sealing.keys[{i}]"
                raise ConfigError(f"{where}: {exc}") from None
        return out


class TelemetryConfig(Section):
    # OpenTelemetry traces, sent over OTLP/HTTP to this URL (e.g. http://collector:4318/v1/traces);
    # empty: none. Needs the optional extra: pip install 'responses-router[otel]'.
    otlp_endpoint: str = ""
    service_name: str = Field(default="responses-router", min_length=1)
    # The share of requests traced (a client's sampled traceparent is always followed).
    sample_ratio: float = Field(default=1.0, ge=0, le=1)


class Config(Section):
    server: ServerConfig = ServerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    harmony: HarmonyConfig = HarmonyConfig()
    background: BackgroundConfig = BackgroundConfig()
    tools: ToolsConfig = ToolsConfig()
    store: StoreConfig = StoreConfig()
    auth: AuthConfig = AuthConfig()
    sealing: SealingConfig = SealingConfig()
    limits: LimitsConfig = LimitsConfig()
    pools: list[PoolConfig] = Field(min_length=1)
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _references(self) -> Config:
        pool_names = [p.name for p in self.pools]
        if len(pool_names) != len(set(pool_names)):
            raise ValueError("two pools share a name")
        model_names = [m.name for m in self.models]
        if len(model_names) != len(set(model_names)):
            raise ValueError("two models share a name")
        for i, model in enumerate(self.models):
            targets = [(f"models[{i}].pool", model.pool)] if model.pool else [
                (f"models[{i}].arms[{j}].pool", arm.pool) for j, arm in enumerate(model.arms)]
            if model.shadow is not None:
                targets.append((f"models[{i}].shadow.pool", model.shadow.pool))
            for key, pool in targets:
                if pool not in pool_names:
                    raise Reference(key, f"no pool named {pool!r} (pools: {', '.join(pool_names)})")
        limited = [("limits.models", self.limits)] + [(f"auth.keys[{i}].limits.models", k.limits) for i, k in enumerate(self.auth.keys)]
        for key, limits in limited:
            for name in limits.models:
                if name not in model_names:
                    raise Reference(f"{key}.{name}", f"no model named {name!r} (models: {', '.join(model_names)})")
        return self

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)


class ConfigError(Exception):
    """One readable line: which key, what is wrong."""


def parse_config(text: str, *, source: str = "config") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_first_error(exc)}") from None


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_config(text, source=str(path))


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = _dotted(err["loc"])
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, FieldReference):
        return f"{key}.{ctx_error.key}: {ctx_error}" if key else f"{ctx_error.key}: {ctx_error}"
    if isinstance(ctx_error, Reference):
        return f"{ctx_error.key}: {ctx_error}"
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{key}: unknown key"
    if kind == "missing":
        return f"{key}: required key is missing"
    message = str(ctx_error) if ctx_error else err["msg"]
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "literal_error":
        message = f"{err['msg'].lower()} (got {err['input']!r})"
    message = message[:1].lower() + message[1:]
    return f"{key}: {message}" if key else message


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
