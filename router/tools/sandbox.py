"""The code interpreter's isolation: namespaces, a minimal root file system, privileges, limits.

``preexec`` builds what the forked child runs between fork and exec. It must not import or
load anything (the router has threads, the child has only the forking one), so every path,
flag and byte string is prepared in the parent and the child only makes libc calls:

1. The run's cgroups joined (``RunCgroups``, where the host has them), then
   ``unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID [| CLONE_NEWCGROUP])``, then every
   mount made private, so nothing done below reaches the host's mount table, nor the
   host's mounts reach in.
2. A tmpfs over a private, empty directory becomes the new root. In it: read-only binds of
   ``/usr`` (and ``/lib*``, ``/bin`` where they are real directories; symlinks where the host
   has merged /usr) and of the interpreter's prefix if it lies elsewhere; ``/dev`` holding only
   null, zero, random, urandom (binds of the host's nodes) and the fd links; ``/tmp``, a fresh
   size-limited tmpfs (``/dev/shm`` points at it); ``/mnt/data``, the container's folder,
   read-write, which is also the cwd and ``$HOME``; ``/etc`` with a generated passwd and group
   naming only the sandbox uid; an empty ``/proc`` mount point.
3. ``pivot_root`` into it, the old root detached, the new root remounted read-only: nothing of
   the host's file system is left to see (not /etc, /root, /home, /work, nor the host's /tmp).

The exec'd launcher (``LAUNCHER``) is still root, outside the new PID namespace; its child is
the namespace's PID 1, which mounts a fresh ``/proc`` (only a process inside a PID namespace
can mount the procfs that shows just that namespace), drops to the container's uid, arms
PDEATHSIG, installs the seccomp filter (``router.tools.seccomp``: no new namespaces, mounts,
ptrace and the like from here on), and execs the interpreter on the code. A failure at any
step, in the preexec or in PID 1, is written to a status pipe and the code never runs; there
is no fallback.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["DATA_DIR", "LAUNCHER", "MountPlan", "RunCgroups", "interpreter_prefixes", "preexec"]

_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child must not import or load

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWCGROUP = 0x00020000, 0x40000000, 0x20000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# pivot_root has no libc wrapper; its number per architecture (asm-generic is 41).
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "loongarch64": 41,
               "ppc64le": 203, "ppc64": 203, "s390x": 217}.get(platform.machine())
DATA_DIR = "/mnt/data"
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin")
_DEVICES = ("null", "zero", "random", "urandom")
_RO = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV

# The exec'd launcher, root, outside the new PID namespace (only its children enter it): it
# forks PID 1 and mirrors its exit status, signal deaths included. On SIGTERM it kills PID 1
# and waits, which returns only once the kernel has reaped every process of the namespace.
# PID 1 installs the seccomp filter last, right before exec: the /proc mount above needs what
# it denies. argv: uid (-1: keep ours), the status pipe's fd, the filter (``seccomp.program``, hex).
LAUNCHER = """
import ctypes, os, signal, sys
uid, status, bpf = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
class Prog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
pid = os.fork()
if pid == 0:
    try:
        os.set_inheritable(status, False)  # closed by a successful exec: empty pipe, all went well
        if libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) != 0:
            raise OSError(ctypes.get_errno(), "mount of /proc for the PID namespace failed")
        if uid >= 0:  # from root to non-root: every capability goes
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if libc.prctl(1, 9) != 0:  # PR_SET_PDEATHSIG, after setuid, which clears it
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if not bpf or len(bpf) % 8:
            raise OSError(0, "no seccomp filter")
        filt = ctypes.create_string_buffer(bpf, len(bpf))
        prog = Prog(len(bpf) // 8, ctypes.addressof(filt))
        one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
        if libc.prctl(38, one, zero, zero, zero) != 0:  # PR_SET_NO_NEW_PRIVS: required, and no setuid gains
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.prctl(22, ctypes.c_ulong(2), ctypes.byref(prog)) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
            raise OSError(ctypes.get_errno(), "installing the seccomp filter failed")
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", "-"])
    except BaseException as exc:
        os.write(status, f"sandbox PID 1: {exc}".encode())
    finally:
        os._exit(127)
os.close(status)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
if code < 0:
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code if code >= 0 else 128 - code)
"""


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def interpreter_prefixes(executable: str, own: bool) -> list[str]:
    """Host folders the interpreter needs, bound read-only at the same paths.

    ``executable`` is a resolved path; its prefix is the folder above its ``bin``. For the
    router's own interpreter, ``sys.base_prefix`` and ``sys.base_exec_prefix`` too (never the
    venv's: the sandbox runs the base interpreter with ``-I -S``).
    """
    found = [os.path.dirname(os.path.dirname(executable))]
    if own:
        found += [os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)]
    out: list[str] = []
    for p in found:
        if p not in out and os.path.isdir(p):
            out.append(p)
    return out


def world_executable(executable: str, prefixes: Sequence[str]) -> bool:
    """Whether another uid may run ``executable`` once its prefix is bound (dirs above are ours)."""
    top = next((p for p in prefixes if _under(executable, [p])), None)
    if top is None:
        return False
    try:
        if os.stat(executable).st_mode & (stat.S_IXOTH | stat.S_IROTH) != stat.S_IXOTH | stat.S_IROTH:
            return False
        d = os.path.dirname(executable)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == top or len(d) <= len(top):
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


class MountPlan:
    """The steps that build the new root, each a (description, callable-free tuple) prepared here.

    Steps are plain tuples of bytes and ints, run by ``_run_step`` in the child:
    ``("dir", path)``, ``("link", path, target)``, ``("file", path, content)``,
    ``("mount", source, target, fstype, flags, data)``.
    """

    def __init__(self, newroot: Path, folder: Path, prefixes: Sequence[str], uid: int | None, tmp_mb: int) -> None:
        self.newroot = os.fsencode(newroot)
        self.steps: list[tuple[str, tuple]] = []
        r = str(newroot)
        self._made: set[str] = set()
        self._mount("tmpfs", r, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        binds = [d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):  # merged /usr: /lib -> usr/lib and the like
                self._step("link", r + d, os.readlink(d))
        binds += [p for p in prefixes if not _under(p, binds)]
        if "/" in binds:
            raise ValueError("the interpreter's prefix is /: it cannot be bound without the whole host")
        hidden = [p for p in binds if _under(p, ["/tmp", "/dev", "/proc", "/etc", DATA_DIR])]
        if hidden:
            raise ValueError(f"the interpreter's prefix {hidden[0]} would be hidden by the sandbox's own mounts")
        for src in binds:
            self._dirs(r, src)
            self._mount(src, r + src, None, MS_BIND, None)
            self._mount(None, r + src, None, _RO, None)
        self._dirs(r, "/dev")
        self._mount("tmpfs", r + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
        for dev in _DEVICES:  # binds of the host's nodes, read-write but nothing else
            self._step("file", f"{r}/dev/{dev}", b"")
            self._mount(f"/dev/{dev}", f"{r}/dev/{dev}", None, MS_BIND, None)
            self._mount(None, f"{r}/dev/{dev}", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC, None)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
            self._step("link", f"{r}/dev/{name}", target)
        self._mount(None, r + "/dev", None, _RO | MS_NOEXEC, None)
        self._dirs(r, "/tmp")
        self._mount("tmpfs", r + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
        self._dirs(r, DATA_DIR)
        self._mount(str(folder), r + DATA_DIR, None, MS_BIND, None)
        self._mount(None, r + DATA_DIR, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, None)
        self._dirs(r, "/proc")  # PID 1 mounts it, from inside the new PID namespace
        self._dirs(r, "/etc")
        if uid is not None:  # getpwuid() and friends answer; nothing of the host's users shows
            self._step("file", r + "/etc/passwd", f"sandbox:x:{uid}:{uid}:sandbox:{DATA_DIR}:/bin/false\n".encode())
            self._step("file", r + "/etc/group", f"sandbox:x:{uid}:\n".encode())

    def _step(self, kind: str, path: str, arg: str | bytes | None = None) -> None:
        encoded = os.fsencode(arg) if isinstance(arg, str) else arg
        self.steps.append((f"{kind} {path}", (kind, os.fsencode(path), encoded)))

    def _mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
        what = f"mount {fstype or source} on {target}" if not flags & MS_REMOUNT else f"remount {target}"
        self.steps.append((what, ("mount", *(os.fsencode(a) if isinstance(a, str) else a
                                             for a in (source, target, fstype, flags, data)))))

    def _dirs(self, root: str, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            sub = "/" + "/".join(parts[:i])
            if sub not in self._made:
                self._made.add(sub)
                self._step("dir", root + sub)


def _run_step(step: tuple) -> int:
    """One step of a plan, in the child: libc and os calls only. Returns 0 or -1 (errno set)."""
    kind = step[0]
    if kind == "dir":
        os.mkdir(step[1], 0o755)
        return 0
    if kind == "link":
        os.symlink(step[2], step[1])
        return 0
    if kind == "file":
        fd = os.open(step[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, step[2])
        finally:
            os.close(fd)
        return 0
    _, source, target, fstype, flags, data = step
    return _libc.mount(source, target, fstype, ctypes.c_ulong(flags), data)


def preexec(plan: MountPlan, rlimits: Sequence[tuple[int, int]], status_fd: int,
            cgroup_procs: Sequence[bytes] = ()) -> Callable[[], None]:
    """What the child does between fork and exec. Raising here means the code never runs.

    It joins the run's cgroups first (``cgroup_procs``: their ``cgroup.procs`` files), so the
    launcher and all it forks are counted; a new cgroup namespace then hides their paths.
    """
    steps = plan.steps
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (CLONE_NEWCGROUP if cgroup_procs else 0)
    unshare_what = "unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID" + (" | CLONE_NEWCGROUP)" if cgroup_procs else ")")
    newroot = plan.newroot

    def fail(what: str) -> None:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")

    def enter() -> None:
        try:
            for procs in cgroup_procs:
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, b"0")  # 0: the writer itself
                finally:
                    os.close(fd)
            if _libc.unshare(flags) != 0:
                fail(unshare_what)
            if _libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None) != 0:
                fail("making every mount private")
            for what, step in steps:
                if _run_step(step) != 0:
                    fail(what)
            if _PIVOT_ROOT is None:
                raise OSError(0, f"pivot_root: unknown syscall number on {platform.machine()}")
            os.chdir(newroot)
            if _libc.syscall(_PIVOT_ROOT, b".", b".") != 0:  # the old root now sits on top of the new
                fail("pivot_root")
            if _libc.umount2(b".", MNT_DETACH) != 0:
                fail("detaching the old root")
            os.chdir(b"/")
            if _libc.mount(None, b"/", None, ctypes.c_ulong(_RO), None) != 0:
                fail("remounting the new root read-only")
            os.chdir(DATA_DIR)
            for res, value in rlimits:
                resource.setrlimit(res, (value, value))
        except BaseException as exc:
            os.write(status_fd, f"sandbox setup: {exc}".encode())
            raise

    return enter


class RunCgroups:
    """One cgroup per run, per controller, capping memory (page cache and /tmp included) and
    tasks for the run as a whole, where rlimits only cap each process and the uid.

    cgroup v2 where our cgroup's children get the memory and pids controllers; otherwise the
    v1 ``memory`` and ``pids`` hierarchies (hybrid hosts, like this project's machines, have a
    v2 tree without controllers). ``find`` proves it by making and removing a probe cgroup;
    ``None`` means no cgroups here, and only the rlimits apply.
    """

    def __init__(self, parents: dict[str, str], v2: bool) -> None:
        self.parents = parents  # controller ("memory", "pids"; "" for v2) -> our own cgroup's folder
        self.v2 = v2

    @classmethod
    def find(cls) -> RunCgroups | None:
        try:
            own: dict[str, str] = {}  # hierarchy controllers -> path, from /proc/self/cgroup
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                own[controllers] = path
            mounts: dict[str, str] = {}  # fstype and super options -> mount point (mount root "/" only)
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                left, right = line.split(" - ", 1)
                fields, (fstype, _, opts) = left.split(), right.split()[:3]
                if fields[3] == "/" and fstype in ("cgroup", "cgroup2"):
                    mounts.setdefault("" if fstype == "cgroup2" else opts, fields[4])
        except (OSError, ValueError):
            return None
        candidates: list[RunCgroups] = []
        if "" in mounts and "" in own:
            candidates.append(cls({"": mounts[""] + own[""].rstrip("/")}, True))
        v1 = {}
        for controller in ("memory", "pids"):
            mount_opts = next((o for o in mounts if o and controller in o.split(",")), None)
            own_path = next((p for c, p in own.items() if controller in c.split(",")), None)
            if mount_opts is not None and own_path is not None:
                v1[controller] = mounts[mount_opts] + own_path.rstrip("/")
        if len(v1) == 2:
            candidates.append(cls(v1, False))
        for found in candidates:
            try:
                made = found.create(f"probe-{os.getpid()}-{os.urandom(4).hex()}", 64 << 20, 8)
            except OSError:
                continue
            found.remove(made)
            return found
        return None

    def create(self, name: str, memory_bytes: int, tasks: int) -> list[str]:
        """Make the run's cgroups with their limits: their folders (remove them with ``remove``)."""
        made: list[str] = []
        try:
            for controller, parent in self.parents.items():
                folder = os.path.join(parent, f"code-interpreter-{name}")
                os.mkdir(folder, 0o700)
                made.append(folder)
                if self.v2:
                    controllers = Path(folder, "cgroup.controllers").read_text().split()
                    if "memory" not in controllers or "pids" not in controllers:
                        raise OSError(0, f"{folder}: no memory and pids controllers")
                    limits = [("memory.max", memory_bytes), ("memory.swap.max", 0), ("pids.max", tasks)]
                elif controller == "memory":
                    limits = [("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes", memory_bytes)]
                else:
                    limits = [("pids.max", tasks)]
                for file, value in limits:
                    path = Path(folder, file)
                    if path.exists() or file in ("memory.max", "memory.limit_in_bytes", "pids.max"):
                        path.write_text(str(value))  # the swap caps only where swap is accounted
        except OSError:
            self.remove(made)
            raise
        return made

    @staticmethod
    def procs(folders: Sequence[str]) -> list[bytes]:
        return [os.fsencode(os.path.join(f, "cgroup.procs")) for f in folders]

    @staticmethod
    def remove(folders: Sequence[str]) -> None:
        """Remove the run's cgroups; empty once the launcher is reaped (a few tries for the kernel)."""
        for folder in folders:
            for _ in range(50):
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
