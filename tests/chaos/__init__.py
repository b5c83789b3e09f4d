"""Chaos tests: real clusters made to fail on purpose, each with its figure."""
