"""Managed workers: spawn engine processes, wait until ready, stop them; and what any pool's workers say they serve.

No orphans: each worker gets PR_SET_PDEATHSIG, so it is signalled even when
the router is SIGKILLed, and runs in its own process group, so stopping it
also stops the helper processes an engine forks.

A managed worker's command line is the engine's (backends/engines.py
``launch_command``): the flags its pool's config implies are derived there.
``check_pool`` asks a pool's workers, managed or attached, what they serve
(their model list, context length, the generate endpoint a harmony pool
needs) and says in one line what it found and what will not work.
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

from backends.client import WorkerClient, WorkerError, WorkerUnavailable
from backends.engines import ENGINES, GENERATE_PATH, Engine, LaunchOptions, launch_command

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
    options: LaunchOptions = field(default_factory=LaunchOptions)  # what the pool's config implies


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

    def argv(self) -> list[str]:
        """The command line it is started with."""
        spec = self.spec
        return launch_command(spec.engine, spec.command, host=spec.host, port=self.port, model=spec.model,
                              extra=spec.extra_args, options=spec.options)

    async def spawn(self, on_exit: Callable[[ManagedWorker, int], None]) -> None:
        argv = self.argv()
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


# -- what the workers say they serve (start-up) ------------------------------------------


@dataclass(slots=True)
class WorkerFindings:
    """What one worker answered: ``error`` when it could not be asked at all."""

    url: str
    error: str | None = None
    models: list[str] = field(default_factory=list)
    max_model_len: int | None = None
    generate: bool | None = None  # harmony pools: whether the token-level generate endpoint exists


CHECK_TIMEOUT_S = 5.0


async def check_worker(client: WorkerClient, engine: Engine, url: str, model: str, *, harmony: bool) -> WorkerFindings:
    """Ask one worker its model list (the model's ``max_model_len``) and, for a harmony pool,
    whether its generate endpoint exists: a POST of an empty body, which an existing endpoint
    refuses as malformed (400/422) and a missing one answers 404/405. Nothing is generated."""
    found = WorkerFindings(url)
    try:
        status, body = await client.get(url + engine.models_path, timeout_s=CHECK_TIMEOUT_S)
    except WorkerUnavailable as exc:
        found.error = str(exc)
        return found
    if status != 200:
        found.error = f"{engine.models_path} answered {status}"
        return found
    try:
        entries = orjson.loads(body).get("data") or []
    except (orjson.JSONDecodeError, AttributeError):
        entries = []
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            found.models.append(entry["id"])
            if entry["id"] == model and isinstance(entry.get("max_model_len"), int):
                found.max_model_len = entry["max_model_len"]
    if harmony:
        path = GENERATE_PATH[engine.name]
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                conn = await client.wire.post(url + path, b"{}", whole=True)
                await conn.read()
            found.generate = conn.status not in (404, 405)
        except WorkerError as exc:
            found.error = f"POST {path}: {exc}"
        except TimeoutError:
            found.error = f"POST {path}: no answer within {CHECK_TIMEOUT_S:g} s"
    return found


async def check_pool(client: WorkerClient, engine: Engine, model: str, urls: list[str], *, harmony: bool,
                     context_length: int | None) -> tuple[str, bool, list[WorkerFindings]]:
    """Every worker of a pool asked (``check_worker``): one line saying what was found and what will
    not work, whether everything will, and the findings."""
    found = list(await asyncio.gather(*(check_worker(client, engine, url, model, harmony=harmony) for url in urls)))
    answered = [f for f in found if f.error is None]
    listing = [f for f in answered if model in f.models]
    facts = [f"{len(answered)}/{len(found)} workers answer"]
    if answered:
        facts.append(f"model {model!r} listed by {len(listing)}/{len(answered)}")
    lengths = sorted({f.max_model_len for f in listing if f.max_model_len is not None})
    if lengths:
        facts.append("max_model_len " + "/".join(str(n) for n in lengths))
    if harmony and answered:
        facts.append(f"generate endpoint on {sum(bool(f.generate) for f in answered)}/{len(answered)}")
    problems: list[str] = []
    for f in found:
        if f.error is not None:
            problems.append(f"{f.url} cannot be asked ({f.error}): it takes no calls until its health check passes")
        elif model not in f.models:
            serves = ", ".join(repr(m) for m in f.models) or "nothing"
            problems.append(f"{f.url} does not list {model!r} (it serves {serves}): its calls will fail")
        elif harmony and f.generate is False:
            problems.append(f"{f.url} has no {GENERATE_PATH[engine.name]}"
                            + (" (vLLM needs --enable-scale-out)" if engine.name == "vllm" else "")
                            + ": harmony calls go to /v1/completions instead")
    if len(lengths) > 1:
        problems.append(f"the workers disagree on max_model_len ({', '.join(map(str, lengths))})")
    if context_length is not None and lengths and context_length > lengths[0]:
        problems.append(f"context_length {context_length} is above the workers' max_model_len {lengths[0]}: "
                        "prompts that fit the one and not the other are refused by the engine")
    line = "; ".join(facts) + ("; will not work: " + "; ".join(problems) if problems else "; nothing missing")
    return line, not problems, found
