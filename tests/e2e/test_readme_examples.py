"""The README's client examples, as written, against a router on ``config.example.toml``: what a
new user copies after command 1 works."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from harness import ROOT, RouterProcess, free_port, start_router

pytestmark = pytest.mark.e2e

README = (ROOT / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def _toml_block(word: str) -> str:
    return next(b for b in re.findall(r"```toml\n(.*?)```", README, re.S) if word in b)


@pytest.fixture(scope="module")
def example_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """config.example.toml as it is, but for its port range, its folder and the port it listens on."""
    tmp = tmp_path_factory.mktemp("example")
    example = (ROOT / "config.example.toml").read_text()
    first = free_port()
    body = example.replace("port_range = [18100, 18199]", f"port_range = [{first}, {first + 20}]")
    body = re.sub(r"\[server\]\n(.*?\n)\n", "", body, count=1, flags=re.S)  # start_router writes [server]
    body = re.sub(r"\[store\]\n(.*?\n)\n", "", body, count=1, flags=re.S)
    router = start_router(tmp, body, store='[store]\nkind = "sqlite"\npath = "var/responses.db"\n')
    yield router
    router.stop()


def _run(code: str, router: RouterProcess) -> str:
    code = code.replace("http://127.0.0.1:8080/v1", router.base_url + "/v1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_sdk_example_runs(example_router: RouterProcess) -> None:
    block = next(b for b in _python_blocks() if "client.responses.stream" in b)
    out = _run(block.replace("        ...\n", "        pass\n") + "\nprint(second.status, final.status)\n", example_router)
    lines = out.strip().splitlines()
    assert lines[0] and lines[-1] == "completed completed", out


def test_the_agents_sdk_example_runs(example_router: RouterProcess) -> None:
    block = next(b for b in _python_blocks() if "from agents import" in b)
    out = _run(block, example_router)
    assert out.strip(), "the agent said nothing"


def test_the_codex_config_names_what_codex_reads() -> None:
    """The README's Codex block is the provider part of what tests/e2e/test_codex_cli.py gives the real CLI."""
    import tomllib

    from tests.support.codex_env import codex_config

    readme = tomllib.loads(_toml_block("model_providers"))
    tested = tomllib.loads(codex_config("http://127.0.0.1:8080/v1", "sim-chat"))
    provider = readme["model_providers"][readme["model_provider"]]
    assert provider["wire_api"] == tested["model_providers"][tested["model_provider"]]["wire_api"] == "responses"
    assert set(provider) <= set(tested["model_providers"][tested["model_provider"]])
    assert readme["model"] == "sim-chat"


def test_the_ab_recipe_loads_on_the_example_config() -> None:
    """The README's A/B block, added to config.example.toml as it says, is a valid config with two arms."""
    from router.config import parse_config

    example = (ROOT / "config.example.toml").read_text()
    config = parse_config(example + "\n" + _toml_block("arms"), source="config.example.toml")
    model = next(m for m in config.models if m.name == "sim-ab")
    assert [arm.pool for arm in model.arms] == ["sim", "sim-b"]
    assert {p.name for p in config.pools} >= {"sim", "sim-b"}


def test_the_kv_aware_recipe_is_a_valid_pool() -> None:
    """The README's KV-aware block, with a model on it, is a valid config: kv_aware on its events."""
    from router.config import parse_config

    config = parse_config(_toml_block("kv_aware") + '\n[[models]]\nname = "m"\npool = "gpu"\n', source="README.md")
    (pool,) = config.pools
    assert pool.policy == "kv_aware" and pool.kv_events.enabled and pool.kv_events.endpoints is None
