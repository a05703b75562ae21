"""The code interpreter's sandbox: results, persistence, images, and every limit enforced."""

from __future__ import annotations

import ast
import asyncio
import base64
import errno
import os
import platform
import shutil
import signal
import socket
import sqlite3
import struct
import tempfile
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.tools import code_interpreter as ci_mod
from router.tools import sandbox as sandbox_mod
from router.tools import seccomp
from router.tools.code_interpreter import CodeInterpreter, CodeResult, SandboxLimits


@pytest.fixture
def root() -> Iterator[Path]:
    # Under a 0700 folder on purpose: the container folder is bound into the sandbox's own
    # root, so no host path needs to be open to the sandbox uid.
    path = Path(tempfile.mkdtemp(prefix="ci-test-")) / "root"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


OWNER = "key-1"  # the API key's name a container belongs to


def folder(root: Path, container: str, owner: str = OWNER) -> Path:
    return root / ci_mod._container_key(owner, container)


def run(root: Path, code: str, container: str = "c1", owner: str = OWNER, **limits: float) -> CodeResult:
    return asyncio.run(CodeInterpreter(root, SandboxLimits(**limits)).run(code, container, owner))  # type: ignore[arg-type]


def logs(result: CodeResult) -> str:
    return "".join(o["logs"] for o in result.outputs if o["type"] == "logs")


def sandbox_pids(container: str) -> list[int]:
    """Live processes of the container's uid: after a run there must be none."""
    uid = ci_mod._sandbox_uid(ci_mod._container_key(OWNER, container))
    pids = []
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid and "State:\tZ" not in status:
                pids.append(int(entry))
    return pids


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")


def test_print(root: Path) -> None:
    result = run(root, "print('hello', 6 * 7)")
    assert result == CodeResult([{"type": "logs", "logs": "hello 42\n"}], 0, False, None)


def test_traceback_and_exit_code(root: Path) -> None:
    result = run(root, "def f():\n    raise KeyError('boom')\nf()")
    assert result.exit_code == 1 and not result.timed_out
    assert "Traceback (most recent call last)" in logs(result) and "KeyError: 'boom'" in logs(result)


def test_isolation(root: Path) -> None:
    code = (
        "import os, sys\n"
        "print(sorted(os.environ), sys.flags.isolated, sys.flags.no_site, os.getuid() != 0, os.getcwd())\n"
        "try:\n    input()\nexcept EOFError:\n    print('stdin at EOF')\n"
    )
    out = logs(run(root, code))
    assert out == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR'] 1 1 True /mnt/data\nstdin at EOF\n"


def test_state_persists_per_container(root: Path) -> None:
    async def go() -> list[CodeResult]:
        ci = CodeInterpreter(root, SandboxLimits())
        write = await ci.run("open('note.txt', 'w').write('kept')", "a", OWNER)
        read_same = await ci.run("print(open('note.txt').read())", "a", OWNER)
        read_other = await ci.run("import os; print(os.path.exists('note.txt'))", "b", OWNER)
        peek = await ci.run(f"print(open({str(folder(root, 'a') / 'note.txt')!r}).read())", "b", OWNER)
        await ci.close_container("a", OWNER)
        return [write, read_same, read_other, peek]

    write, read_same, read_other, peek = asyncio.run(go())
    assert write.exit_code == 0
    assert logs(read_same) == "kept\n"
    assert logs(read_other) == "False\n"
    assert "FileNotFoundError" in logs(peek)  # another container's folder is not even in its root
    assert not folder(root, "a").exists() and folder(root, "b").exists()


