"""Backend of the ``code_interpreter`` tool: model-written Python in a sandboxed subprocess.

Model code is hostile, so every run is set up in the forked child before exec (the
preexec of ``router.tools.sandbox``) and in the PID 1 of its namespaces; any failure there
means the code does not run, and the result says which step failed. The layers:

- new network namespace: only a downed loopback, so neither the host's loopback nor
  the internet is reachable. No namespace, no run; never a fallback.
- new PID namespace whose PID 1 is the program (it dies with the launcher through
  PDEATHSIG): when it ends, the kernel kills all it left, even ``setsid()`` escapees,
  and nothing in it can see or signal the router. Its ``/proc`` is mounted fresh from
  inside, so it lists only the program's own processes.
- new mount namespace (all mounts private) and ``pivot_root`` into a per-run tmpfs root,
  read-only, holding only read-only binds of ``/usr`` (``/lib*``, ``/bin`` as the host
  has them) and of the base interpreter's prefix, a minimal ``/dev`` (null, zero, random,
  urandom), a generated ``/etc/passwd`` naming only the sandbox uid, a fresh size-limited
  tmpfs at ``/tmp`` (``tmp_mb``, gone when the run ends, never shared), and the
  container's folder read-write at ``/mnt/data`` (the cwd and ``$HOME``). Nothing else of
  the host is visible: not /etc, /root, /home, the checkout, the config, the store, other
  containers' folders, nor the host's /tmp. The mounts vanish with the namespace.
- an unprivileged uid per container (the router runs as root): no capabilities (no
  ``setns`` back to the host network, no remounting, no writing root's files), and
  RLIMIT_NPROC counts, which it never does for root. The interpreter is the base one
  (never the venv), run as ``python -I -S -u``.
- a seccomp filter (``router.tools.seccomp``, with no_new_privs) installed by PID 1 right
  before it execs the interpreter, after every mount the setup needs: no new namespaces
  (``unshare``, ``setns``, ``clone`` with ``CLONE_NEW*``), no mounts, no ``ptrace``, BPF,
  keyrings, io_uring, userfaultfd, modules and the like (EPERM); another syscall ABI kills.
  No filter for the host's architecture: no run.
- rlimits AS, CPU, FSIZE, NPROC, NOFILE, CORE=0 per process, and, where the host lets
  us make cgroups (``sandbox.RunCgroups``: v2 with memory and pids controllers, else the
  v1 memory and pids hierarchies, as on this project's machines), one cgroup per run
  capping the run as a whole: memory ``memory_mb + tmp_mb`` (its /tmp and page cache
  included; the kernel OOM-kills within the run) and ``max_procs + 1`` tasks; a cgroup
  namespace shows it as ``/``. Where no cgroup can be made, only the rlimits apply: memory
  then is capped per process, processes per uid. A cgroup that can be made but fails for a
  run refuses the run. A minimal env; code on stdin, which then stays at EOF; bounded
  output; a wall-clock timeout that SIGKILLs the process group.

A container belongs to the API key that uses it: its id is a name in that key's own namespace.
The folder and the sandbox uid derive from a hash of (owner, id), so another key that names the
same id (``"project-x"``, or an auto ``cntr_...`` id it saw) gets a container of its own, empty,
with another folder and uid; nothing of the first key's files is reachable from it. Two containers
never share a uid (which would share its process limit), whatever their hashes: a container's uid
is claimed with an exclusive create of ``root/.uids/<uid>`` (holding its folder's name), the next
free one after its hash's when that is taken, and kept as its folder's owner.

The container folders live under ``root`` (0700, the router's alone: the sandbox reaches
its folder only through the bind), each named by that hash. ``root/.newroot`` is the empty
mount point each run builds its tmpfs root on, inside its own mount namespace.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.tools import sandbox, seccomp

__all__ = ["CodeInterpreter", "CodeResult", "SandboxLimits"]

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UID_BASE, _UID_SPAN = 1 << 30, 1 << 30  # far above real users and common subuid ranges
_UIDS = ".uids"  # under root: one claim file per sandbox uid in use (``claim_uid``)
MAX_UID_PROBES = 1024  # uids tried after a container's own is taken (a run is refused past them)
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_IMAGES, MAX_IMAGE_BYTES, MAX_SCAN_ENTRIES = 8, 4 << 20, 20_000
_NEWROOT = ".newroot"  # under the root, never a container id: where each run's tmpfs root is built


@dataclass
class SandboxLimits:
    """Per-run limits; memory, CPU and processes are per process / per container uid."""

    timeout_s: float = 10.0
    memory_mb: int = 256  # RLIMIT_AS of each process
    cpu_s: int = 10  # RLIMIT_CPU of each process
    max_output_bytes: int = 64_000  # of stdout+stderr kept; the rest is drained and dropped
    max_files_mb: int = 50  # RLIMIT_FSIZE per file, and the folder's total checked after a run
    max_procs: int = 32  # RLIMIT_NPROC of the container's uid
    tmp_mb: int = 64  # size of the run's own /tmp (a tmpfs, gone when the run ends)


@dataclass
class CodeResult:
    """``outputs`` as in a ``code_interpreter_call`` item; ``error`` is the sandbox's own word."""

    outputs: list[dict[str, Any]]
    exit_code: int | None
    timed_out: bool
    error: str | None


