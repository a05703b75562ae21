"""Where the router keeps responses: the Store contract and its implementations."""

from __future__ import annotations

from pathlib import Path

from router.config import StoreConfig
from router.state.store import Store


def make_store(config: StoreConfig, base_dir: Path) -> Store:
    """The store ``config`` describes, not yet opened.

    A relative sqlite path is resolved against ``base_dir`` (the config
    file's folder) and its parent folder created; ":memory:" is kept as is.
    A postgres ``dsn_env`` naming an unset variable raises ConfigError.
    """
    if config.kind == "postgres":
        from router.state.postgres import PostgresStore  # asyncpg is needed only here

        return PostgresStore(config.resolved_dsn(), min_size=config.pool_min, max_size=config.pool_max,
                             retry_s=config.retry_s)
    from router.state.sqlite import SQLiteStore

    path = config.path
    if path != ":memory:":
        resolved = (base_dir / path).resolve()
        resolved.parent.mkdir(parents=True, exist_ok=True)
        path = str(resolved)
    return SQLiteStore(path)