def test_the_same_id_under_two_owners_is_two_containers(root: Path) -> None:
    show = "import os\nprint(os.getuid(), sorted(os.listdir('.')))"

    async def go() -> list[CodeResult]:
        ci = CodeInterpreter(root, SandboxLimits())
        await ci.run("open('note.txt', 'w').write('of a')", "project-x", "key-a")
        seen_by_b = await ci.run(show, "project-x", "key-b")
        await ci.close_container("project-x", "key-b")  # B closes its own, never A's
        seen_by_a = await ci.run(show + "\nprint(open('note.txt').read())", "project-x", "key-a")
        return [seen_by_a, seen_by_b]

    seen_by_a, seen_by_b = asyncio.run(go())
    uid_a, uid_b = (ci_mod._sandbox_uid(ci_mod._container_key(o, "project-x")) for o in ("key-a", "key-b"))
    assert uid_a != uid_b
    assert logs(seen_by_b) == f"{uid_b} []\n"
    assert logs(seen_by_a) == f"{uid_a} ['note.txt']\nof a\n"
    assert sorted(os.listdir(root)) == sorted([".newroot", folder(root, "project-x", "key-a").name])  # none named by the id
    assert folder(root, "project-x", "key-a") != folder(root, "project-x", "key-b")


def test_png_comes_back_as_image(root: Path) -> None:
    png = tiny_png()

    async def go() -> tuple[CodeResult, CodeResult]:
        ci = CodeInterpreter(root, SandboxLimits())
        first = await ci.run(f"open('plot.png', 'wb').write({png!r})\nprint('saved')", "c1", OWNER)
        again = await ci.run("print('nothing new')", "c1", OWNER)
        return first, again

    first, again = asyncio.run(go())
    images = [o for o in first.outputs if o["type"] == "image"]
    assert images == [{"type": "image", "url": "data:image/png;base64," + base64.b64encode(png).decode()}]
    assert logs(first) == "saved\n"
    assert [o["type"] for o in again.outputs] == ["logs"]  # only files written during the run


def test_png_symlink_is_not_followed(root: Path) -> None:
    result = run(root, "import os; os.symlink('/etc/passwd', 'leak.png')")
    assert result.exit_code == 0 and all(o["type"] != "image" for o in result.outputs)


def test_timeout_kills_an_infinite_loop(root: Path) -> None:
    result = run(root, "print('started', flush=True)\nwhile True:\n    pass", timeout_s=2.0)
    assert result.timed_out and result.exit_code is not None and result.exit_code < 0
    assert "timed out" in (result.error or "") and logs(result) == "started\n"
    assert sandbox_pids("c1") == []


def test_timeout_kills_processes_that_leave_the_group(root: Path) -> None:
    # Sleepers, so the CPU limit cannot be what ends them: only PDEATHSIG + the PID namespace.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\n"
        "os.setsid()\ntime.sleep(300)\n"
    )
    result = run(root, code, timeout_s=2.0)
    assert result.timed_out
    assert sandbox_pids("c1") == []


def test_no_network(root: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        code = (
            "import ctypes, socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=2)\n        print('CONNECTED', addr)\n"
            "    except OSError as e:\n        print('blocked', addr, e)\n"
            "try:\n    fd = open('/proc/1/ns/net')\nexcept OSError as e:\n    print('no setns:', e)\n"
            "else:\n    print('setns', ctypes.CDLL(None).setns(fd.fileno(), 0))\n"
        )
        out = logs(run(root, code))
    assert "CONNECTED" not in out and out.count("blocked") == 2, out
    assert "no setns" in out or "setns -1" in out, out


def test_refuses_without_network_namespace(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class NoUnshare:
        def unshare(self, flags: int) -> int:
            return -1

    monkeypatch.setattr(sandbox_mod, "_libc", NoUnshare())
    result = run(root, "open('ran', 'w').close()")
    assert result.exit_code is None and result.outputs == [] and "refused" in (result.error or "")
    assert "unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID" in (result.error or "")
    assert not (folder(root, "c1") / "ran").exists()


def test_memory_hog(root: Path) -> None:
    result = run(root, "b = bytearray(2 * 1024**3)\nprint('allocated')")
    assert result.exit_code != 0 and "MemoryError" in logs(result) and "allocated" not in logs(result)
    assert run(root, "print('fine')").exit_code == 0


def test_cpu_limit(root: Path) -> None:
    result = run(root, "while True:\n    pass", cpu_s=1, timeout_s=30.0)
    assert not result.timed_out and result.exit_code == -9 and "CPU" in (result.error or "")


def test_process_limit(root: Path) -> None:
    code = (
        "import os, time\nn = 0\n"
        "try:\n    for _ in range(200):\n"
        "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('stopped at', n, e.errno)\n"
    )
    out = logs(run(root, code, max_procs=10))
    assert out.startswith("stopped at") and int(out.split()[2]) < 10, out
    assert sandbox_pids("c1") == []  # the sleepers died with PID 1


def test_fork_bomb(root: Path) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run(root, bomb, timeout_s=3.0)
    assert result.timed_out
    assert sandbox_pids("c1") == []
    assert run(root, "print('alive')").exit_code == 0


def test_output_flood_is_truncated(root: Path) -> None:
    result = run(root, "import sys\nfor _ in range(100):\n    print('x' * 1_000_000)\nprint('done', file=sys.stderr)")
    out = logs(result)
    assert result.exit_code == 0 and not result.timed_out
    assert len(out) < 64_000 + 200 and out.startswith("x" * 1000)
    assert "[output truncated: " in out and str(100 * 1_000_001 + 5 - 64_000) in out


def test_file_limits(root: Path) -> None:
    big = run(root, "open('big', 'wb').write(b'x' * (2 << 20))", max_files_mb=1)
    assert big.exit_code == 1 and "File too large" in logs(big)
    many = run(root, "for i in range(3):\n    open(f'f{i}', 'wb').write(b'x' * 400_000)", max_files_mb=1)
    assert "over 1 MB" in (many.error or "")
    assert sorted(os.listdir(folder(root, "c1"))) == ["big"]  # this run's files were removed


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "a b", "a\n", "x" * 65, ".", "é"])
def test_bad_container_id(root: Path, bad: str) -> None:
    ci = CodeInterpreter(root, SandboxLimits())
    with pytest.raises(ValueError):
        asyncio.run(ci.run("print(1)", bad, OWNER))
    with pytest.raises(ValueError):
        asyncio.run(ci.close_container(bad, OWNER))


