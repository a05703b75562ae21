"""Real MCP servers for tests, built with the MCP SDK's server side and run as subprocesses.

    python tests/support/mcp_servers.py --transport streamable-http|sse --port N [--redirect-to URL]

Tools: add(a, b), echo(text), slow(seconds), fail(message) (raises, so the
result has isError). Around the MCP app, plain HTTP extras:

- GET /_stats                  {"requests": n}: HTTP requests seen so far (this one not counted)
- /redirect-away/...           307 to --redirect-to (another origin)
- /redirect-local/<rest>       307 to /<rest> on this origin (the SDK would follow it)
- /status/<code>/...           answers with that HTTP status
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

ROOT = Path(__file__).resolve().parents[2]



def build_server() -> Any:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("test-tools", log_level="WARNING")

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="Echo the text back.")
    def echo(text: str) -> str:
        return text

    # At least 5 s (the sim's arguments keep to the schema): long enough to leave or cancel while it runs.
    @server.tool(description="Sleep, then say so.")
    async def slow(seconds: Annotated[float, Field(ge=5, le=60)]) -> str:
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool(description="Always fails.")
    def fail(message: str) -> str:
        from mcp.server.mcpserver.exceptions import ToolError

        raise ToolError(message)

    return server


class Extras:
    """ASGI wrapper: counts requests and answers the test-only routes above."""

    def __init__(self, app: Any, redirect_to: str | None) -> None:
        self.app = app
        self.redirect_to = redirect_to
        self.requests = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == "/_stats":
            await self._answer(send, 200, body=json.dumps({"requests": self.requests}).encode())
            return
        self.requests += 1
        if path.startswith("/redirect-away"):
            await self._answer(send, 307, location=self.redirect_to or "http://127.0.0.1:9/")
        elif path.startswith("/redirect-local/"):
            query = scope.get("query_string", b"").decode()
            await self._answer(send, 307, location=path[len("/redirect-local") :] + ("?" + query if query else ""))
        elif path.startswith("/status/"):
            await self._answer(send, int(path.split("/")[2]), body=b"status test")
        else:
            await self.app(scope, receive, send)

    @staticmethod
    async def _answer(send: Any, status: int, *, body: bytes = b"", location: str | None = None) -> None:
        headers = [(b"content-type", b"application/json" if body.startswith(b"{") else b"text/plain")]
        if location is not None:
            headers.append((b"location", location.encode()))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["streamable-http", "sse"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redirect-to", default=None)
    args = parser.parse_args()
    server = build_server()
    app = server.streamable_http_app() if args.transport == "streamable-http" else server.sse_app()
    uvicorn.run(Extras(app, args.redirect_to), host="127.0.0.1", port=args.port, log_level="warning")


# ---- for tests: start and stop one as a subprocess ----


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    transport: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The MCP endpoint."""
        return self.base + ("/mcp" if self.transport == "streamable-http" else "/sse")

    def requests_seen(self) -> int:
        with urllib.request.urlopen(self.base + "/_stats", timeout=5) as resp:
            return int(json.loads(resp.read())["requests"])

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"MCP test server exited with {self.proc.returncode}")
            try:
                self.requests_seen()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("MCP test server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(transport: str, *, redirect_to: str | None = None) -> ServerProcess:
    """Start one server without waiting for it; see ServerProcess.wait_ready."""
    from harness import free_port  # here, not at the top: this file also runs as the server script

    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--transport", transport, "--port", str(port)]
    if redirect_to:
        cmd += ["--redirect-to", redirect_to]
    return ServerProcess(subprocess.Popen(cmd, cwd=ROOT), port, transport)


def start(transport: str, *, redirect_to: str | None = None, timeout_s: float = 30.0) -> ServerProcess:
    server = spawn(transport, redirect_to=redirect_to)
    server.wait_ready(timeout_s)
    return server


if __name__ == "__main__":
    main()
