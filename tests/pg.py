"""A throwaway PostgreSQL database for tests, on a real server.

The server is named by ``RESPONSES_ROUTER_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); the session fixture
``pg_dsn`` creates a database with a unique name there, yields its DSN and
drops it at the end. An unreachable server FAILS the tests that need it
(never skips): ``.ci/run`` makes sure one is running.

Use it from a test module with ``from tests.pg import pg_dsn``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

ENV = "RESPONSES_ROUTER_TEST_PG"
DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_dsn() -> str:
    return os.environ.get(ENV) or DEFAULT


def with_database(dsn: str, name: str) -> str:
    """``dsn`` pointing at database ``name`` instead (query string kept)."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


def redacted(dsn: str) -> str:
    """``dsn`` without its password, fit for a message."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


async def _admin(dsn: str, statement: str) -> None:
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError) as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {redacted(dsn)} ({type(exc).__name__}: {exc}). These tests need a real "
            f"server: start one (.ci/run does) or point {ENV} at one.",
            pytrace=False,
        )
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def create_database(dsn: str, prefix: str = "rr_test") -> str:
    """Create a database with a unique name on the server of ``dsn``; returns its DSN."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(dsn, f'CREATE DATABASE "{name}"'))
    return with_database(dsn, name)


def drop_database(dsn: str, db_dsn: str) -> None:
    name = urlsplit(db_dsn).path.lstrip("/")
    asyncio.run(_admin(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """The DSN of a fresh database, dropped when the session ends."""
    server = server_dsn()
    db = create_database(server)
    try:
        yield db
    finally:
        drop_database(server, db)


def fresh_schema(db_dsn: str, prefix: str = "t") -> str:
    """Create an empty schema in the database of ``db_dsn``; returns a DSN whose
    connections use it (``search_path``), so each test starts from nothing."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(db_dsn, f'CREATE SCHEMA "{name}"'))
    parts = urlsplit(db_dsn)
    query = "&".join(q for q in (parts.query, f"search_path={name}") if q)
    return urlunsplit(parts._replace(query=query))