def test_cancelled_run_leaves_nothing(root: Path) -> None:
    async def go() -> None:
        ci = CodeInterpreter(root, SandboxLimits(timeout_s=60))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ci.run("import time\ntime.sleep(60)", "c1", OWNER), 1.5)

    asyncio.run(go())
    assert sandbox_pids("c1") == []


def test_containers_run_concurrently(root: Path) -> None:
    async def go() -> list[CodeResult]:
        ci = CodeInterpreter(root, SandboxLimits())
        return await asyncio.gather(*(ci.run(f"print({i})", f"c{i}", OWNER) for i in range(4)))

    assert [logs(r) for r in asyncio.run(go())] == ["0\n", "1\n", "2\n", "3\n"]


def probe(paths: list[str]) -> str:
    """Program text that prints, per path, 'missing', 'denied' or what it found (a listing or the start of the file)."""
    return (
        "import os\n"
        f"for p in {paths!r}:\n"
        "    try:\n"
        "        print(p, sorted(os.listdir(p)) if os.path.isdir(p) else open(p).read()[:60].rstrip())\n"
        "    except FileNotFoundError:\n        print(p, 'missing')\n"
        "    except PermissionError:\n        print(p, 'denied')\n"
    )


def test_host_files_are_invisible(root: Path) -> None:
    # A world-readable folder and files on the host, a SQLite store among them: none may show.
    host = Path(tempfile.mkdtemp(prefix="ci-host-"))
    try:
        host.chmod(0o755)
        (host / "secret.txt").write_text("host secret")
        db = host / "store.db"
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE t (x TEXT)")
        for f in (host / "secret.txt", db):
            f.chmod(0o644)
        checkout = Path(__file__).resolve().parents[1]
        paths = ["/etc/hostname", "/etc/shadow", "/etc/hosts", str(host), str(host / "secret.txt"), str(db),
                 str(checkout), str(checkout / "pyproject.toml"), "/work", "/home", "/var", "/sys", "/boot",
                 str(root), str(folder(root, "c1"))]
        out = logs(run(root, probe(paths)))
        assert out.splitlines() == [f"{p} missing" for p in paths]
        assert "host secret" in (host / "secret.txt").read_text()  # it was readable to anyone on the host
    finally:
        shutil.rmtree(host)


