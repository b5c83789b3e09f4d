"""Fixtures for every test directory."""

# A real systemd user manager, started safely once per session for the tests that ask.
pytest_plugins = ["tests.systemd_manager"]
