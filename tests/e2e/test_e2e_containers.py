"""Code-interpreter containers belong to the API key that uses them, through a real router.

A container id is a name in the calling key's own namespace: another key naming the same id
(a chosen one like "project-x", or an auto ``cntr_...`` id it learned) gets a container of its
own, empty, in another folder and under another uid, and never A's files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import ROOT, RouterProcess, free_port, http_status, start_router

pytestmark = pytest.mark.e2e

KEY_A = "sk-containers-key-a-1"
KEY_B = "sk-containers-key-b-2"
MODEL = "sim-chat"
# What the sandbox runs for each step: who it runs as, what the folder holds, and the note if any.
SHOW = ("import os\nprint('uid', os.getuid())\nprint('files', sorted(os.listdir('.')))\n"
        "print('note', open('note.txt').read() if os.path.exists('note.txt') else None)\n")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "tests.e2e.sim_code", "--port", str(port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    containers = Path(tempfile.mkdtemp(prefix="rr-owned-containers-"))
    try:
        deadline = time.monotonic() + 20
        while http_status(f"http://127.0.0.1:{port}/health") != 200:
            assert worker.poll() is None and time.monotonic() < deadline, "the code sim did not start"
            time.sleep(0.05)
        body = f"""
[[pools]]
name = "sim"
engine = "sim"
model = "sim-model"
urls = ["http://127.0.0.1:{port}"]
health_interval_s = 0.5

[[models]]
name = "{MODEL}"
pool = "sim"

[auth]
keys = [{{ name = "a", key = "{KEY_A}" }}, {{ name = "b", key = "{KEY_B}" }}]

[tools.code_interpreter]
root = "{containers}"
timeout_s = 20
"""
        proc = start_router(tmp_path_factory.mktemp("containers"), body)
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        worker.terminate()
        worker.wait()
        shutil.rmtree(containers, ignore_errors=True)


def client(router: RouterProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def run(c: openai.OpenAI, code: str, container: Any) -> tuple[str, str]:
    """Run ``code`` through the model's python call: (the container id the call ran in, its logs)."""
    response = c.responses.create(model=MODEL, input=f"[sim:call=python] CODE:{code}",
                                  tools=[{"type": "code_interpreter", "container": container}],
                                  include=["code_interpreter_call.outputs"])
    call = next(item for item in response.output if item.type == "code_interpreter_call")
    assert call.status == "completed" and call.code == code, call
    return call.container_id, "".join(o.logs for o in call.outputs or () if o.type == "logs")


def fields(logs: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in logs.splitlines())


def test_a_named_container_is_the_keys_own(router: RouterProcess) -> None:
    a, b = client(router, KEY_A), client(router, KEY_B)
    run(a, "open('note.txt', 'w').write('from a')", "project-x")
    seen_by_a = fields(run(a, SHOW, "project-x")[1])
    assert seen_by_a["note"] == "from a"
    seen_by_b = fields(run(b, SHOW + "open('note.txt', 'w').write('from b')\n", "project-x")[1])
    assert seen_by_b["files"] == "[]" and seen_by_b["note"] == "None"  # B's "project-x" is another, empty container
    assert seen_by_b["uid"] != seen_by_a["uid"]  # under another uid
    assert fields(run(a, SHOW, "project-x")[1])["note"] == "from a"  # B's write did not land in A's folder
    assert fields(run(b, SHOW, "project-x")[1])["note"] == "from b"  # and B's container keeps B's files


def test_an_auto_container_id_is_not_reachable_by_another_key(router: RouterProcess) -> None:
    a, b = client(router, KEY_A), client(router, KEY_B)
    auto_id, _ = run(a, "open('note.txt', 'w').write('secret of a')", {"type": "auto"})
    assert auto_id.startswith("cntr_")
    assert fields(run(a, SHOW, auto_id)[1])["note"] == "secret of a"  # the id reaches A's container again
    ran_in, logs = run(b, SHOW + "open('note.txt', 'w').write('overwritten by b')\n", auto_id)
    assert ran_in == auto_id and fields(logs)["files"] == "[]" and fields(logs)["note"] == "None"
    assert fields(run(a, SHOW, auto_id)[1])["note"] == "secret of a"


# What model code tries that a sandbox never needs: each line prints the call and its errno.
ESCAPES = """import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, result):
    print(name, errno.errorcode.get(ctypes.get_errno(), 'ok') if result == -1 else 'ok')
tried('unshare', libc.unshare(0x10000000))  # CLONE_NEWUSER
tried('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))
tried('ptrace', libc.ptrace(16, 1, None, None))  # PTRACE_ATTACH to PID 1
tried('keyctl', libc.syscall(250 if os.uname().machine == 'x86_64' else 219, 0, 0, 0, 0, 0))
"""


def test_model_code_cannot_make_namespaces_mount_or_trace(router: RouterProcess) -> None:
    """The seccomp filter, through the router: code the model writes gets EPERM for each escape."""
    logs = fields(run(client(router, KEY_A), ESCAPES, "escapes")[1])
    assert logs == {"unshare": "EPERM", "mount": "EPERM", "ptrace": "EPERM", "keyctl": "EPERM"}, logs
