"""Fixtures for every test directory."""

import pytest

# A real systemd user manager, started safely once per session for the tests that ask.
pytest_plugins = ["tests.systemd_manager"]


@pytest.fixture(autouse=True)
def _every_lease_released(caplog: pytest.LogCaptureFixture):
    """A slot's lease that nobody released is freed by its safety net (``Lease.__del__``),
    which logs it: a request path that forgot a release would otherwise pass every test.
    Here it fails the test it happened in, in its run or its fixtures' teardown (servers
    in this process; a test that drops a lease on purpose clears the log once it has
    checked it). A lease caught in a reference cycle is freed only by the next
    collection, and so may be reported in a later test: a leak either way."""
    yield
    records = (*caplog.get_records("call"), *caplog.get_records("teardown"))
    dropped = [r.getMessage() for r in records
               if r.name == "llmgw.server.openai.router"
               and "dropped without release" in r.getMessage()]
    assert not dropped, f"leases released only by their safety net: {dropped}"
