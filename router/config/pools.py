"""``[[pools]]``: a pool of workers of one engine, attached (``urls``) or managed (``[pools.managed]``),
and how its engine's chat template takes the router's messages (``[pools.chat]``)."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, Strict, model_validator

from router.config.base import FieldReference, Section


class ManagedConfig(Section):
    replicas: int = Field(default=1, ge=1, le=64)
    # A port range [first, last]; replica i listens on first + i.
    port_range: Annotated[tuple[int, int], Strict(False)] = (18100, 18199)  # a TOML array: [first, last]
    # Command template; {port}, {host} and {model} are filled in. Empty: the engine's default.
    command: list[str] = []
    extra_args: list[str] = []
    env: dict[str, str] = {}
    # GPUs split evenly between the replicas: replica i gets its share as CUDA_VISIBLE_DEVICES.
    gpus: list[int] = []
    # Per-worker log files go here (relative to the config file); empty: inherit the router's stderr.
    log_dir: str = ""
    start_timeout_s: float = Field(default=120.0, gt=0)
    stop_timeout_s: float = Field(default=10.0, gt=0)
    # The interpreter of the command's {python} (the engine's module runs on it); empty: the router's own.
    python: str = ""
    # Append the flags the pool's config implies (docs/configuration.md, "Managed pools"); unset: only to the
    # engine's default command, not to a command of your own.
    derive_flags: bool | None = None
    # The engine's parsers of the model's tool calls and reasoning (vLLM and SGLang --tool-call-parser,
    # --reasoning-parser; vLLM also gets --enable-auto-tool-choice).
    tool_call_parser: str | None = Field(default=None, min_length=1)
    reasoning_parser: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _ports(self) -> ManagedConfig:
        first, last = self.port_range
        if not (0 < first <= last <= 65535):
            raise ValueError("port_range must be [first, last] with 0 < first <= last <= 65535")
        if last - first + 1 < self.replicas:
            raise ValueError(f"port_range holds {last - first + 1} ports for {self.replicas} replicas")
        if self.gpus and len(self.gpus) % self.replicas:
            raise ValueError(f"{len(self.gpus)} gpus do not split evenly between {self.replicas} replicas")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError("a gpu is listed twice")
        return self

    def replica_env(self, i: int) -> dict[str, str]:
        """Replica ``i``'s environment: the configured env, plus its share of the GPUs."""
        env = dict(self.env)
        if self.gpus:
            share = len(self.gpus) // self.replicas
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus[i * share:(i + 1) * share])
        return env


class ChatConfig(Section):
    """What a chat pool's engine and chat template accept (see router/dialects/chat.py)."""

    system_messages: Literal["merge", "keep"] = "merge"
    reasoning_field: Literal["reasoning_content", "reasoning"] | None = None
    think_tags: bool = False
    reasoning_effort_as: Literal["reasoning_effort", "enable_thinking", "thinking", "drop"] = "reasoning_effort"
    accepts_files: bool = False
    # input_image / input_file URLs are fetched by the ENGINE, not the router (no NetGuard there):
    # "data_only" refuses any but data: URLs (400) for engines that can reach internal addresses.
    media_urls: Literal["any", "data_only"] = "any"


class KVEventsConfig(Section):
    """The pool's prefix index, fed by its engines' KV-cache events (backends/kv_feed.py)."""

    # Subscribe to every worker's events. A managed pool's engines are started publishing them
    # (--kv-events-config, on a socket of the router's own); external ones must be.
    enabled: bool = False
    # External workers: each one's event endpoint ("tcp://host:port") and replay endpoint, in the
    # order of urls; unset: asked of each worker (vLLM's GET /kv_event_sources).
    endpoints: list[str] | None = None
    replay_endpoints: list[str] | None = None
    topic: str = "kv"
    # Indexed (worker, block) entries at most; the oldest go first.
    max_blocks: int = Field(default=1_000_000, ge=1, le=100_000_000)
    # policy = "kv_aware" (policies/kv_aware.py): cost = prompt tokens not cached / tokens_per_request
    # + load, among the workers within window (in requests) of the least loaded; a prompt just routed
    # counts as cached on its worker for speculative_s.
    tokens_per_request: float = Field(default=1024.0, gt=0)
    window: float = Field(default=4.0, ge=0)
    speculative_s: float = Field(default=2.0, ge=0, le=60)


