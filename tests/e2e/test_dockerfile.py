"""The Dockerfile's promises, and its steps replayed without a container engine.

This machine has the Docker client but no engine, so the image is not built
here. Instead its own lines are read and replayed: its COPY sources copied
into a fresh folder, its RUN install step run in a fresh virtualenv, its
config copied as it says, its ENTRYPOINT + CMD started in the user's folder,
and its HEALTHCHECK command run against it. (As the test's own user: this
machine's interpreter lies in root's home, which no other user may enter;
that the image runs as a user of its own is read from its USER line.)
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ROOT, free_port, free_range

pytestmark = pytest.mark.e2e

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each line, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _one(name: str) -> str:
    found = [rest for word, rest in _instructions() if word == name]
    assert len(found) == 1, (name, found)
    return found[0]


def test_the_image_is_slim_unprivileged_and_checked() -> None:
    assert re.fullmatch(r"python:3\.1[1-9]-slim", _one("FROM"))
    user = _one("USER")
    assert user not in ("root", "0")
    assert "/health" in _one("HEALTHCHECK")
    assert _one("EXPOSE") == "8080"
    for word, rest in _instructions():
        if word == "COPY":
            sources = [s for s in shlex.split(rest) if not s.startswith("--")][:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def _cmd_args(instruction: str) -> list[str]:
    value = json.loads(_one(instruction))
    assert isinstance(value, list)
    return value


def test_the_dockerfile_steps_install_and_serve(tmp_path: Path) -> None:
    """Replay: WORKDIR + COPY into ``app``, RUN its pip install into a fresh venv, the config where
    the Dockerfile puts it, then the ENTRYPOINT + CMD in the user's folder, and HEALTHCHECK."""
    app, home, venv = tmp_path / "app", tmp_path / "home", tmp_path / "venv"
    app.mkdir()
    home.mkdir()
    config_target = None
    for word, rest in _instructions():
        if word != "COPY":
            continue
        parts = shlex.split(rest)
        args = [p for p in parts if not p.startswith("--")]
        *sources, target = args
        for source in sources:
            if target.startswith("/var/lib/responses-router"):
                config_target = home / Path(target).name
                shutil.copy(ROOT / source, config_target)
            elif (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, app / Path(source).name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / source, app / Path(source).name)
    assert config_target is not None, "the Dockerfile copies no config"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    runs = [rest for word, rest in _instructions() if word == "RUN" and "pip install" in rest]
    assert len(runs) == 1
    install = runs[0].replace("python -m pip", f"{venv}/bin/python -m pip")
    done = subprocess.run(install, shell=True, cwd=app, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    first, last = free_range()
    config_target.write_text(config_target.read_text().replace("port_range = [18100, 18199]",
                                                               f"port_range = [{first}, {last}]"))
    port = free_port()
    command = [f"{venv}/bin/{_cmd_args('ENTRYPOINT')[0]}",
               *[str(config_target) if a.startswith("/var/lib/") else a for a in _cmd_args("CMD")]]
    command[command.index("--host") + 1] = "127.0.0.1"  # the container's 0.0.0.0, kept to loopback here
    command += ["--port", str(port)]
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        check = _one("HEALTHCHECK").split(" CMD ", 1)[1].replace("8080", str(port))
        deadline = time.monotonic() + 60
        while True:
            healthy = subprocess.run(check.replace("python ", f"{venv}/bin/python ", 1), shell=True, env=env,
                                     capture_output=True).returncode == 0
            if healthy or proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert healthy, (tmp_path / "router.log").read_text()[-3000:]
        assert (home / "var" / "responses.db").exists()  # the store lies in the user's own folder
    finally:
        proc.terminate()
        proc.wait(timeout=20)
