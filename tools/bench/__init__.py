"""Benchmarks (python -m rlfleet.tools.bench.<name>)."""
