"""``python -m backends.sim``: the simulated worker (backends/sim/cli.py)."""

from backends.sim.cli import main

main()
