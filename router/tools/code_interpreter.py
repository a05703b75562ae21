"""Backend of the ``code_interpreter`` tool: model-written Python in a sandboxed subprocess.

Model code is hostile, so every run is set up in the forked child before exec
(``_sandbox_preexec``), and any failure there means the code does not run:

- new network namespace: only a downed loopback, so neither the host's loopback nor
  the internet is reachable. No namespace, no run; never a fallback.
- new PID namespace whose PID 1 is the program (it dies with the launcher through
  PDEATHSIG): when it ends, the kernel kills all it left, even ``setsid()`` escapees,
  and nothing in it can see or signal the router.
- an unprivileged uid per container (the router runs as root): no capabilities (no
  ``setns`` back to the host network, no writing root's files, no reading other
  containers' folders), and RLIMIT_NPROC counts, which it never does for root.
- rlimits AS, CPU, FSIZE, NPROC, NOFILE, CORE=0; ``python -I -S -u``; a minimal env;
  cwd = the container folder; code on stdin, which then stays at EOF; bounded output;
  a wall-clock timeout that SIGKILLs the process group.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import hashlib
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CodeInterpreter", "CodeResult", "SandboxLimits"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UID_BASE, _UID_SPAN = 1 << 30, 1 << 30  # far above real users and common subuid ranges
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_IMAGES, MAX_IMAGE_BYTES, MAX_SCAN_ENTRIES = 8, 4 << 20, 20_000
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child must not import or load

# The exec'd child is outside the new PID namespace (only its children enter it): it
# forks PID 1, the program, and mirrors its exit status, signal deaths included. On
# SIGTERM it kills PID 1 and waits, which returns only once the kernel has reaped
# every process of the namespace: a run ends with nothing of it left.
_LAUNCHER = """
import os, signal, sys
pid = os.fork()
if pid == 0:
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", "-"])
    finally:
        os._exit(127)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
if code < 0:
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code if code >= 0 else 128 - code)
"""


@dataclass
class SandboxLimits:
    """Per-run limits; memory, CPU and processes are per process / per container uid."""

    timeout_s: float = 10.0
    memory_mb: int = 256  # RLIMIT_AS of each process
    cpu_s: int = 10  # RLIMIT_CPU of each process
    max_output_bytes: int = 64_000  # of stdout+stderr kept; the rest is drained and dropped
    max_files_mb: int = 50  # RLIMIT_FSIZE per file, and the folder's total checked after a run
    max_procs: int = 32  # RLIMIT_NPROC of the container's uid


@dataclass
class CodeResult:
    """``outputs`` as in a ``code_interpreter_call`` item; ``error`` is the sandbox's own word."""

    outputs: list[dict[str, Any]]
    exit_code: int | None
    timed_out: bool
    error: str | None


def _sandbox_uid(container_id: str) -> int:
    """A stable uid per container, so its files stay its own across runs and router restarts."""
    digest = hashlib.sha256(container_id.encode()).digest()
    return _UID_BASE + int.from_bytes(digest[:4], "big") % _UID_SPAN


def _world_usable(path: Path, need: int = stat.S_IXOTH) -> bool:
    """Whether any uid may reach ``path``: every directory on the way (links too) searchable."""
    for p in (path.absolute(), path.resolve()):
        try:
            if any(not os.stat(d).st_mode & stat.S_IXOTH for d in p.parents) or os.stat(p).st_mode & need != need:
                return False
        except OSError:
            return False
    return True


def _sandbox_python() -> str | None:
    """An interpreter the sandbox uid can run: ours, unless it sits under a 0700 home (pyenv)."""
    found = (sys.executable, getattr(sys, "_base_executable", ""), shutil.which("python3", path="/usr/local/bin:/usr/bin"))
    return next((c for c in found if c and _world_usable(Path(c), stat.S_IXOTH | stat.S_IROTH)), None)


def _sandbox_preexec(limits: SandboxLimits, uid: int | None) -> Callable[[], None]:
    """What the child does between fork and exec. Raising here means the code never runs."""
    rlimits = [
        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, limits.max_procs),
        (resource.RLIMIT_FSIZE, limits.max_files_mb << 20),
        (resource.RLIMIT_CPU, limits.cpu_s),  # soft == hard: SIGKILL, which even a PID 1 gets
        (resource.RLIMIT_AS, limits.memory_mb << 20),  # last: this forked router copy is bigger
    ]

    def enter() -> None:
        if _libc.unshare(_CLONE_NEWNET | _CLONE_NEWPID) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET | CLONE_NEWPID) failed")
        if uid is not None:  # from root to non-root: every capability goes
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        for res, value in rlimits:
            resource.setrlimit(res, (value, value))

    return enter


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Regular files under ``folder`` (never following links): relative path -> (mtime_ns, size)."""
    files: dict[str, tuple[int, int]] = {}
    seen = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                files[os.path.relpath(path, folder)] = (st.st_mtime_ns, st.st_size)
        seen += len(dirnames) + len(filenames)
        if seen > MAX_SCAN_ENTRIES:  # a folder of a million files must not stall the tool
            break
    return files


def _read_png(path: Path) -> bytes | None:
    """A PNG's bytes, refusing links (a link to a root-only file must not come back as an image)."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            ok = stat.S_ISREG(st.st_mode) and st.st_size <= MAX_IMAGE_BYTES and st.st_nlink == 1
            data = f.read(MAX_IMAGE_BYTES + 1) if ok else b""
    except OSError:
        return None
    return data if data.startswith(_PNG_MAGIC) and len(data) <= MAX_IMAGE_BYTES else None


