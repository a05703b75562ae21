"""Managed workers: spawn engine processes, wait until ready, stop them.

No orphans: each worker gets PR_SET_PDEATHSIG, so it is signalled even when
the router is SIGKILLed, and runs in its own process group, so stopping it
also stops the helper processes an engine forks.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson

from backends.client import WorkerClient, WorkerUnavailable
from backends.engines import ENGINES, launch_command

log = logging.getLogger("router.launcher")

_PR_SET_PDEATHSIG = 1


class LaunchError(Exception):
    """A managed worker did not become ready; the message says which and why."""


@dataclass(slots=True)
class WorkerSpec:
    engine: str
    model: str
    command: list[str]  # a template; empty: the engine's default
    extra_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None


# A worker up this long is stable: a crash after that starts the backoff over.
STABLE_S = 60.0


@dataclass(eq=False)
class ManagedWorker:
    spec: WorkerSpec
    port: int
    label: str
    process: asyncio.subprocess.Process | None = None
    _log_file: IO[bytes] | None = None
    _watch: asyncio.Task[None] | None = None
    stopping: bool = False
    # After the first start succeeded, a crash is followed by a restart with exponential backoff.
    supervised: bool = False
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    restarts: int = 0
    crashes_in_a_row: int = 0
    state: str = "starting"  # starting | ready | backoff | stopped
    last_exit_code: int | None = None
    _started_at: float = 0.0
    _client: WorkerClient | None = None
    _start_timeout_s: float = 120.0

    @property
    def crash_looping(self) -> bool:
        """Three crashes in a row, and not up for STABLE_S since: one that stays up is out of the loop
        (the count itself starts over only at its next crash, for the backoff)."""
        if self.crashes_in_a_row < 3:
            return False
        return not (self.state == "ready" and time.monotonic() - self._started_at > STABLE_S)

    def describe(self) -> dict[str, object]:
        """For /health: what the supervisor knows about the process."""
        return {
            "pid": self.process.pid if self.process else None,
            "state": self.state,
            "restarts": self.restarts,
            "crash_loop": self.crash_looping,
            "last_exit_code": self.last_exit_code,
        }

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    async def spawn(self, on_exit: Callable[[ManagedWorker, int], None]) -> None:
        argv = launch_command(self.spec.engine, self.spec.command, host=self.spec.host, port=self.port,
                              model=self.spec.model, extra=self.spec.extra_args)
        out = None
        if self._log_file is not None:
            self._log_file.close()
        if self.spec.log_path is not None:
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = out = open(self.spec.log_path, "ab")  # noqa: ASYNC230 - a local file, once per start
        self.process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out if out is not None else asyncio.subprocess.DEVNULL,
            stderr=out if out is not None else None,
            env={**os.environ, **self.spec.env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.info("%s: starting on %s (pid %d): %s", self.label, self.url, self.process.pid, " ".join(argv))
        self._started_at = time.monotonic()
        self._watch = asyncio.create_task(self._wait(on_exit))

    async def _wait(self, on_exit: Callable[[ManagedWorker, int], None]) -> None:
        assert self.process is not None
        code = await self.process.wait()
        if self.stopping:
            return
        self.last_exit_code = code
        log.error("%s: exited with code %s", self.label, code)
        on_exit(self, code)
        if not self.supervised:
            return  # still starting: start_workers reports the failure
        # A worker that ran for a while before dying is not in a crash loop: start the backoff over.
        self.crashes_in_a_row = 1 if time.monotonic() - self._started_at > STABLE_S else self.crashes_in_a_row + 1
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (self.crashes_in_a_row - 1))
        self.state = "backoff"
        if self.crashes_in_a_row >= 3:
            log.error("%s: crash loop (%d crashes in a row); next restart in %.0f s", self.label, self.crashes_in_a_row, delay)
        await asyncio.sleep(delay)
        if self.stopping:
            return
        self.restarts += 1
        self.state = "starting"
        await self.spawn(on_exit)
        if self._client is not None:
            try:
                await self.wait_ready(self._client, self._start_timeout_s)
            except LaunchError as exc:  # the new process's own watcher handles its exit
                log.error("%s", exc)

    async def wait_ready(self, client: WorkerClient, timeout_s: float) -> None:
        """Ready = health answers 200 AND the served model is listed."""
        engine = ENGINES[self.spec.engine]
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.returncode is not None:
                raise LaunchError(f"{self.label}: exited with code {self.process.returncode} while starting{self._log_hint()}")
            try:
                status, _ = await client.get(self.url + engine.health_path)
                if status == 200:
                    status, body = await client.get(self.url + engine.models_path)
                    if status == 200 and self.spec.model in _model_ids(body):
                        log.info("%s: ready after %.1f s", self.label, time.monotonic() - started)
                        self.state = "ready"
                        return
            except WorkerUnavailable:
                pass
            await asyncio.sleep(0.1)
        raise LaunchError(f"{self.label}: not ready after {timeout_s:.0f} s{self._log_hint()}")

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``."""
        self.stopping = True
        self.state = "stopped"
        proc = self.process
        if proc is not None and proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                log.warning("%s: no exit %.0f s after SIGTERM, killing", self.label, timeout_s)
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        if self._watch is not None:
            self._watch.cancel()
        if self._log_file is not None:
            self._log_file.close()

    def _log_hint(self) -> str:
        return f" (log: {self.spec.log_path})" if self.spec.log_path else ""


async def start_workers(
    specs: list[WorkerSpec], ports: list[int], client: WorkerClient, *, label: str, timeout_s: float,
    on_exit: Callable[[ManagedWorker, int], None],
) -> list[ManagedWorker]:
    """Spawn every worker and wait until all are ready; on failure, stop them all."""
    workers = [ManagedWorker(spec, port, f"{label} worker {i + 1}/{len(specs)}") for i, (spec, port) in enumerate(zip(specs, ports))]
    try:
        for worker in workers:
            await worker.spawn(on_exit)
        await asyncio.gather(*(w.wait_ready(client, timeout_s) for w in workers))
        for worker in workers:
            worker.supervised = True
            worker._client = client
            worker._start_timeout_s = timeout_s
    except BaseException:
        await asyncio.gather(*(w.stop(2.0) for w in workers), return_exceptions=True)
        raise
    return workers


def free_ports(first: int, last: int, count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` ports of [first, last] that nothing listens on now."""
    ports: list[int] = []
    for port in range(first, last + 1):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise LaunchError(f"only {len(ports)} free ports in {first}-{last}, {count} needed")


def _model_ids(body: bytes) -> list[str]:
    try:
        return [m.get("id") for m in orjson.loads(body).get("data", [])]
    except (orjson.JSONDecodeError, AttributeError):
        return []


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """Runs in the child before exec: signal it when the router dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: shutdown still stops workers, only SIGKILL of the router can orphan them