def _container_key(owner: str, container_id: str) -> str:
    """Whose container, hashed: the folder's name. The id (checked) never holds a NUL, so the split is unambiguous."""
    return hashlib.sha256(f"{owner}\0{container_id}".encode()).hexdigest()


def _sandbox_uid(key: str) -> int:
    """A container's first choice of uid (its key's hash); ``claim_uid`` makes it its own."""
    return _UID_BASE + int(key[:8], 16) % _UID_SPAN


def claim_uid(root: Path, folder: Path) -> int:
    """The uid of the container whose folder is ``folder`` (named by its key): the folder's owner once
    it has one, else the first uid from its hash's on that no other container holds, claimed by an
    exclusive create of ``root/.uids/<uid>`` (atomic, across processes too). Stable across runs and
    restarts, so its files stay its own. RuntimeError when none is free."""
    key = folder.name
    claims = root / _UIDS
    claims.mkdir(mode=0o700, exist_ok=True)
    try:
        owner = folder.stat().st_uid
    except FileNotFoundError:
        owner = -1
    if owner >= _UID_BASE:  # chowned by an earlier run: claimed then (or, a folder older than claims, now)
        _claim(claims / str(owner), key)
        return owner
    start = _sandbox_uid(key) - _UID_BASE
    for step in range(min(_UID_SPAN, MAX_UID_PROBES)):
        uid = _UID_BASE + (start + step) % _UID_SPAN
        claim = claims / str(uid)
        if _claim(claim, key) or claim.read_text() == key:  # newly ours, or ours from a run stopped before its chown
            return uid
    raise RuntimeError(f"no free sandbox uid after {MAX_UID_PROBES} tries")


def _claim(claim: Path, key: str) -> bool:
    """Create ``claim`` holding ``key``; False when it exists already."""
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(key)
    return True


def release_uid(root: Path, uid: int, key: str) -> None:
    """A closed container's uid is free again (only if the claim is its own)."""
    claim = root / _UIDS / str(uid)
    try:
        if claim.read_text() == key:
            claim.unlink()
    except FileNotFoundError:
        pass


def _sandbox_python() -> tuple[str, list[str]] | None:
    """A base interpreter the sandbox uid can run, and the host folders to bind for it.

    Resolved paths, so a venv's link is never what runs: ours first, then a system python3.
    Only the prefix must be open to other users: the folders above it are the new root's own.
    """
    base = getattr(sys, "_base_executable", "") or sys.executable
    found = [(base, True), (sys.executable, True), (shutil.which("python3", path="/usr/local/bin:/usr/bin") or "", False)]
    for candidate, own in found:
        if not candidate:
            continue
        exe = os.path.realpath(candidate)
        prefixes = sandbox.interpreter_prefixes(exe, own)
        if sandbox.world_executable(exe, prefixes):
            return exe, prefixes
    return None


def _rlimits(limits: SandboxLimits) -> list[tuple[int, int]]:
    return [
        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, limits.max_procs),
        (resource.RLIMIT_FSIZE, limits.max_files_mb << 20),
        (resource.RLIMIT_CPU, limits.cpu_s),  # soft == hard: SIGKILL, which even a PID 1 gets
        (resource.RLIMIT_AS, limits.memory_mb << 20),  # last: this forked router copy is bigger
    ]


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


