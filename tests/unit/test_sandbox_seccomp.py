"""The sandbox's system-call filter (router/tools/seccomp.py): what it refuses, what it lets
through, its BPF program per architecture, and a sandbox that cannot install it refusing to run."""

from __future__ import annotations

import asyncio
import errno
import platform
import signal
import struct
from pathlib import Path

import pytest

from router.tools import sandbox as sandbox_mod
from router.tools import seccomp
from router.tools.code_interpreter import CodeInterpreter, SandboxLimits
from tests.support import sandbox_env
from tests.support.sandbox_env import OWNER, folder, logs, run

# The seccomp filter. Every probe runs in a forked child of the program, so one that the kernel
# lets through (on a sandbox without the filter) changes nothing for the next; each prints the
# child's errno (0: the call went through; negative: the signal that killed it). Arguments are
# chosen so that, let through, the kernel answers something other than EPERM (EINVAL, EFAULT,
# EBADF, or success) wherever an unprivileged call allows it: EPERM then means the filter.
CLONE_SIGHAND, CLONE_IO, CLONE_NEWNS, CLONE_NEWUSER = 0x800, 0x80000000, 0x00020000, 0x10000000
NEW_FLAGS = {"NEWNS": 0x00020000, "NEWCGROUP": 0x02000000, "NEWUTS": 0x04000000, "NEWIPC": 0x08000000,
             "NEWUSER": 0x10000000, "NEWPID": 0x20000000, "NEWNET": 0x40000000}
DENIED_ARGS: dict[str, list[object]] = {  # the rest get zeros
    "unshare": [CLONE_NEWUSER | CLONE_IO], "setns": [-1, 0], "fsconfig": [-1, 0, 0, 0, 0], "fsmount": [-1, 0, 0],
    "fspick": [-1, 0, 0], "open_tree": [-100, 0, 0], "move_mount": [-1, 0, -1, 0, 0], "mount_setattr": [-1, 0, 0, 0, 0],
    "open_tree_attr": [-100, 0, 0, 0, 0], "process_vm_readv": ["PID", 0, 0, 0, 0, 0],
    "process_vm_writev": ["PID", 0, 0, 0, 0, 0], "kcmp": ["PID", "PID", 0, 0, 0], "pidfd_getfd": [-1, 0, 0],
    "process_madvise": [-1, 0, 0, 0, 0], "perf_event_open": [0, 0, -1, -1, 0], "keyctl": [0, -2, 1],
    "finit_module": [-1, 0, 0], "open_by_handle_at": [-1, 0, 0], "name_to_handle_at": [-100, 0, 0, 0, 0],
    "userfaultfd": [1], "io_uring_setup": [1, 0], "io_uring_enter": [-1, 0, 0, 0, 0, 0],
    "io_uring_register": [-1, 0, 0, 0], "quotactl_fd": [-1, 0, 0, 0], "syslog": [10, 0, 0], "sysfs": [3],
}
PROBE = '''
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def arg(a):
    return ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(os.getpid() if a == "PID" else a)

def machine_code(code):  # run raw x86 instructions (another ABI's syscall)
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    return ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))()

def attempt(calls):
    pid = os.fork()
    if pid == 0:
        for nr, args in calls:
            if isinstance(nr, bytes):
                machine_code(nr)
            elif libc.syscall(ctypes.c_long(nr), *map(arg, args)) == -1:
                os._exit(ctypes.get_errno())
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

for label, calls in PROBES:
    print(label, attempt(calls))
'''

# The sandbox's root, bound here so pytest finds the fixture for this module's tests.
root = sandbox_env.root


def probes(calls: dict[str, list[tuple[str | bytes, list[object]]]]) -> str:
    """The probe program for ``label -> [(syscall name or x86 machine code, args)]``, numbered for this host."""
    column = 0 if platform.machine() in ("x86_64", "amd64") else 1
    numbered = [(label, [(seccomp.SYSCALLS[c][column] if isinstance(c, str) else c, args) for c, args in seq])
                for label, seq in calls.items()]
    return f"PROBES = {numbered!r}\n" + PROBE


