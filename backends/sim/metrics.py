"""The simulated worker's counters and its Prometheus text, in each engine's metric names."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.sim.cache import PrefixCache, cache_metric_lines


@dataclass
class Stats:
    """Counters shared by all requests; only touched from the event loop."""

    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})


# The engines' names for the Stats fields, in _METRIC_FIELDS order.
_METRIC_NAMES = {"vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting",
                          "vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
                 "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                            "sglang:prompt_tokens_total", "sglang:generation_tokens_total")}
_METRIC_FIELDS = (("running", "gauge", "Requests generating now."),
                  ("waiting", "gauge", "Requests waiting for a generation slot."),
                  ("prompt_tokens", "counter", "Prefill tokens processed."),
                  ("generation_tokens", "counter", "Generation tokens processed."))


def render_metrics(engine: str, model: str, stats: Stats, cache: PrefixCache | None = None) -> str:
    """Prometheus text with the engine's metric and label names."""
    labels = f'model_name="{model}"' if engine == "sglang" else f'engine="0",model_name="{model}"'
    lines: list[str] = []
    for name, (attr, kind, help_) in zip(_METRIC_NAMES[engine], _METRIC_FIELDS):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                  f"{name}{{{labels}}} {float(getattr(stats, attr))}"]
    if engine == "vllm":
        name = "vllm:request_success_total"
        lines += [f"# HELP {name} Count of successfully processed requests.",
                  f"# TYPE {name} counter"]
        lines += [f'{name}{{{labels},finished_reason="{r}"}} {float(n)}'
                  for r, n in stats.success.items()]
    if cache is not None:
        lines += cache_metric_lines(engine, labels, cache)
    return "\n".join(lines) + "\n"
