"""Fixtures for the upgrade tests: the integration tests' clusters and PostgreSQL database,
and the previous release's code (release.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import (  # noqa: F401 - fixtures and the hook they read
    make_cluster,
    postgres_database,
    pytest_runtest_makereport,
)
from tests.upgrade import release


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory) -> Path:
    """A directory holding the previous release's llmgw/ and migrations/; a process
    started with ``release.prefix(it)`` runs that code, checked here once."""
    tree = release.extract(tmp_path_factory.mktemp("previous-release"))
    where = subprocess.run([*release.prefix(tree), sys.executable, "-c",
                            "import llmgw; print(llmgw.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(tree), f"the old code's processes import {where}"
    return tree
