"""The Codex CLI end-to-end environment: the pinned CLI, an isolated CODEX_HOME, and a
recording proxy that shows exactly what Codex sent and what the router answered.

- ``codex_cli`` (session fixture): ``scripts/prepare_codex.py`` installs the pinned
  ``@openai/codex`` from the npm registry into the cache folder once (cold ~15 s,
  warm instant). A failed install FAILS the Codex tests with its reason; they are
  never skipped silently.
- ``write_codex_home``: a CODEX_HOME whose config.toml points a custom model provider
  (``wire_api = "responses"``) at the router and turns off everything that would
  reach the outside: update checks, analytics, feedback, OpenTelemetry, apps and
  connectors, plugins and their marketplace sync, tool suggestions, MCP installs,
  the browser and computer-use tools, image generation, model discovery, the
  background daemon; no retries. The pinned version validates every key
  (``--strict-config``).
- ``RecordingProxy``: a loopback HTTP relay in front of the router that keeps each
  request's method, path, headers and raw body, the router's status and its
  (streamed) answer, and passes the answer on as it arrives.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, Self

import pytest

from harness import ROOT
from tests.support.scripts import load_script

SCRIPT = ROOT / "scripts" / "prepare_codex.py"
API_KEY_ENV = "RESPONSES_ROUTER_CODEX_KEY"
API_KEY = "sk-codex-e2e"
PROVIDER = "responses_router"


def _load_script() -> ModuleType:
    return load_script(SCRIPT)


@pytest.fixture(scope="session")
def codex_cli() -> Any:  # prepare_codex.Prepared
    """The installed pinned Codex CLI (``Prepared``: version, launcher, native, seconds)."""
    script = _load_script()
    try:
        prepared = script.prepare()
    except script.PrepareError as exc:
        pytest.fail(f"installing Codex CLI {script.CODEX_VERSION} failed: {exc}", pytrace=False)
    except Exception as exc:  # noqa: BLE001 - any failure is a failure of the test, never a skip
        pytest.fail(f"installing Codex CLI {script.CODEX_VERSION} failed: {type(exc).__name__}: {exc}", pytrace=False)
    if prepared.seconds:
        sys.stderr.write(f"\nCodex CLI {prepared.version} installed in {prepared.seconds:.1f} s\n")
    return prepared


def codex_config(base_url: str, model: str, *, sandbox: str = "read-only") -> str:
    """config.toml for a Codex that talks only to ``base_url`` (the router's /v1)."""
    return f'''# Written by tests/support/codex_env.py for one Codex run against responses-router.
model = "{model}"
model_provider = "{PROVIDER}"
approval_policy = "never"
sandbox_mode = "{sandbox}"
check_for_update_on_startup = false
# "cached" is the default: Codex offers a web_search tool with external_web_access
# false; the router answers it itself (or ignores it), Codex never searches.
web_search = "cached"

[model_providers.{PROVIDER}]
name = "responses-router under test"
base_url = "{base_url}"
env_key = "{API_KEY_ENV}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 30000

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"
log_user_prompt = false

[history]
persistence = "none"

[features]
# each of these reaches the network (or starts a daemon) when on
apps = false
plugins = false
remote_plugin = false
plugin_sharing = false
tool_suggest = false
skill_mcp_dependency_install = false
in_app_updates = false
browser_use = false
browser_use_external = false
computer_use = false
image_generation = false
api_key_model_discovery = false
daemon_auto_start = false
# a login shell snapshot per session: slow, and runs the user's shell start-up files
shell_snapshot = false
'''


def write_codex_home(home: Path, base_url: str, model: str, *, sandbox: str = "read-only") -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(codex_config(base_url, model, sandbox=sandbox))
    return home


@dataclass
class CodexRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        return (f"codex exited {self.returncode} after {self.seconds:.1f} s\n--- stdout\n{self.stdout}\n"
                f"--- stderr\n{self.stderr[-6000:]}")


def run_codex(launcher: Path, home: Path, workdir: Path, prompt: str, *, sandbox: str = "read-only",
              timeout: float = 60) -> CodexRun:
    """``codex exec`` non-interactively with only the environment it needs (no user config,
    no OPENAI_* variables): the final answer on stdout, progress on stderr."""
    fake_home = home.parent / "user-home"
    fake_home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(fake_home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CODEX_HOME": str(home),
        API_KEY_ENV: API_KEY,
    }
    argv = [str(launcher), "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--color", "never",
            "--sandbox", sandbox, "-C", str(workdir), prompt]
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False)
    return CodexRun(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


# --- the recording proxy ---------------------------------------------------------------------

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}


@dataclass
class Exchange:
    """One request Codex made, as sent, and the router's answer."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    raw_body: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytes = b""

    @property
    def body(self) -> Any:
        """The JSON body after undoing Content-Encoding (the proxy forwards it untouched)."""
        data = self.raw_body
        codings = [c.strip().lower() for c in self.headers.get("content-encoding", "").split(",") if c.strip()]
        for coding in reversed(codings):
            if coding in ("gzip", "x-gzip"):
                data = gzip.decompress(data)
            elif coding == "deflate":
                data = zlib.decompress(data)
            elif coding == "zstd":
                import zstandard
                data = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
            elif coding != "identity":
                raise AssertionError(f"Codex sent Content-Encoding {coding!r}")
        return json.loads(data)

    def events(self) -> list[dict[str, Any]]:
        """The SSE data objects of a streamed answer (``[DONE]`` left out)."""
        out = []
        for line in self.response_body.decode(errors="replace").splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                out.append(json.loads(line[5:]))
        return out


class RecordingProxy:
    """A loopback relay: Codex -> proxy -> router, recording every exchange."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._relay()

            do_POST = do_DELETE = do_PUT = do_PATCH = do_GET

            def _read_body(self) -> bytes:
                if "chunked" in self.headers.get("transfer-encoding", "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _relay(self) -> None:
                body = self._read_body()
                ex = Exchange(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with proxy._lock:
                    proxy.exchanges.append(ex)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP | {"content-length"}}
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    resp = upstream.getresponse()
                    ex.status = resp.status
                    ex.response_headers = {k.lower(): v for k, v in resp.getheaders()}
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    self.send_header("Connection", "close")  # the body ends when the connection does
                    self.end_headers()
                    received = []
                    while chunk := resp.read1(65536):
                        received.append(chunk)
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    ex.response_body = b"".join(received)
                finally:
                    upstream.close()
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="codex-proxy", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take(self) -> list[Exchange]:
        """The exchanges recorded so far, and a fresh record."""
        with self._lock:
            out, self.exchanges = self.exchanges, []
        return out
