"""Benchmarks, each with its own runner (`python -m bench.NAME`); never part of pytest."""
