"""Fixtures for the chaos tests: the integration tests' clusters and PostgreSQL database,
and the hook that lets make_cluster print the processes' logs when a test failed."""

from tests.integration.conftest import (  # noqa: F401 - fixtures and the hook they read
    make_cluster,
    postgres_database,
    pytest_runtest_makereport,
)
