"""A public model name resolved to where and how it is served."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from backends.pools import Pool
from router.dialects.chat import ChatOptions, ChatTurn, tier_priority
from router.dialects.turn import DialectTurn
from router.protocol.requests import CreateResponse
from router.protocol.tools import ToolSet


@dataclass(frozen=True, slots=True)
class ModelRoute:
    model: str  # the public name clients send
    pool: Pool
    dialect: Literal["chat", "harmony"] = "chat"
    chat: ChatOptions = field(default_factory=ChatOptions)
    harmony: Any = None  # the HarmonyEncoding, for harmony pools

    def turn(self, req: CreateResponse, tools: ToolSet, request_id: str) -> DialectTurn:
        """The dialect's per-response state for one request."""
        if self.dialect == "harmony":
            from router.dialects.harmony_turn import HarmonyTurn

            return HarmonyTurn(req, tools, self.harmony, engine=self.pool.engine.name,
                               context_length=self.pool.max_model_len, request_id=request_id, model=self.pool.model,
                               use_completions=self.pool.no_generate, priority=self.tier_priority(req.service_tier))
        return ChatTurn(req, tools, self.chat, model=self.pool.model, path=self.pool.engine.chat_path,
                        context_length=self.pool.max_model_len)

    def tier_priority(self, service_tier: str | None) -> int | None:
        """The engine priority ``service_tier`` runs at on this pool (None: the default one)."""
        return tier_priority(service_tier, self.chat.honor_service_tier, self.pool.engine.name)
