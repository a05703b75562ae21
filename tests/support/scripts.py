"""Scripts of scripts/ imported as modules, so tests use the very code users run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def load_script(path: Path) -> Any:
    """A script of scripts/ imported as a module (once), so tests use the very code users run."""
    import importlib.util

    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
