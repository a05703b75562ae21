"""The command line's process set-up, run in a child process so this one's collector is untouched."""

from __future__ import annotations

import json
import subprocess
import sys

from router.cli import GC_YOUNG_THRESHOLD


def test_settle_heap_freezes_start_up_and_raises_the_young_threshold() -> None:
    code = (
        "import gc, json\n"
        "import router.app\n"
        "from router.cli import settle_heap\n"
        "before = gc.get_threshold()\n"
        "settle_heap()\n"
        "print(json.dumps({'frozen': gc.get_freeze_count(), 'before': before, 'after': gc.get_threshold(),\n"
        "                  'young': gc.get_count()[0]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout)
    # Start-up's objects (the app's modules and schemas: tens of thousands) leave every later collection.
    assert seen["frozen"] > 10_000
    # Only the young threshold moves; the older generations keep CPython's ratios.
    assert seen["after"] == [GC_YOUNG_THRESHOLD, seen["before"][1], seen["before"][2]]
    assert seen["young"] < 100  # the collection before the freeze left nothing pending


def test_version_and_the_sim_help_name_themselves() -> None:
    """``--version`` prints the installed version; ``responses-router sim --help`` names itself so and
    explains every option."""
    import subprocess
    import sys
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "router", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"responses-router {version('responses-router')}"
    sim = subprocess.run([sys.executable, "-m", "router", "sim", "--help"], capture_output=True, text=True, check=True)
    assert sim.stdout.startswith("usage: responses-router sim ")
    from backends.sim import parser

    unexplained = [a.dest for a in parser()._actions if not a.help]
    assert not unexplained, f"sim options without help: {unexplained}"
    assert "--dialect" in sim.stdout and "(default: vllm)" in sim.stdout
