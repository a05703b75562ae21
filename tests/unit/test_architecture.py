"""The house rules of docs/ARCHITECTURE.md: which layer may import which (read from its layer
table, the one source), and a docs/configuration.md that names every config key."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from router.config import Config

ROOT = Path(__file__).resolve().parents[2]

ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("router", "backends", "policies")
# Layers inside backends/ that neither "*" nor "backends" reaches: no module that serves traffic
# depends on the simulated worker (a managed pool of engine "sim" starts it as a process).
SEALED = ("backends.sim",)
# The repository's tooling, never imported by the packages: the tests, the benchmarks, and the
# harness both use to start router and worker processes.
TOOLING = ("bench", "harness", "tests")


def _dotted(path: str) -> str:
    """``router/api/`` -> ``router.api``; ``router/cli.py`` -> ``router.cli``; ``router/__init__.py`` -> ``router``."""
    return path.strip("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def layer_table(text: str) -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's "Layers" table: each module of a row's folder -> what it may import
    (the row's "may import" modules, "*" for everything, and the modules of its own row)."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        modules = [_dotted(path) for path in re.findall(r"`([^`]+)`", cells[1])]
        may = set(re.findall(r"`([a-z_.]+)`", cells[3])) | ({"*"} if cells[3].startswith("everything") else set())
        assert modules, f"a row of docs/ARCHITECTURE.md's layer table names no folder: {line}"
        for module in modules:
            assert module not in allowed, f"{module}: in two rows of the layer table"
            allowed[module] = may | set(modules)
    return allowed


# Each layer and the layers it may import (besides itself): read from docs/ARCHITECTURE.md, "Layers".
# "*" is every layer but a sealed one, which only a layer that names it may import.
ALLOWED: dict[str, set[str]] = layer_table(ARCHITECTURE.read_text())


def _layer(module: str) -> str:
    """The layer a module belongs to: a sealed one, ``router.<sub>`` for the router's parts, else its package."""
    for sealed in SEALED:
        if module == sealed or module.startswith(sealed + "."):
            return sealed
    parts = module.split(".")
    if parts[0] == "router" and len(parts) > 1:
        return f"router.{parts[1]}"
    return parts[0]


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports from the three packages, top level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from router import telemetry`` imports router.telemetry (and runs router/__init__.py, nothing)
            found += [node.module] * (node.module not in PACKAGES) + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import (the layer rules read absolute ones)")
    return [name for name in found if name.split(".")[0] in (*PACKAGES, "bench", "tests")]


def _allowed(source: str, target: str) -> bool:
    if _layer(target) == source:
        return True
    allowed = ALLOWED[source]
    if _layer(target) in SEALED:
        return _layer(target) in allowed
    return "*" in allowed or any(target == a or target.startswith(a + ".") or _layer(target) == a for a in allowed)


def test_no_layer_imports_above_itself() -> None:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    assert len(files) > 50
    wrong = []
    for path in files:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        source = _layer(module.removesuffix(".__init__"))
        assert source in ALLOWED, f"{module}: a layer docs/ARCHITECTURE.md does not list ({source})"
        for target in _imports(path):
            if target.split(".")[0] in TOOLING or not _allowed(source, target):
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(sorted(set(wrong)))


def test_tests_and_bench_keep_to_themselves() -> None:
    """The tests drive the packages, never a benchmark's tools (bench/'s own tools are tested
    beside them, bench/test_*.py), and a benchmark takes nothing from the tests; the harness
    (harness/) that both start their processes with takes nothing from either."""
    forbidden = {"tests": ("bench",), "bench": ("tests",), "harness": ("tests", "bench")}
    wrong = []
    for folder, others in forbidden.items():
        files = list((ROOT / folder).rglob("*.py"))
        assert files, folder
        for path in files:
            wrong += [f"{path.relative_to(ROOT)} imports {t}" for t in _imports(path) if t.split(".")[0] in others]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_rule_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The check above reads what it should: an upward import is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from router.api.server import RouterHttpProtocol\n")
    assert not _allowed("router.turns", _imports(bad)[0])
    assert not _allowed("backends", "router.protocol.errors")
    assert _allowed("router.dialects", "backends.engines")
    assert not _allowed("router.dialects", "backends.wire")
    for source in ("backends", "router.app", "router.api", "router.turns", "policies"):
        assert not _allowed(source, "backends.sim.server"), source
    assert not _allowed("backends", "backends.sim")
    assert _allowed("router.cli", "backends.sim")
    assert _allowed("backends.sim", "backends.sim.script")
    assert not _allowed("backends.sim", "backends.wire")


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every config key, dotted by section (``server.port``, ``pools.managed.replicas``)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for inner in _models(field.annotation):
            keys += _keys(inner, f"{prefix}{name}.")
    return keys


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def test_the_configuration_page_names_every_config_key() -> None:
    section = (ROOT / "docs" / "configuration.md").read_text()
    spans = re.findall(r"`([^`]+)`", section)
    named = {word for span in spans for word in re.findall(r"[a-z_0-9]+", span)}
    missing = [key for key in _keys(Config) if not set(key.split(".")) <= named]
    assert not missing, f"config keys docs/configuration.md does not name: {missing}"


def test_the_rules_are_the_pages_table() -> None:
    """The rules come from docs/ARCHITECTURE.md's table, whatever it says: a row read as written."""
    page = ("# A\n\n## Layers\n\n| layer | folder | its job | may import |\n|---|---|---|---|\n"
            "| top | `router/app.py` | all | everything |\n| low | `router/state/`, `router/x.py` | `store.py` | `router.protocol` |\n"
            "| leaf | `policies/` | which | nothing |\n\n## Next\n\n| layer | folder | its job | may import |\n| no | `z/` | | |\n")
    assert layer_table(page) == {"router.app": {"*", "router.app"}, "router.state": {"router.protocol", "router.state", "router.x"},
                                 "router.x": {"router.protocol", "router.state", "router.x"}, "policies": {"policies"}}
    assert set(ALLOWED) >= {"router.api", "router.turns", "backends", "backends.sim", "policies"}
