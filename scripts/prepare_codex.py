#!/usr/bin/env python3
"""Install a pinned Codex CLI from the npm registry, for the Codex end-to-end test.

    python scripts/prepare_codex.py [--cache DIR] [--json]

Installs ``@openai/codex@CODEX_VERSION`` with ``npm install --prefix`` into
``<cache>/codex-<version>`` (``--cache``, else ``$RESPONSES_ROUTER_CACHE``, else
``~/.cache/responses-router``), outside the checkout, and prints the path of the
``codex`` launcher. A marker file written last records a complete install; a folder
without it (an interrupted install) is removed and installed again. Warm, it
checks the marker and returns at once. Concurrent runs wait on a lock file.

What comes from where (checked for 0.171.0): ``@openai/codex`` is a small Node
launcher (``bin/codex.js``) with no dependencies and no install scripts; the native
binary comes in the platform package it names in ``optionalDependencies``
(``@openai/codex-linux-x64`` is ``npm:@openai/codex@0.171.0-linux-x64``, a tarball
on the same registry holding a static musl ``codex`` binary, ``rg`` and a
``bwrap`` for the sandbox). npm runs with ``--ignore-scripts`` anyway, and the
install is checked afterwards: every package in the lockfile is a registry
tarball (an integrity hash, no other source), none declares an install script,
the platform binary is present and ``codex --version`` prints the pinned
version. Nothing is downloaded from elsewhere at install time. At run time Codex
would reach the network for a plugin marketplace sync (``git ls-remote
https://github.com/openai/plugins.git``), connector and plugin look-ups
(api.github.com, chatgpt.com), update checks and analytics;
``tests/support/codex_env.py`` writes a config.toml that turns each of these off
(checked with strace: the only connection left is to the router on loopback).

Importable: ``prepare(cache) -> Prepared`` (raises ``PrepareError`` with the reason).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

CODEX_VERSION = "0.171.0"
PACKAGE = "@openai/codex"
# Bump to force a reinstall when the recipe changes.
INSTALL_RECIPE = 1
MARKER = ".prepared.json"
# node's platform/arch -> the platform package and the Rust target triple inside it (bin/codex.js).
PLATFORMS = {
    ("linux", "x86_64"): ("@openai/codex-linux-x64", "x86_64-unknown-linux-musl"),
    ("linux", "aarch64"): ("@openai/codex-linux-arm64", "aarch64-unknown-linux-musl"),
    ("linux", "arm64"): ("@openai/codex-linux-arm64", "aarch64-unknown-linux-musl"),
    ("darwin", "x86_64"): ("@openai/codex-darwin-x64", "x86_64-apple-darwin"),
    ("darwin", "arm64"): ("@openai/codex-darwin-arm64", "aarch64-apple-darwin"),
}
INSTALL_TIMEOUT_S = 170


class PrepareError(RuntimeError):
    """The installation failed; the message says which step and why."""


@dataclass(frozen=True)
class Prepared:
    version: str
    prefix: Path  # the npm prefix: <cache>/codex-<version>
    launcher: Path  # node_modules/.bin/codex: what `npm install` gives a user to run
    native: Path  # the platform package's binary the launcher execs
    seconds: float  # 0 when warm

    def to_json(self) -> dict[str, object]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def default_cache() -> Path:
    return Path(os.environ.get("RESPONSES_ROUTER_CACHE") or Path.home() / ".cache" / "responses-router")


def _log(msg: str) -> None:
    print(f"[prepare-codex] {msg}", file=sys.stderr, flush=True)


def platform_package() -> tuple[str, str]:
    key = (sys.platform, platform.machine().lower())
    if key not in PLATFORMS:
        raise PrepareError(f"Codex CLI ships no binary for {key[0]}/{key[1]} in {PACKAGE}'s optionalDependencies")
    return PLATFORMS[key]


def paths(prefix: Path) -> tuple[Path, Path]:
    package, triple = platform_package()
    native = prefix / "node_modules" / package / "vendor" / triple / "bin" / "codex"
    return prefix / "node_modules" / ".bin" / "codex", native


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _recipe() -> dict[str, object]:
    return {"install": INSTALL_RECIPE, "package": f"{PACKAGE}@{CODEX_VERSION}", "platform": list(platform_package())}


def _marker_ok(prefix: Path) -> bool:
    try:
        return json.loads((prefix / MARKER).read_text()).get("recipe") == _recipe()
    except (OSError, ValueError, AttributeError):
        return False


def check_install(prefix: Path) -> tuple[Path, Path]:
    """What npm put there came from the registry, runs no install script, and is the pinned version."""
    launcher, native = paths(prefix)
    lock = json.loads((prefix / "package-lock.json").read_text())
    registry = _npm_registry()
    for name, meta in (lock.get("packages") or {}).items():
        if not name:
            continue
        resolved = meta.get("resolved")  # npm leaves it out for the default registry
        if resolved is not None and not resolved.startswith(registry):
            raise PrepareError(f"{name} resolved outside the npm registry {registry}: {resolved!r}")
        if not meta.get("integrity"):
            raise PrepareError(f"{name} has no registry integrity hash: {meta}")
        if meta.get("hasInstallScript"):
            raise PrepareError(f"{name} declares an install script; it would have to download or build something")
        manifest = prefix / name / "package.json"
        if manifest.is_file():
            scripts = json.loads(manifest.read_text()).get("scripts") or {}
            hooks = sorted(set(scripts) & {"preinstall", "install", "postinstall", "prepare"})
            if hooks:
                raise PrepareError(f"{name} has install hooks {hooks}: {scripts}")
    if not native.is_file() or not os.access(native, os.X_OK):
        raise PrepareError(f"the platform binary is missing: {native} (npm did not install {platform_package()[0]})")
    if not launcher.exists():
        raise PrepareError(f"npm made no launcher at {launcher}")
    out = subprocess.run([str(launcher), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0 or CODEX_VERSION not in out.stdout:
        raise PrepareError(f"`codex --version` said {out.stdout.strip()!r} {out.stderr.strip()!r}, "
                           f"expected {CODEX_VERSION}")
    return launcher, native


def _npm_registry() -> str:
    try:
        out = subprocess.run(["npm", "config", "get", "registry"], capture_output=True, text=True, timeout=60,
                             check=False)
    except OSError as exc:
        raise PrepareError(f"npm is not usable: {exc}") from None
    registry = out.stdout.strip() or "https://registry.npmjs.org/"
    return registry if registry.endswith("/") else registry + "/"


def prepare(cache: Path | str | None = None) -> Prepared:
    cache = Path(cache).expanduser() if cache else default_cache()
    prefix = cache / f"codex-{CODEX_VERSION}"
    if shutil.which("npm") is None:
        raise PrepareError("npm is not on PATH (Node.js 18+ with npm installs the Codex CLI)")
    with _locked(cache / f".codex-{CODEX_VERSION}.lock"):
        launcher, native = paths(prefix)
        if _marker_ok(prefix) and native.is_file() and launcher.exists():
            return Prepared(CODEX_VERSION, prefix, launcher, native, 0.0)
        if prefix.exists():
            _log(f"{prefix}: no complete install recorded, removing and installing again")
            shutil.rmtree(prefix)
        prefix.mkdir(parents=True)
        started = time.monotonic()
        argv = ["npm", "install", "--prefix", str(prefix), "--ignore-scripts", "--no-audit", "--no-fund",
                "--no-update-notifier", "--save-exact", "--loglevel=warn", f"{PACKAGE}@{CODEX_VERSION}"]
        _log(f"installing: {' '.join(argv)}")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise PrepareError(f"npm install took over {INSTALL_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise PrepareError(f"npm install failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        launcher, native = check_install(prefix)
        seconds = round(time.monotonic() - started, 1)
        (prefix / MARKER).write_text(json.dumps({"recipe": _recipe(), "seconds": seconds,
                                                 "done_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
        _log(f"installed {PACKAGE}@{CODEX_VERSION} in {seconds} s: {launcher}")
        return Prepared(CODEX_VERSION, prefix, launcher, native, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", help="cache folder (default: $RESPONSES_ROUTER_CACHE or ~/.cache/responses-router)")
    parser.add_argument("--json", action="store_true", help="print what was prepared as JSON")
    args = parser.parse_args(argv)
    try:
        prepared = prepare(args.cache)
    except PrepareError as exc:
        print(f"prepare_codex: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(prepared.to_json(), indent=1) if args.json else prepared.launcher)
    return 0


if __name__ == "__main__":
    sys.exit(main())
