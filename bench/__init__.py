"""Benchmarks of the router against sim workers: `.venv/bin/python bench/run.py` (see bench/run.py)."""
