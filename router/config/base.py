"""What every config section shares: strict parsing (no coercion, no unknown key) and the errors
that name the key they are about."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # strict: a quoted number (port = "8081") or a quoted boolean is a type error, not coerced.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Reference(ValueError):
    """A reference error that knows the exact key it is about."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class FieldReference(Reference):
    """A reference error about a key of the section that raised it (its place is prefixed)."""
