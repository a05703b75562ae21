"""Codex CLI, the real one (pinned, from npm), against a router with a sim pool.

``codex exec`` runs with a throw-away CODEX_HOME whose custom model provider
(``wire_api = "responses"``) points at the router through a recording proxy
(tests/support/codex_env.py), so the tests see byte for byte what Codex sent and what
the router answered.

1. Discovery (``discovery`` fixture, ``test_discover_codex_tools``): a prompt with
   ``[sim:echo=request]`` makes the sim answer with the chat request the router
   built from Codex's request, and Codex prints it as its final answer. That shows
   which tools Codex sends and the name of its shell tool as the model sees it
   (0.171.0: ``exec_command``; namespace tools flattened as ``multi_agent_v1__*``).
2. The tool loop (``test_codex_tool_loop``): ``[sim:call=<shell tool>]`` makes the
   first response a call of Codex's shell tool; Codex handles the call itself
   (read-only sandbox, approval "never"), sends the whole history back with the
   call's output, and the sim's answer to that (``tool said: <output>``) is Codex's
   final answer on stdout.

The sim fills every property of the tool's schema with a deterministic value (a
word for the command, whole numbers for ``number`` fields, which Codex reads as
integers), so Codex really runs a command in its sandbox; the command is a
random word, so the test asserts the loop, not what the command printed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import RouterProcess, sim_pool_toml, start_router
from tests.support.codex_env import (
    API_KEY,
    CodexRun,
    Exchange,
    RecordingProxy,
    codex_cli,  # noqa: F401 - the session fixture
    run_codex,
    write_codex_home,
)

pytestmark = pytest.mark.e2e

MODEL = "sim-codex"
# The names Codex has used for its shell tool, by version and model family.
SHELL_TOOLS = ("exec_command", "shell_command", "shell", "local_shell")
# Codex's first request is ~40 KB of instructions and tool schemas (~6k sim tokens); the
# sim's default context (4096) is too small for it.
SIM_ARGS = '["--max-model-len", "262144"]'


@pytest.fixture(scope="module")
def codex_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    body = sim_pool_toml(replicas=1, extra_args=SIM_ARGS) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    proc = start_router(tmp_path_factory.mktemp("codex-router"), body)
    yield proc
    code = proc.stop()
    assert code == 0, f"router exited with {code}:\n{proc.log()}"


@pytest.fixture(scope="module")
def proxy(codex_router: RouterProcess) -> Iterator[RecordingProxy]:
    with RecordingProxy(codex_router.port) as p:
        yield p


@dataclass
class Codex:
    launcher: Path
    home: Path
    workdir: Path

    def run(self, prompt: str) -> CodexRun:
        return run_codex(self.launcher, self.home, self.workdir, prompt, timeout=60)


@pytest.fixture(scope="module")
def codex(codex_cli: Any, proxy: RecordingProxy, tmp_path_factory: pytest.TempPathFactory) -> Codex:  # noqa: F811
    root = tmp_path_factory.mktemp("codex")
    home = write_codex_home(root / "codex-home", proxy.base_url + "/v1", MODEL)
    workdir = root / "work"
    workdir.mkdir()
    (workdir / "README.txt").write_text("a workspace for the Codex end-to-end test\n")
    return Codex(codex_cli.launcher, home, workdir)


def responses_posts(exchanges: list[Exchange]) -> list[Exchange]:
    return [e for e in exchanges if e.method == "POST" and e.path.split("?")[0] == "/v1/responses"]


def event_types(ex: Exchange) -> list[str]:
    return [e.get("type") for e in ex.events()]


@dataclass
class Discovery:
    run: CodexRun
    exchanges: list[Exchange]
    codex_request: dict[str, Any]  # what Codex sent to POST /v1/responses
    worker_request: dict[str, Any]  # what the router sent the sim (echoed back as the answer)
    shell_tool: str


@pytest.fixture(scope="module")
def discovery(codex: Codex, proxy: RecordingProxy) -> Discovery:
    proxy.take()
    run = codex.run("List your tools. [sim:echo=request]")
    exchanges = proxy.take()
    assert run.returncode == 0, run.explain()
    posts = responses_posts(exchanges)
    assert len(posts) == 1, [(e.method, e.path, e.status) for e in exchanges]
    assert posts[0].status == 200, posts[0].response_body[:2000]
    try:
        worker_request = json.loads(run.stdout)
    except ValueError:
        pytest.fail(f"Codex's final answer is not the sim's JSON echo:\n{run.explain()}")
    names = [t["function"]["name"] for t in worker_request.get("tools") or []]
    shell = next((n for n in SHELL_TOOLS if n in names), None)
    assert shell is not None, f"no shell tool among the tools the model was offered: {names}"
    return Discovery(run, exchanges, posts[0].body, worker_request, shell)


def test_discover_codex_tools(discovery: Discovery) -> None:
    """The tools Codex sends, and what the router offers the engine from them."""
    sent = discovery.codex_request["tools"]
    offered = [t["function"]["name"] for t in discovery.worker_request["tools"]]
    functions = [t["name"] for t in sent if t["type"] == "function"]
    namespaces = {t["name"]: [f["name"] for f in t["tools"]] for t in sent if t["type"] == "namespace"}
    builtins = [t["type"] for t in sent if t["type"] not in ("function", "namespace")]
    note = (f"Codex tools: functions {functions}; namespaces {namespaces}; built-in {builtins}; "
            f"shell tool {discovery.shell_tool!r}; offered to the engine: {offered}")
    print(note)
    assert discovery.shell_tool in functions, note
    assert namespaces, note
    # function tools keep their names; namespace members are flattened as ns__name; built-in
    # tools (web_search) are not offered to the engine while the router has no backend for them.
    expected = functions + [f"{ns}__{name}" for ns, members in namespaces.items() for name in members]
    assert sorted(offered) == sorted(expected), note
    assert "web_search" in builtins, note
    assert discovery.worker_request["model"] == "sim-model"
    assert discovery.worker_request["stream"] is True


def check_codex_request(ex: Exchange) -> dict[str, Any]:
    """What Codex sends on every turn, accepted by the router (200, a completed stream)."""
    assert ex.status == 200, f"router answered {ex.status}: {ex.response_body[:2000]!r}"
    encoding = ex.headers.get("content-encoding")
    assert encoding in (None, "zstd", "gzip", "deflate"), encoding
    assert ex.headers.get("accept") == "text/event-stream"
    assert ex.headers.get("authorization") == f"Bearer {API_KEY}"
    body = ex.body
    assert body["model"] == MODEL and body["stream"] is True
    assert body["store"] is False
    assert "previous_response_id" not in body
    assert body["include"] == ["reasoning.encrypted_content"]
    assert body["reasoning"].get("summary") in ("auto", "concise", "detailed", "none"), body["reasoning"]
    assert isinstance(body["prompt_cache_key"], str) and body["prompt_cache_key"]
    assert isinstance(body["client_metadata"], dict) and body["client_metadata"]
    roles = [item.get("role") for item in body["input"] if item.get("type") == "message"]
    assert "developer" in roles and "user" in roles, roles
    kinds = {t["type"] for t in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds, kinds
    types = event_types(ex)
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    return body


def output_text(output: Any) -> str:
    """A function_call_output's output: a string, or a list of content items."""
    if isinstance(output, str):
        return output
    return "".join(part.get("text", "") for part in output if isinstance(part, dict))


