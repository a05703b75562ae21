"""API keys: who is calling, as the owner name that scopes stored state."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from router.protocol.errors import Unauthorized

ANONYMOUS = ""


class Authenticator:
    def __init__(self, keys: dict[str, str]) -> None:
        """``keys`` maps each secret key to its owner name; empty means no authentication."""
        self._keys = keys

    def owner(self, request: Request) -> str:
        if not self._keys:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
        token = token.strip()
        # Compare against every key in constant time so timing does not leak which prefix matched.
        found = ANONYMOUS
        for key, name in self._keys.items():
            if hmac.compare_digest(key.encode(), token.encode()):
                found = name
        if not found:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return found
