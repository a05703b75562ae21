"""The simulated worker's settings (backends/sim/cli.py parses them from its command line)."""

from __future__ import annotations

from dataclasses import dataclass

from backends.sim.cache import BLOCK_TOKENS


@dataclass(frozen=True)
class SimConfig:
    engine: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    max_concurrency: int = 64
    max_model_len: int = 4096
    default_tokens: int = 12
    reasoning_field: str | None = None
    dialect: str = "chat"  # harmony: gpt-oss token-level generate APIs (backends/sim/harmony.py)
    harmony_vocab_dir: str | None = None
    incremental_streaming_output: bool = False  # SGLang's flag: /generate streams deltas
    no_scale_out: bool = False  # vLLM without --enable-scale-out: no /inference/v1/generate
    kv_cache_blocks: int = 0  # prefix cache capacity in blocks; 0: no prefix cache
    kv_block_size: int = BLOCK_TOKENS
    prefill_us_per_token: float = 0.0  # added to the time to first token per uncached prompt token
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON: publish the cache's events
    kv_events_encoding: str = "map"  # each event a map tagged by type (vLLM 0.32), or an array (older)
    tokenize: bool = False  # serve vLLM's POST /tokenize (chat messages -> the ids the prefix cache keys)

    @property
    def reasoning_key(self) -> str:
        """vLLM renamed reasoning_content to reasoning (vllm#27752) and removed
        the old name (vllm#33402, early 2026), so 0.32 sends `reasoning`;
        SGLang's DeltaMessage/ChatMessage use `reasoning_content`."""
        if self.reasoning_field:
            return self.reasoning_field
        return "reasoning_content" if self.engine == "sglang" else "reasoning"