def test_root_holds_only_the_interpreter_and_the_system(root: Path) -> None:
    ci = CodeInterpreter(root, SandboxLimits())
    code = probe(["/", "/etc", "/etc/passwd", "/etc/group", "/root", "/mnt", "/dev"]) + (
        "import pwd\nprint('me', pwd.getpwuid(os.getuid()).pw_name)\n"
        "print('urandom', len(open('/dev/urandom', 'rb').read(8)), 'null', open('/dev/null', 'w').write('x'))\n"
        "for p in ['/x', '/etc/passwd', '/usr/evil', '/dev/evil', '/proc/evil']:\n"
        "    try:\n        open(p, 'w')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('read-only', p, e.errno)\n"
    )
    uid = ci_mod._sandbox_uid(ci_mod._container_key(OWNER, "c1"))
    out = logs(asyncio.run(ci.run(code, "c1", OWNER))).splitlines()
    # The prefixes of an interpreter that lives outside /usr appear as bare paths, nothing beside them.
    under_root = sorted({p.split("/")[2] for p in ci._prefixes if p.startswith("/root/")})
    tops = sorted({"dev", "etc", "mnt", "proc", "tmp", "usr"} | {p.split("/")[1] for p in ci._prefixes}
                  | {d for d in ("bin", "lib", "lib32", "lib64", "libx32") if os.path.lexists(f"/{d}")})
    assert out[0] == f"/ {tops}"
    assert out[1:7] == [
        "/etc ['group', 'passwd']",
        f"/etc/passwd sandbox:x:{uid}:{uid}:sandbox:/mnt/data:/bin/false",
        f"/etc/group sandbox:x:{uid}:",
        f"/root {under_root}" if under_root else "/root missing",
        "/mnt ['data']",
        "/dev ['fd', 'null', 'random', 'shm', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']",
    ]
    assert out[7:9] == ["me sandbox", "urandom 8 null 1"]
    assert len(out) == 14 and all(line.startswith("read-only ") for line in out[9:]), out


def test_proc_shows_only_the_programs_processes(root: Path) -> None:
    code = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n    time.sleep(30)\n    os._exit(0)\n"
        "print(os.getpid(), child, sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(open('/proc/1/cmdline', 'rb').read().split(b'\\0')[1:3])\n"
        "os.kill(child, 9)\nos.waitpid(child, 0)\n"
    )
    out = logs(run(root, code)).splitlines()
    pid, child = 1, int(out[0].split()[1])
    assert out[0] == f"{pid} {child} [1, {child}]"
    assert out[1] == "[b'-I', b'-S']"  # PID 1 is the program itself: no router, no launcher, no host


def test_tmp_is_private_and_fresh(root: Path) -> None:
    name = f"ci-tmp-{uuid.uuid4().hex}"
    host_marker = Path(tempfile.gettempdir()) / f"{name}-host"
    host_marker.write_text("host")
    host_marker.chmod(0o644)
    try:
        async def go() -> list[CodeResult]:
            ci = CodeInterpreter(root, SandboxLimits(tmp_mb=1))
            write = await ci.run(f"import os\nprint(os.listdir('/tmp'))\nopen('/tmp/{name}', 'w').write('mine')\n"
                                 f"print(open('/tmp/{name}').read())", "a", OWNER)
            again = await ci.run("import os; print(os.listdir('/tmp'))", "a", OWNER)
            other = await ci.run("import os; print(os.listdir('/tmp'))", "b", OWNER)
            full = await ci.run("open('/tmp/big', 'wb').write(b'x' * (2 << 20))", "a", OWNER)
            return [write, again, other, full]

        write, again, other, full = asyncio.run(go())
        assert logs(write) == "[]\nmine\n"
        assert not (Path(tempfile.gettempdir()) / name).exists() and not Path("/tmp", name).exists()
        assert logs(again) == "[]\n" and logs(other) == "[]\n"  # gone with the run; never shared
        assert full.exit_code == 1 and "No space left on device" in logs(full)  # tmp_mb caps it
    finally:
        host_marker.unlink()


