"""API keys: who is calling, as the owner name that scopes stored state."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import HTTPConnection

from router.api import access
from router.protocol.errors import Unauthorized

ANONYMOUS = ""


class Authenticator:
    def __init__(self, digests: dict[str, str]) -> None:
        """``digests`` maps each key's sha256 (hex) to its owner name; empty means no authentication.

        Only digests are held, so a config may list hashed keys and a memory dump shows no key.
        """
        self._keys = digests

    def owner(self, request: HTTPConnection) -> str:
        """The owner of an HTTP request or a WebSocket handshake (only the headers are read)."""
        return self.owner_of(request.scope["headers"])

    def owner_of(self, headers: list[tuple[bytes, bytes]]) -> str:
        """The owner named by the ``Authorization`` header of raw (ASGI-spelled) headers."""
        if not self._keys:
            return ANONYMOUS
        header = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
        digest = hashlib.sha256(token.strip().encode()).hexdigest().encode()
        # Compare against every digest in constant time so timing does not leak which one matched.
        found = ANONYMOUS
        for key, name in self._keys.items():
            if hmac.compare_digest(key.encode(), digest):
                found = name
        if not found:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        record = access.current()
        if record is not None:
            record.key = found  # the key's name, for the access line
        return found
