"""The code interpreter's sandbox under test: a throwaway root, and running a program in it
(shared by tests/unit/test_code_interpreter.py and tests/unit/test_sandbox_seccomp.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.tools import code_interpreter as ci_mod
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
