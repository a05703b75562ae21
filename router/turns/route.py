"""A public model name resolved to where and how it is served."""

from __future__ import annotations

from dataclasses import dataclass

from backends.pools import Pool
from router.dialects.chat import ChatOptions


@dataclass(frozen=True, slots=True)
class ModelRoute:
    model: str  # the public name clients send
    pool: Pool
    chat: ChatOptions
