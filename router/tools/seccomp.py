"""The code interpreter's seccomp filter: syscalls a sandbox never needs fail with EPERM.

Namespaces and an unprivileged uid do not close the kernel's other doors: a non-root process
may still make a user namespace (and inside it mount file systems and reach code that is
otherwise behind CAP_SYS_ADMIN), trace its own processes, use keyrings, io_uring, userfaultfd,
BPF or perf. Python code needs none of them, so PID 1 of a run installs this filter (with
``PR_SET_NO_NEW_PRIVS``) right before it execs the interpreter; it holds for every process of
the run and cannot be lifted. Denied calls return EPERM, so the code gets an ``OSError``, not a
dead process; ``clone3`` returns ENOSYS, so libc falls back to ``clone``, whose flags a classic
BPF filter can read (``clone3`` passes them in memory, which the filter cannot see). A syscall
of another ABI (i386 or x32 on x86_64, arm32 on aarch64) kills the process: the numbers below
mean nothing there.

``program(machine)`` gives the filter as the bytes of its ``sock_filter`` array, built here in
the router; the launcher in the sandbox only hands them to ``prctl``. Hand-written classic BPF
rather than libseccomp: no new dependency, and the whole policy fits on one screen.
"""

from __future__ import annotations

import errno
import struct
import sys

__all__ = ["CLONE_NEW_FLAGS", "DENIED", "PERSONALITY_ALLOWED", "SYSCALLS", "program"]

# name -> (x86_64, aarch64); None: the architecture has no such call. aarch64 uses the
# asm-generic numbers; calls from 403 on are numbered alike everywhere.
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    # namespaces and mounts
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "open_tree": (428, 428), "move_mount": (429, 429),
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    # other processes' memory and state
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_getfd": (438, 438), "process_madvise": (440, 440),
    "move_pages": (279, 239), "migrate_pages": (256, 238),
    # kernel programs, modules, keys, tracing
    "bpf": (321, 280), "perf_event_open": (298, 241), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "lookup_dcookie": (212, 18), "syslog": (103, 116), "create_module": (174, None),
    "get_kernel_syms": (177, None), "query_module": (178, None), "uselib": (134, None),
    "_sysctl": (156, None), "nfsservctl": (180, 42), "sysfs": (139, None), "ustat": (136, None),
    # file handles, fanotify, userfaultfd, io_uring
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "fanotify_init": (300, 262),
    "userfaultfd": (323, 282), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    # the host's administration: swap, power, accounting, quotas, clocks, names
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "quotactl": (179, 60), "quotactl_fd": (443, 443), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "sethostname": (170, 161), "setdomainname": (171, 162), "vhangup": (153, 58),
    # x86 hardware access
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None),
    # checked below, not in DENIED
    "clone": (56, 220), "clone3": (435, 435), "personality": (135, 92),
}
DENIED = tuple(name for name in SYSCALLS if name not in ("clone", "clone3", "personality"))
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME exists only
# for unshare and clone3: in clone's flags 0x80 is part of the exit signal).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# PER_LINUX and the query: a persona such as ADDR_NO_RANDOMIZE would weaken what the run execs.
PERSONALITY_ALLOWED = (0, 0xFFFFFFFF)

_ARCH = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7), "arm64": (1, 0xC00000B7)}
_X32_BIT = 0x40000000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_NR, _ARCH_OFF, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data; _ARG0: the low word (little-endian)


def program(machine: str) -> bytes | None:
    """The filter for ``machine`` (``platform.machine()``) as packed ``sock_filter``s; None: not supported."""
    if machine not in _ARCH or sys.byteorder != "little":
        return None
    column, audit_arch = _ARCH[machine]
    code: list[tuple[int, str | int, str | int, int]] = []  # (op, jump if true, jump if false, k)

    def ins(op: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        code.append((op, jt, jf, k))

    ins(_LD_W_ABS, _ARCH_OFF)
    ins(_JEQ, audit_arch, 0, "kill")
    ins(_LD_W_ABS, _NR)
    if column == 0:
        ins(_JGE, _X32_BIT, "kill", 0)
    for name in DENIED:
        nr = SYSCALLS[name][column]
        if nr is not None:
            ins(_JEQ, nr, "eperm", 0)
    clone3, personality, clone = (SYSCALLS[name][column] for name in ("clone3", "personality", "clone"))
    assert clone3 is not None and personality is not None and clone is not None  # on both architectures
    ins(_JEQ, clone3, "enosys", 0)
    ins(_JEQ, personality, "personality", 0)
    ins(_JEQ, clone, 0, "allow")
    ins(_LD_W_ABS, _ARG0)  # clone's flags
    ins(_JSET, CLONE_NEW_FLAGS, "eperm", "allow")
    labels = {"personality": len(code)}
    ins(_LD_W_ABS, _ARG0)  # the persona, an unsigned int
    for allowed in PERSONALITY_ALLOWED:
        ins(_JEQ, allowed, "allow", 0)
    for label, action in (("eperm", _ERRNO | errno.EPERM), ("allow", _ALLOW),  # any other persona: EPERM
                          ("enosys", _ERRNO | errno.ENOSYS), ("kill", _KILL_PROCESS)):
        labels[label] = len(code)
        ins(_RET, action)
    out = bytearray()
    for i, (op, jt, jf, k) in enumerate(code):
        jumps = [labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        assert all(0 <= j <= 255 for j in jumps), "a jump past what classic BPF can encode"
        out += struct.pack("=HBBI", op, jumps[0], jumps[1], k)
    return bytes(out)
