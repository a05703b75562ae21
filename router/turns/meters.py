"""What a response's stages record into the metrics, as the seam they see: the router's metric
families (router/metrics/families.py ``RouterMetrics`` and its ``RequestTimer``) satisfy these.

``router/turns`` does not import ``router/metrics`` (docs/ARCHITECTURE.md, "Layers"): the start-up
hands the families in, typed here by what is called on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class Timer(Protocol):
    """One response's timings and its end, into its model's, arm's and pool's series."""

    def first_token(self) -> None: ...

    def token(self, n: int = 1) -> None: ...

    def error(self, kind: str) -> None: ...

    def finish(self, status: str, usage: Mapping[str, Any] | None = None) -> None: ...


class Meters(Protocol):
    """The metric families a response's stages record into."""

    def timer(self, model: str, arm: str, pool: str) -> Timer: ...

    def failover(self, model: str, from_arm: str, to_arm: str) -> None: ...

    def tool_call(self, tool: str, seconds: float, error: bool) -> None: ...

    def shadow(self, model: str, pool: str, outcome: str, seconds: float | None = None,
               output_tokens: int | None = None, differences: Iterable[str] = ()) -> None: ...
