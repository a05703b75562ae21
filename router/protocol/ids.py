"""Ids in OpenAI's style: a prefix and random hex, unique across replicas."""

from __future__ import annotations

import os


def new_id(prefix: str) -> str:
    # 24 random bytes: collisions are not a concern even across many replicas.
    return f"{prefix}_{os.urandom(24).hex()}"


def response_id() -> str:
    return new_id("resp")


def message_id() -> str:
    return new_id("msg")
