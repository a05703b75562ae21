"""A throwaway PostgreSQL database for tests, on a real server.

The server is named by ``RESPONSES_ROUTER_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); the session fixture
``pg_dsn`` creates a database with a unique name there, yields its DSN and
drops it at the end. An unreachable server FAILS the tests that need it
(never skips): ``.ci/run`` makes sure one is running.

Use it from a test module with ``from tests.support.pg import pg_dsn``.

``pg_server`` is a server of the test's own instead (``PgServer``: initdb into
a fresh folder, its own port), for tests that stop and restart it under a
running router; it needs PostgreSQL's server binaries (.ci/run installs them).
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
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
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
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


class PgServer:
    """A PostgreSQL server of the test's own, on its own port, that the test stops, starts and
    restarts (initdb into a fresh folder, pg_ctl). Unlike the shared server of ``pg_dsn``, this
    one can go away under a running router.

    PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user (the
    folder is made outside pytest's root-only tmp folder, and removed by ``remove``).
    """

    def __init__(self) -> None:
        from harness import free_port

        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
        initdb = shutil.which("initdb") or (bins[-1] if bins else None)
        if initdb is None:
            pytest.fail("PostgreSQL's server binaries (initdb, pg_ctl) are not installed: .ci/run installs them",
                        pytrace=False)
        self.bindir = Path(initdb).parent
        self.as_user = "postgres" if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="rr-pg-"))
        self.data = self.dir / "data"
        if self.as_user is not None:
            shutil.chown(self.dir, self.as_user)
        self.port = free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        try:
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bindir / tool), *args]
        if self.as_user is not None:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def _ctl(self, action: str, *args: str) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", action, "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60",
                  "-o", options, *args)

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        """Fast shutdown: sessions are ended (their clients see the connection go), then the server exits."""
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "60")

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: down and up again, well under a second on an idle machine."""
        self._ctl("restart", "-m", "fast")

    def remove(self) -> None:
        """Stop the server (when it runs) and remove its folder."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60")
        shutil.rmtree(self.dir, ignore_errors=True)


def _version(path: str) -> tuple[int, ...]:
    """/usr/lib/postgresql/15/bin/initdb -> (15,): the newest server's binaries sort last."""
    return tuple(int(part) for part in Path(path).parts[-3].split(".") if part.isdigit())


@pytest.fixture
def pg_server() -> Iterator[PgServer]:
    """A running PostgreSQL server of this test's own (see PgServer); gone after the test."""
    server = PgServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()
