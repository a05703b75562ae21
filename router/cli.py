"""``responses-router --config cfg.toml``, ``responses-router sim ...`` and ``responses-router harmony-vocab DIR``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sqlite3
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from router.config import STOP_MARGIN_S, Config, ConfigError, load_config

if TYPE_CHECKING:
    import uvicorn


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from router.report import main as report_main

        report_main(argv[1:])
        return
    if argv[:1] == ["sim"]:
        from backends.sim import main as sim_main

        sim_main(argv[1:], prog="responses-router sim")
        return
    if argv[:1] == ["harmony-vocab"]:
        from router.dialects.harmony_vocab import main as vocab_main

        vocab_main(argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog="responses-router", description="The OpenAI Responses API over vLLM/SGLang pools.",
        epilog="other commands (each with its own --help):\n"
               "  responses-router sim ...             a simulated vLLM/SGLang worker\n"
               "  responses-router report --url URL    the per-arm comparison of a running router's /metrics\n"
               "  responses-router harmony-vocab DIR   build the o200k vocabulary for gpt-oss pools, offline",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--config", required=True, help="TOML config file (see config.example.toml)")
    parser.add_argument("--host", help="override [server].host")
    parser.add_argument("--port", type=int, help="override [server].port")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"responses-router: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from router.api import access

    access.configure(config.server.log_level, config.server.log_format, access_log=config.server.access_log)
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    _run(_serve(config, Path(args.config).resolve().parent, host, port))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("responses-router")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


class _StoppingServer(Protocol):
    """What ``_serve`` needs of the server class ``_server_class`` makes."""

    deadline: float | None

    async def serve(self) -> None: ...


def _server_class(grace_s: float, stop_timeout_s: float, on_stop: Any) -> Callable[[uvicorn.Config], _StoppingServer]:
    import uvicorn

    from router.turns.runner import STOPPING

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after serving, which would skip stopping the workers; handle it instead.

        A stop gives running requests ``grace_s`` (``on_stop`` gives background responses the same,
        at the same time); then the router stops them itself (their tasks cancelled with STOPPING):
        a stream ends with ``error`` + ``response.failed``, code ``router_stopped``, stored failed,
        and a create answers 503. uvicorn's own cancel, which cuts a stream with nothing said (and
        left it stored as if its client had left), comes STOP_MARGIN_S later, for what is still
        running then. ``deadline``: when the whole stop must be over (``stop_timeout_s`` after it began).
        """

        deadline: float | None = None
        _stop: asyncio.Event | None = None

        async def main_loop(self) -> None:
            """uvicorn's loop, one tick a second instead of ten: a tick only renews the Date header
            (once a second) and looks at ``should_exit``, and a stop wakes it at once (``handle_exit``).
            Ten idle wake-ups a second were most of an idle router's CPU (bench/RESULTS.md)."""
            self._stop = asyncio.Event()
            counter = 0
            while not await self.on_tick(counter):
                counter = (counter + 10) % 864000  # on_tick renews the Date header when counter % 10 == 0
                try:
                    await asyncio.wait_for(self._stop.wait(), 1.0)
                except TimeoutError:
                    pass

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self._stop is not None:
                self._stop.set()

        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            self.deadline = loop.time() + stop_timeout_s
            on_stop()
            timer = loop.call_later(grace_s, self._stop_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        def _stop_requests(self) -> None:
            for task in list(self.server_state.tasks):
                task.cancel(msg=STOPPING)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


# Young-generation collections start once this many more container objects are alive than at the last one.
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Keep the cyclic garbage collector off the request path, once start-up is done.

    Start-up leaves ~100k long-lived objects (modules, pydantic schemas, config);
    a full collection walks them all (40-75 ms here, one pause for every request
    in flight; one came in a 35 s benchmark). ``gc.freeze`` moves them out of
    every later collection. With CPython's default threshold (700), the objects
    one create or one batch of tokens holds for a moment set off a young
    collection every ~10 requests at c=32 (~0.4 ms each, ~1.5% of the router's
    CPU; bench/RESULTS.md); at 10,000 the same load set off one in a whole
    benchmark. Reference cycles are still collected, only later.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


async def _serve(config: Config, base_dir: Path, host: str, port: int) -> None:
    import uvicorn

    from backends.launcher import LaunchError
    from router.api.connections import ConnectionLimits, connection_cap
    from router.api.server import RouterHttpProtocol, RouterWebSocketProtocol, require_uvicorn
    from router.app import build

    grace_s = config.server.shutdown_grace_s
    try:
        require_uvicorn()
        router = build(config, base_dir)
    except (ConfigError, ValueError, OSError, RuntimeError) as exc:
        print(f"responses-router: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    _Server = _server_class(grace_s, config.server.stop_timeout_s, router.begin_stop)
    server = None
    log = logging.getLogger("router")
    try:
        try:
            await router.startup()
        except (LaunchError, OSError, RuntimeError, sqlite3.Error) as exc:
            print(f"responses-router: start-up failed: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        settle_heap()
        limits = ConnectionLimits(header_timeout_s=config.server.header_timeout_s,
                                  body_timeout_s=config.server.body_timeout_s,
                                  max_connections=connection_cap(config.server.max_connections))
        server = _Server(
            uvicorn.Config(
                # proxy_headers off: nothing here reads the client's address, and it is one ASGI layer per request
                router.app, host=host, port=port, http=RouterHttpProtocol.with_limits(limits), ws=RouterWebSocketProtocol, lifespan="off",
                access_log=False,  # the router writes its own (router/api/access.py)
                log_config=None,  # uvicorn's lines go through the router's logging, in its format
                proxy_headers=False,
                timeout_keep_alive=config.server.keep_alive_s,  # type: ignore[arg-type]  # a float, as above
                headers=[("keep-alive", f"timeout={int(config.server.keep_alive_s)}")],  # in every answer's head
                # uvicorn annotates int, but the value is asyncio.wait_for's timeout: a float is what it takes
                log_level=config.server.log_level, timeout_graceful_shutdown=grace_s + STOP_MARGIN_S,  # type: ignore[arg-type]
            )
        )
        log.info("serving models %s on http://%s:%d/v1 (at most %d connections)",
                 ", ".join(m.name for m in config.models), host, port, limits.max_connections)
        await server.serve()
    finally:
        await router.shutdown(server.deadline if server is not None else None)