def _read_status(fd: int) -> str:
    """What a failed setup step wrote to the status pipe (every writer is closed by now)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096).decode("utf-8", "replace")
    except BlockingIOError:
        return ""


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
        # As root every run gets its own uid; its folder is bound into its root, so no path
        # on the host needs to be open to it: the root stays the router's alone.
        self._drop = os.geteuid() == 0
        found = _sandbox_python()
        self.python: str | None
        self._prefixes: list[str]
        self.python, self._prefixes = found if found is not None else (None, [])
        self.root.chmod(0o700)
        self._cgroups = sandbox.RunCgroups.find() if self._drop else None  # None: rlimits only
        self._seccomp = seccomp.program(platform.machine())  # None: no filter here, so no runs
        (self.root / _NEWROOT).mkdir(mode=0o700, exist_ok=True)

    def folder(self, container_id: str, owner: str) -> Path:
        """The folder of ``owner``'s container ``container_id``; the id is checked before anything else."""
        if not isinstance(container_id, str) or not _ID.fullmatch(container_id):
            raise ValueError(f"invalid container id {container_id!r}: want [A-Za-z0-9_-]{{1,64}}")
        return self.root / _container_key(owner, container_id)

    def _lock(self, key: str) -> asyncio.Lock:
        """One run per container at a time, so a run's file snapshot is its own; gone when unused."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def _prepare(self, folder: Path, uid: int | None) -> dict[str, tuple[int, int]]:
        (self.root / _NEWROOT).mkdir(mode=0o700, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        if uid is not None:
            os.chown(folder, uid, uid, follow_symlinks=False)
            folder.chmod(0o700)
        return _snapshot(folder)

    async def run(self, code: str, container_id: str, owner: str) -> CodeResult:
        """Run ``code`` in ``owner``'s container; files the program leaves in its folder persist for later runs."""
        folder = self.folder(container_id, owner)
        if self.python is None:
            return CodeResult([], None, False, "sandbox refused: no Python the sandbox uid can execute")
        if self._seccomp is None:
            return CodeResult([], None, False, f"sandbox refused: no seccomp filter for {platform.machine()}")
        async with self._lock(folder.name):
            try:
                uid = await asyncio.to_thread(claim_uid, self.root, folder) if self._drop else None
            except RuntimeError as exc:
                return CodeResult([], None, False, f"sandbox refused: {exc}")
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
        assert self.python is not None and self._seccomp is not None
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": sandbox.DATA_DIR, "TMPDIR": "/tmp",
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        try:
            plan = sandbox.MountPlan(self.root / _NEWROOT, folder, self._prefixes, uid, self.limits.tmp_mb)
        except ValueError as exc:
            return "", None, False, f"sandbox refused: {exc}"
        cgroups: list[str] = []
        if self._cgroups is not None:  # the whole run's RAM, its /tmp included, and its tasks (+1: the launcher)
            memory = (self.limits.memory_mb + self.limits.tmp_mb) << 20
            try:
                cgroups = self._cgroups.create(secrets.token_hex(8), memory, self.limits.max_procs + 1)
            except OSError as exc:
                return "", None, False, f"sandbox refused: could not make the run's cgroups, so the code was not run ({exc})"
        status_r, status_w = os.pipe()  # setup failures, from the preexec or from PID 1; empty: it ran
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.python, "-I", "-S", "-c", sandbox.LAUNCHER, str(-1 if uid is None else uid), str(status_w),
                    self._seccomp.hex(),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True, close_fds=True, pass_fds=(status_w,),
                    preexec_fn=sandbox.preexec(plan, _rlimits(self.limits), status_w, sandbox.RunCgroups.procs(cgroups)),
                )
            except (OSError, subprocess.SubprocessError) as exc:
                os.close(status_w)
                why = _read_status(status_r) or str(exc)
                return "", None, False, f"sandbox refused: could not set it up, so the code was not run ({why})"
            os.close(status_w)
            logs, timed_out = await self._communicate(proc, code)
            why = _read_status(status_r)
        finally:
            os.close(status_r)
            if cgroups:
                await asyncio.to_thread(sandbox.RunCgroups.remove, cgroups)
        if why:
            return "", None, False, f"sandbox refused: could not set it up, so the code was not run ({why})"
        return logs, proc.returncode, timed_out, None

    async def _communicate(self, proc: asyncio.subprocess.Process, code: str) -> tuple[str, bool]:
        """Feed the code, keep bounded output, enforce the wall clock; nothing outlives it."""
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
        return logs, timed_out

    async def close_container(self, container_id: str, owner: str) -> None:
        """Delete ``owner``'s container's folder (after any run in it ends); rmtree never follows links."""
        folder = self.folder(container_id, owner)
        async with self._lock(folder.name):
            await asyncio.to_thread(self._remove, folder)

    def _remove(self, folder: Path) -> None:
        try:
            uid = folder.stat().st_uid
        except FileNotFoundError:
            return
        shutil.rmtree(folder, True)
        if uid >= _UID_BASE:
            release_uid(self.root, uid, folder.name)