def test_scratch_folder_is_mnt_data_and_persists(root: Path) -> None:
    async def go() -> list[CodeResult]:
        ci = CodeInterpreter(root, SandboxLimits())
        write = await ci.run("open('/mnt/data/out.txt', 'w').write('kept')\nopen('rel.txt', 'w').write('too')", "a", OWNER)
        same = await ci.run("import os; print(sorted(os.listdir('/mnt/data')), open('/mnt/data/out.txt').read())", "a", OWNER)
        other = await ci.run("import os; print(sorted(os.listdir('/mnt/data')))", "b", OWNER)
        return [write, same, other]

    write, same, other = asyncio.run(go())
    assert write.exit_code == 0
    assert logs(same) == "['out.txt', 'rel.txt'] kept\n"
    assert logs(other) == "[]\n"
    assert (folder(root, "a") / "out.txt").read_text() == "kept"  # the host folder is what was written


def test_failed_mount_refuses(root: Path) -> None:
    ci = CodeInterpreter(root, SandboxLimits())
    ci._prefixes = [*ci._prefixes, "/no-such-prefix"]
    result = asyncio.run(ci.run("open('ran', 'w').close()", "c1", OWNER))
    assert result.exit_code is None and result.outputs == [] and "refused" in (result.error or "")
    assert "mount /no-such-prefix" in (result.error or "") and "No such file or directory" in (result.error or "")
    assert not (folder(root, "c1") / "ran").exists()


def test_failed_proc_mount_refuses(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = sandbox_mod.LAUNCHER.replace('b"/proc", b"proc"', 'b"/no-such-dir", b"proc"')
    assert broken != sandbox_mod.LAUNCHER
    monkeypatch.setattr(sandbox_mod, "LAUNCHER", broken)
    result = run(root, "open('ran', 'w').close()")
    assert result.exit_code is None and result.outputs == [] and "refused" in (result.error or "")
    assert "sandbox PID 1" in (result.error or "") and "/proc" in (result.error or "")
    assert not (folder(root, "c1") / "ran").exists()


def test_run_memory_is_capped_as_a_whole(root: Path) -> None:
    # Three processes of 80 MB each, all held at once: each is under its own RLIMIT_AS (128 MB),
    # the three together are over the run's cgroup (memory_mb + tmp_mb = 144 MB), so the kernel
    # kills some. Only a cgroup can see the sum: rlimits are per process.
    ci = CodeInterpreter(root, SandboxLimits(memory_mb=128, tmp_mb=16))
    assert ci._cgroups is not None  # as root on this project's machines, the runs get cgroups
    code = (
        "import os\n"
        "go_r, go_w = os.pipe()\nkids = []\n"
        "for _ in range(3):\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(go_w)\n"
        "        block = b'x' * (80 << 20)\n"
        "        os.write(w, b'1')\n"
        "        os.read(go_r, 1)  # hold the memory until every sibling has tried\n"
        "        os._exit(0)\n"
        "    os.close(w)\n"
        "    kids.append((pid, r))\n"
        "held = [os.read(r, 1) == b'1' for _, r in kids]\n"
        "os.close(go_w)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, _ in kids]\n"
        "print(sum(held), codes)\n"
    )
    result = asyncio.run(ci.run(code, "c1", OWNER))
    assert result.exit_code == 0, logs(result)
    codes = ast.literal_eval(logs(result).split(" ", 1)[1])  # a child that held its block may still be picked later
    # Two survivors would have held 160 MB at once: at most one lives, the rest are OOM-killed.
    assert codes.count(0) <= 1 and codes.count(-9) >= 2, logs(result)
    assert not [p for p in ci._cgroups.parents.values() for p in os.listdir(p) if p.startswith("code-interpreter-")]


def test_run_sees_its_own_cgroup_as_the_root(root: Path) -> None:
    out = logs(run(root, "print(open('/proc/self/cgroup').read())"))
    lines = [line for line in out.splitlines() if line]
    assert lines and all(line.endswith(":/") for line in lines), out


def test_prefix_hidden_by_the_sandbox_mounts_refuses(root: Path) -> None:
    ci = CodeInterpreter(root, SandboxLimits())
    ci._prefixes = [*ci._prefixes, "/tmp/some-python"]
    result = asyncio.run(ci.run("open('ran', 'w').close()", "c1", OWNER))
    assert result.exit_code is None and "refused" in (result.error or "") and "would be hidden" in (result.error or "")
    assert not (folder(root, "c1") / "ran").exists()


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