def test_seccomp_refuses_what_a_sandbox_never_needs(root: Path) -> None:
    column = 0 if platform.machine() in ("x86_64", "amd64") else 1
    calls: dict[str, list[tuple[str | bytes, list[object]]]] = {
        name: [(name, DENIED_ARGS.get(name, [0, 0, 0, 0, 0, 0]))]
        for name in seccomp.DENIED if seccomp.SYSCALLS[name][column] is not None
    }
    calls["unshare(CLONE_NEWUSER)"] = [("unshare", [CLONE_NEWUSER])]
    calls["mount in a new user namespace"] = [("unshare", [CLONE_NEWUSER | CLONE_NEWNS]),
                                              ("mount", [b"none", b"/tmp", b"tmpfs", 0, 0])]
    for flag, bit in NEW_FLAGS.items():  # CLONE_SIGHAND without CLONE_VM: EINVAL, if the kernel sees it
        calls[f"clone(CLONE_{flag})"] = [("clone", [bit | CLONE_SIGHAND, 0, 0, 0, 0])]
    calls["clone3"] = [("clone3", [0, 0])]
    calls["personality(ADDR_NO_RANDOMIZE)"] = [("personality", [0x0040000])]
    denied = set(calls)
    calls["clone(CLONE_SIGHAND)"] = [("clone", [CLONE_SIGHAND, 0, 0, 0, 0])]  # reaches the kernel: EINVAL
    calls["personality(query)"] = [("personality", [0xFFFFFFFF])]
    if column == 0:  # i386 getpid by int 0x80; x32 getpid by syscall: another ABI kills
        calls["i386 syscall"] = [(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3", [])]
        calls["x32 syscall"] = [(b"\xb8\x27\x00\x00\x40\x0f\x05\xc3", [])]
    result = run(root, probes(calls), timeout_s=60)
    assert result.exit_code == 0, logs(result)
    got = dict(line.rsplit(" ", 1) for line in logs(result).splitlines())
    want = {label: str(errno.ENOSYS if label == "clone3" else errno.EPERM) for label in denied}
    want |= {"clone(CLONE_SIGHAND)": str(errno.EINVAL), "personality(query)": "0"}
    if column == 0:
        want |= {"i386 syscall": str(-signal.SIGSYS), "x32 syscall": str(-signal.SIGSYS)}
    assert {k: int(v) for k, v in got.items()} == {k: int(v) for k, v in want.items()}


def test_ordinary_python_works_under_the_filter(root: Path) -> None:
    code = (
        "import os, subprocess, sys, threading, concurrent.futures as cf, multiprocessing as mp\n"
        "print([l for l in open('/proc/self/status').read().splitlines() if l.startswith(('NoNewPrivs', 'Seccomp'))])\n"
        "out = []\nt = threading.Thread(target=out.append, args=('thread',))\nt.start()\nt.join()\nprint(*out)\n"
        "print(list(cf.ThreadPoolExecutor(4).map(abs, [-1, -2, -3, -4])))\n"
        "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.strip())\n"
        "pid = os.posix_spawn(sys.executable, [sys.executable, '-c', 'print(\"spawned\")'], {})\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "with mp.get_context('fork').Pool(2) as pool:\n    print(pool.map(abs, [-5, -6]))\n"
        "os.makedirs('sub', exist_ok=True)\nopen('/mnt/data/sub/f.txt', 'w').write('kept')\n"
        "os.mkfifo('/tmp/fifo')\nprint(sorted(os.listdir('/tmp')), open('sub/f.txt').read())\n"
    )
    result = run(root, code)
    assert logs(result).splitlines() == [
        "['NoNewPrivs:\\t1', 'Seccomp:\\t2', 'Seccomp_filters:\\t1']",
        "thread", "[1, 2, 3, 4]", "42", "spawned", "0", "[5, 6]", "['fifo'] kept",
    ], logs(result)
    assert (folder(root, "c1") / "sub" / "f.txt").read_text() == "kept"


def bpf_verdict(program: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """What the kernel's classic BPF would return for one syscall (the few opcodes ``seccomp`` emits)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)  # struct seccomp_data
    code = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x06:
            return k
        if op == 0x20:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
            continue
        taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
        pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_filter_program_per_architecture(machine: str) -> None:
    # Both architectures' programs, whatever this host is: what each syscall gets.
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
    column, arch, foreign = (0, 0xC000003E, [0x40000003]) if machine == "x86_64" else (1, 0xC00000B7, [0x40000028])
    program = seccomp.program(machine)
    assert program is not None
    nr = {name: numbers[column] for name, numbers in seccomp.SYSCALLS.items()}
    for name in seccomp.DENIED:
        if nr[name] is not None:
            assert bpf_verdict(program, arch, nr[name]) == eperm, name
    assert bpf_verdict(program, arch, nr["clone3"]) == enosys
    for bit in NEW_FLAGS.values():
        assert bpf_verdict(program, arch, nr["clone"], bit | 17) == eperm
    threads = 0x3D0F00  # glibc's pthread_create: VM, FS, FILES, SIGHAND, THREAD, SYSVSEM, SETTLS, *_TID
    for flags in (17, 0x01200011, threads, 0x4111):  # fork, fork with tids, threads, vfork
        assert bpf_verdict(program, arch, nr["clone"], flags) == allow
    assert [bpf_verdict(program, arch, nr["personality"], p) for p in (0, 0xFFFFFFFF, 0x0040000, 0x0400000)] == [
        allow, allow, eperm, eperm]
    for ordinary in ((0, 1, 2, 3, 39, 57, 59, 231) if column == 0 else (63, 64, 56, 57, 172, 221, 94)):
        assert bpf_verdict(program, arch, ordinary) == allow  # read, write, openat, close, getpid, execve, exit_group ...
    for other_abi in foreign:  # i386 on x86_64, arm32 on aarch64
        assert bpf_verdict(program, other_abi, 20) == kill
    if column == 0:
        assert bpf_verdict(program, arch, 0x40000000 | 39) == kill  # x32
    assert seccomp.program("riscv64") is None


def test_no_filter_for_the_architecture_refuses(root: Path) -> None:
    ci = CodeInterpreter(root, SandboxLimits())
    ci._seccomp = None  # what a host without a filter program gets
    result = asyncio.run(ci.run("open('ran', 'w').close()", "c1", OWNER))
    assert result.exit_code is None and result.outputs == [] and "no seccomp filter" in (result.error or "")
    assert not (folder(root, "c1") / "ran").exists()


def test_failed_seccomp_refuses(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = sandbox_mod.LAUNCHER.replace("libc.prctl(22,", "libc.prctl(-22,")  # no such option: EINVAL
    assert broken != sandbox_mod.LAUNCHER
    monkeypatch.setattr(sandbox_mod, "LAUNCHER", broken)
    result = run(root, "open('ran', 'w').close()")
    assert result.exit_code is None and result.outputs == [] and "refused" in (result.error or "")
    assert "installing the seccomp filter failed" in (result.error or "")
    assert not (folder(root, "c1") / "ran").exists()