class PoolConfig(Section):
    name: str = Field(min_length=1)
    engine: Literal["vllm", "sglang", "sim"]
    # chat: chat completions; harmony: the router renders gpt-oss prompts and calls token-level generate.
    dialect: Literal["chat", "harmony"] = "chat"
    # The model name the workers serve (what goes in the upstream "model" field).
    model: str = Field(min_length=1)
    urls: list[str] = []
    managed: ManagedConfig | None = None
    chat: ChatConfig = ChatConfig()
    # The model's context window; empty: read from the workers' /v1/models (max_model_len).
    context_length: int | None = Field(default=None, gt=0)
    # affinity: a continuation goes back to the worker that served its previous turn (its KV prefix),
    # a new conversation to a worker chosen by a hash of its prefix, unless that worker is down or
    # loaded above overload_factor x the pool's mean; then least load.
    # kv_aware: where the prompt's prefix is cached, weighed against load ([pools.kv_events]).
    policy: Literal["round_robin", "least_in_flight", "least_load", "power_of_two", "affinity", "kv_aware"] = "least_in_flight"
    overload_factor: float = Field(default=1.5, ge=1)
    health_interval_s: float = Field(default=2.0, gt=0)
    # Read each worker's queue length from its /metrics with every health check, so that
    # least_load / power_of_two / affinity see requests waiting inside the engine.
    scrape_metrics: bool = False
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # Longest silence allowed between two reads of a worker's answer.
    read_timeout_s: float = Field(default=300.0, gt=0)
    # A streamed answer's first byte (its first token) must come this soon after the call
    # (prefill and the engine's queue included); None: only read_timeout_s applies.
    first_byte_timeout_s: float | None = Field(default=60.0, gt=0)
    # A worker answer read whole, and one frame of a stream, are cut off past these sizes (502 /
    # failed): a broken or hostile worker cannot make the router buffer without end.
    max_answer_bytes: int = Field(default=64 << 20, ge=1024)
    max_frame_bytes: int = Field(default=8 << 20, ge=1024)
    # https workers: the CA bundle (PEM) their certificates are checked against (empty: the system's
    # trust store), and the router's own client certificate and key when the workers ask for one.
    # Relative to the config file. Every call to the pool's workers (model calls, health checks,
    # scrapes) uses them.
    tls_ca_file: str | None = Field(default=None, min_length=1)
    tls_cert_file: str | None = Field(default=None, min_length=1)
    tls_key_file: str | None = Field(default=None, min_length=1)
    # The pool honours service_tier: its engine schedules by request priority (a managed engine
    # is started so: vLLM --scheduling-policy priority, SGLang --enable-priority-scheduling).
    honor_service_tier: bool = False
    # When the pool is saturated: every healthy worker has this many calls in flight, or its
    # engine this many requests waiting (scraped: scrape_metrics). Requests then wait in the
    # router's fair queue ([limits.queue]). Neither set: never saturated, no queue.
    max_in_flight_per_worker: int | None = Field(default=None, ge=1)
    max_engine_waiting: float | None = Field(default=None, ge=0)
    kv_events: KVEventsConfig = KVEventsConfig()

    @model_validator(mode="after")
    def _workers(self) -> PoolConfig:
        if bool(self.urls) == (self.managed is not None):
            raise ValueError("give exactly one of urls or [pools.managed]")
        for i, url in enumerate(self.urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url {url!r} must start with http:// or https://")
            try:
                parts = urlsplit(url)
                parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
            except ValueError as exc:
                raise FieldReference(f"urls[{i}]", f"{url!r}: {exc}") from None
            if not parts.hostname:
                raise FieldReference(f"urls[{i}]", f"{url!r} names no host")
        events = self.kv_events
        if self.policy == "kv_aware" and not events.enabled:
            raise FieldReference("policy", "kv_aware reads the workers' KV events: set [pools.kv_events] enabled = true")
        for key in ("endpoints", "replay_endpoints"):
            given = getattr(events, key)
            if given is not None and (self.managed is not None or len(given) != len(self.urls)):
                raise FieldReference(f"kv_events.{key}", "one per url, for external workers (a managed pool's are the router's)")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise FieldReference("tls_key_file", "a client key needs its certificate: set tls_cert_file too")
        tls = next((k for k in ("tls_ca_file", "tls_cert_file") if getattr(self, k) is not None), None)
        if tls is not None and not any(url.startswith("https://") for url in self.urls):
            where = "a managed pool's workers are reached over http" if self.managed else "no url of the pool is https://"
            raise FieldReference(tls, f"TLS settings are for https workers, and {where}")
        managed = self.managed
        if managed is not None and self.engine == "sim":
            for key in ("tool_call_parser", "reasoning_parser"):
                if getattr(managed, key) is not None:
                    raise FieldReference(f"managed.{key}", "the sim engine has no parsers (vllm and sglang do)")
        return self