def _unlink_all(folder: Path, rels: list[str]) -> None:
    """Delete files by snapshot path; the program is dead, so the tree cannot change under us."""
    for rel in rels:
        (folder / rel).unlink(missing_ok=True)


class CodeInterpreter:
    """Runs code in per-container scratch folders under ``root``; one run per container at a time."""

    def __init__(self, root: Path, limits: SandboxLimits) -> None:
        self.root = Path(root).absolute()
        self.limits = limits
        self.root.mkdir(parents=True, exist_ok=True)
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # As root every run gets its own uid, which must reach its folder and an interpreter.
        self._drop = os.geteuid() == 0
        self.python = _sandbox_python() if self._drop else sys.executable
        if self._drop:
            self.root.chmod(0o711)  # others may pass through, not list
            if not _world_usable(self.root):
                raise ValueError(f"code interpreter root {self.root}: a parent is not searchable by other users")

    def _folder(self, container_id: str) -> Path:
        """The container's folder; the id becomes a path, so it is checked before anything else."""
        if not isinstance(container_id, str) or not _ID.fullmatch(container_id):
            raise ValueError(f"invalid container id {container_id!r}: want [A-Za-z0-9_-]{{1,64}}")
        return self.root / container_id

    def _lock(self, container_id: str) -> asyncio.Lock:
        """One run per container at a time, so a run's file snapshot is its own; gone when unused."""
        lock = self._locks.get(container_id)
        if lock is None:
            lock = self._locks[container_id] = asyncio.Lock()
        return lock

    def _prepare(self, folder: Path, uid: int | None) -> dict[str, tuple[int, int]]:
        folder.mkdir(mode=0o700, exist_ok=True)
        if uid is not None:
            os.chown(folder, uid, uid, follow_symlinks=False)
            folder.chmod(0o700)
        return _snapshot(folder)

    async def run(self, code: str, container_id: str) -> CodeResult:
        """Run ``code``; files the program leaves in its folder persist for later runs."""
        folder = self._folder(container_id)
        uid = _sandbox_uid(container_id) if self._drop else None
        if self.python is None:
            return CodeResult([], None, False, "sandbox refused: no Python the sandbox uid can execute")
        async with self._lock(container_id):
            before = await asyncio.to_thread(self._prepare, folder, uid)
            logs, exit_code, timed_out, error = await self._execute(code, folder, uid)
            if error is not None:
                return CodeResult([], None, False, error)
            after = await asyncio.to_thread(_snapshot, folder)
            changed = sorted(p for p, v in after.items() if before.get(p) != v)
            outputs: list[dict[str, Any]] = [{"type": "logs", "logs": logs}] if logs else []
            if timed_out:
                error = f"timed out after {self.limits.timeout_s:g}s; the program was killed"
            elif exit_code == -signal.SIGKILL:
                error = f"killed: CPU time limit ({self.limits.cpu_s}s) reached, or out of memory"
            if sum(size for _, size in after.values()) > self.limits.max_files_mb << 20:
                await asyncio.to_thread(_unlink_all, folder, changed)
                error = f"folder over {self.limits.max_files_mb} MB: the files this run wrote were deleted"
                return CodeResult(outputs, exit_code, timed_out, error)
            for rel in [p for p in changed if p.lower().endswith(".png")][:MAX_IMAGES]:
                data = await asyncio.to_thread(_read_png, folder / rel)
                if data is not None:
                    url = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
                    outputs.append({"type": "image", "url": url})
            return CodeResult(outputs, exit_code, timed_out, error)

    async def _execute(self, code: str, folder: Path, uid: int | None) -> tuple[str, int | None, bool, str | None]:
        """Spawn, feed, read bounded output, enforce the wall clock: (logs, exit code, timed out, refusal)."""
        home = str(folder)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python or sys.executable, "-I", "-S", "-c", _LAUNCHER,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd=folder, env=env, start_new_session=True, close_fds=True,
                preexec_fn=_sandbox_preexec(self.limits, uid),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return "", None, False, f"sandbox refused: could not set it up, so the code was not run ({exc})"
        kept = bytearray()
        total = 0

        async def pump() -> None:
            nonlocal total
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                await proc.stdin.drain()
            except ConnectionError:  # it died before reading all of it
                pass
            proc.stdin.close()
            while chunk := await proc.stdout.read(1 << 16):
                total += len(chunk)
                kept.extend(chunk[: max(0, self.limits.max_output_bytes - len(kept))])
            await proc.wait()

        timed_out = False
        try:
            await asyncio.wait_for(pump(), self.limits.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing may outlive the run
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()  # the launcher kills PID 1 and waits for the namespace to empty
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
            if proc.returncode is None:  # launcher not up yet: the group, PDEATHSIG for a setsid() PID 1
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.wait_for(proc.wait(), 10)
        logs = kept.decode("utf-8", "replace")
        if total > len(kept):
            logs += f"\n[output truncated: {total - len(kept)} more bytes not shown]"
        return logs, proc.returncode, timed_out, None

    async def close_container(self, container_id: str) -> None:
        """Delete the container's folder (after any run in it ends); rmtree never follows links."""
        folder = self._folder(container_id)
        async with self._lock(container_id):
            await asyncio.to_thread(shutil.rmtree, folder, True)
