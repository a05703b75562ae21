from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.procs import RouterProcess, sim_pool_toml, start_router

MODEL = "sim-chat"


@pytest.fixture(scope="session")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """One router with a managed pool of two sim workers, shared by the end-to-end tests."""
    tmp: Path = tmp_path_factory.mktemp("router")
    proc = start_router(tmp, sim_pool_toml() + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n')
    yield proc
    code = proc.stop()
    assert code == 0, f"router exited with {code}:\n{proc.log()}"


@pytest.fixture(scope="session")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