def test_codex_tool_loop(codex: Codex, proxy: RecordingProxy, discovery: Discovery,
                         codex_router: RouterProcess) -> None:
    shell = discovery.shell_tool
    proxy.take()
    run = codex.run(f"Look around the workspace. [sim:call={shell}]")
    exchanges = proxy.take()
    assert run.returncode == 0, run.explain()
    assert all(e.status < 400 for e in exchanges), [(e.method, e.path, e.status) for e in exchanges]
    posts = responses_posts(exchanges)
    assert len(posts) == 2, [(e.method, e.path, e.status) for e in exchanges]
    first, second = (check_codex_request(e) for e in posts)

    # turn 1: the router streamed one call of the shell tool and completed
    done = [e["item"] for e in posts[0].events() if e.get("type") == "response.output_item.done"]
    calls = [item for item in done if item["type"] == "function_call"]
    assert [c["name"] for c in calls] == [shell], done
    call = calls[0]
    json.loads(call["arguments"])
    completed = posts[0].events()[-1]["response"]
    assert completed["status"] == "completed"
    assert completed["store"] is False

    # turn 2: the whole history again (no previous_response_id), then the call and its output
    history = first["input"]
    assert second["input"][: len(history)] == history, "turn 2 does not start with turn 1's input"
    added = second["input"][len(history):]
    sent_calls = [i for i in added if i.get("type") == "function_call"]
    outputs = [i for i in added if i.get("type") == "function_call_output"]
    assert [(c["call_id"], c["name"], c["arguments"]) for c in sent_calls] == \
        [(call["call_id"], shell, call["arguments"])], added
    assert [o["call_id"] for o in outputs] == [call["call_id"]], added
    result = output_text(outputs[0]["output"])
    assert result

    # the sim answered the tool output, and that answer is Codex's final answer on stdout
    final = [e["item"] for e in posts[1].events() if e.get("type") == "response.output_item.done"]
    answer = "".join(part["text"] for item in final if item["type"] == "message"
                     for part in item["content"] if part["type"] == "output_text")
    assert answer == f"tool said: {result}"
    assert run.stdout.strip() == answer.strip(), run.explain()

    # store: false was honoured: neither response can be fetched back
    with httpx.Client(base_url=codex_router.base_url, timeout=10) as http:
        for ex in posts:
            rid = ex.events()[0]["response"]["id"]
            assert http.get(f"/v1/responses/{rid}").status_code == 404
    print(f"Codex tool loop: {run.seconds:.1f} s; {shell} output: {result[:200]!r}")
