"""The code interpreter's sandbox: results, persistence, images, and every limit enforced (its
system-call filter: tests/unit/test_sandbox_seccomp.py)."""

from __future__ import annotations

import ast
import asyncio
import base64
import os
import shutil
import socket
import sqlite3
import tempfile
import uuid
from pathlib import Path

import pytest

from router.tools import code_interpreter as ci_mod
from router.tools import sandbox as sandbox_mod
from router.tools.code_interpreter import CodeInterpreter, CodeResult, SandboxLimits
from tests.support import sandbox_env
from tests.support.sandbox_env import OWNER, folder, logs, run, sandbox_pids, tiny_png

# The sandbox's root, bound here so pytest finds the fixture for this module's tests.
root = sandbox_env.root


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
    assert sorted(os.listdir(root)) == sorted([".newroot", ".uids", folder(root, "project-x", "key-a").name])  # none named by the id
    assert sorted(os.listdir(root / ".uids")) == [str(uid_a)]  # B's closed: its uid is free again
    assert folder(root, "project-x", "key-a") != folder(root, "project-x", "key-b")


def test_two_containers_never_share_a_uid(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key hashes to the same first uid here: each container still runs as a uid of its own
    (claimed in root/.uids), keeps it across runs and a new CodeInterpreter (a restart), and a closed
    container's uid is taken by the next one that needs it."""
    base = ci_mod._UID_BASE + 7
    monkeypatch.setattr(ci_mod, "_sandbox_uid", lambda key: base)
    whoami = "import os\nprint(os.getuid())"

    async def go() -> list[int]:
        ci = CodeInterpreter(root, SandboxLimits())
        first = [int(logs(await ci.run(whoami, name, OWNER))) for name in ("a", "b", "c")]
        again = CodeInterpreter(root, SandboxLimits())
        kept = [int(logs(await again.run(whoami, name, OWNER))) for name in ("c", "a")]
        await again.close_container("b", OWNER)
        reused = int(logs(await again.run(whoami, "d", OWNER)))
        return [*first, *kept, reused]

    a, b, c, c_again, a_again, d = asyncio.run(go())
    assert [a, b, c] == [base, base + 1, base + 2]
    assert (c_again, a_again) == (c, a)
    assert d == b  # b's, released when b closed
    assert {p.name: p.read_text() for p in (root / ".uids").iterdir()} == {
        str(a): folder(root, "a").name, str(c): folder(root, "c").name, str(d): folder(root, "d").name}


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
        checkout = Path(__file__).resolve().parents[2]
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
