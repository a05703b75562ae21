"""Where a response was served (pool, arm, worker): recorded, owner-scoped, deleted with it. On every store."""

from __future__ import annotations

from typing import Any

from tests.support import store_fixtures
from tests.support.store_fixtures import Backend, resp

backend, pg, pg_dsn, sqlite_db = store_fixtures.backend, store_fixtures.pg, store_fixtures.pg_dsn, store_fixtures.sqlite_db


def test_routing_is_recorded_scoped_and_deleted(backend: Backend) -> None:
    async def body(s: Any) -> None:
        await s.put_response(resp("r"))
        assert await s.get_routing("r", "alice") is None
        await s.set_routing("r", {"pool": "a", "arm": "a", "worker": "http://w1"})
        await s.set_routing("r", {"pool": "b", "arm": "b", "worker": "http://w2"})  # last write wins
        assert await s.get_routing("r", "alice") == {"pool": "b", "arm": "b", "worker": "http://w2"}
        assert await s.get_routing("r", "bob") is None
        await s.set_routing("missing", {"pool": "a"})  # no stored response: nothing recorded, no error
        assert await s.get_routing("missing", "alice") is None
        await s.put_response(resp("r", outputs=[]))  # re-putting keeps it
        assert (await s.get_routing("r", "alice"))["pool"] == "b"
        assert await s.delete_response("r", "alice")

    backend.run(body)
    assert backend.raw_count("response_routing") == 0  # deleted with its response
