"""``include`` on what the API reads back: a stored response, a response's input items, a
conversation's items. The query's values are checked as a create's are, and each item is shown as
they ask (router/protocol/shapes.py: an input image's URL, a code interpreter's outputs and a
search's sources only when named), reasoning with its ``encrypted_content`` when asked, sealed now
for the key that reads it (the reasoning is stored; a create with it would have given it)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from router.protocol.requests import check_include
from router.protocol.sealing import Sealer, seal_reasoning
from router.protocol.shapes import input_item_view, item_view

Item = dict[str, Any]


def include_query(request: Request) -> frozenset[str]:
    """A query's ``include`` values (``include[]=...`` as the SDKs send them, or ``include=...``, each
    repeatable), checked: a 400 naming the first one unknown or not served here."""
    return check_include(request.query_params.getlist("include[]") + request.query_params.getlist("include"))


def seal(items: list[Item], include: frozenset[str], sealer: Sealer | None, owner: str) -> None:
    """Reasoning items get ``encrypted_content`` when ``include`` names it (in place: stored items,
    freshly read)."""
    if "reasoning.encrypted_content" not in include or sealer is None:
        return
    for item in items:
        if item.get("type") == "reasoning" and not item.get("encrypted_content"):
            text = "".join(part.get("text", "") for part in item.get("content") or ())
            item["encrypted_content"] = seal_reasoning(sealer, owner, text)


def shown_items(items: list[Item], include: frozenset[str], sealer: Sealer | None, owner: str) -> list[Item]:
    """Stored items as a listing shows them to ``owner``."""
    seal(items, include, sealer, owner)
    return [item_view(input_item_view(item, include), include) for item in items]
