from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

MODEL = "sim-chat"
# A pool whose model writes <think> tags and whose engine takes reasoning back.
THINK_MODEL = "sim-think"
THINK_POOL = '''
[pools.chat]
think_tags = true
reasoning_field = "reasoning_content"
'''


@pytest.fixture(scope="session")
def harmony_vocab() -> Path:
    """The o200k vocabulary harmony needs offline, built from quicktok-v1 once and checked."""
    from router.dialects import harmony_vocab as vocab

    folder = os.environ.get(vocab.ENV_VAR) or str(Path.home() / ".cache" / "responses-router" / "harmony")
    path = vocab.ensure_vocab(folder)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == vocab.SHA256
    os.environ[vocab.ENV_VAR] = str(path.parent)
    return path.parent


@pytest.fixture(scope="session")
def enc(harmony_vocab: Path) -> Any:
    """The gpt-oss harmony encoding, loaded offline (a module may define its own ``enc``)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="session")
def byte_ids(enc: Any) -> dict[int, int]:
    """byte value -> the token of that one byte (to split UTF-8 anywhere)."""
    out: dict[int, int] = {}
    for token in range(256):
        data = enc.decode([token], errors="surrogateescape").encode("utf-8", "surrogateescape")
        if len(data) == 1:
            out[data[0]] = token
    assert len(out) == 256
    return out


@pytest.fixture(scope="session")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """One router with a managed pool of two sim workers, shared by the end-to-end tests."""
    tmp: Path = tmp_path_factory.mktemp("router")
    body = (
        sim_pool_toml()
        + sim_pool_toml(name="think", replicas=1)
        + THINK_POOL
        + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n[[models]]\nname = "{THINK_MODEL}"\npool = "think"\n'
    )
    proc = start_router(tmp, body)
    yield proc
    code = proc.stop()
    assert code == 0, f"router exited with {code}:\n{proc.log()}"


@pytest.fixture(scope="session")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
