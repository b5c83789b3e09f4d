"""The monitoring kit against a running cluster: Debian's real Prometheus, configured from
deploy/monitoring/prometheus.yml, scrapes a real llmgw server (with the metrics token),
finds the node through ``GET /api/metrics/targets``, evaluates llmgw's alert rules, and
gives back the tokens that chat requests sent through the official ``openai`` client
used. ``/api/metrics/targets`` is also asked directly, as Prometheus and as strangers.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import httpx
import msgspec
import openai
import pytest
import yaml
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import TestClient

from llmgw import wire
from llmgw.config import Model
from llmgw.core.catalog import catalog_from_config
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.app import _api_error
from llmgw.server.errors import ApiError
from llmgw.server.metrics import Access, Metrics
from llmgw.server.metrics_targets import metrics_targets
from llmgw.server.openai.router import Router
from tests.integration.cluster import wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster
from tests.monitoring.prometheus import KIT, Prometheus, eventually, tool

MODEL = "sim-small"
TOKEN = "scrape-me-" + "0" * 22


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """A server whose /metrics takes a metrics token, one node, sim-small ready."""
    root = tmp_path_factory.mktemp("monitoring")
    token = root / "metrics-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    with one_node_cluster(root / "cluster", request, [SIM_SMALL],
                          {"metrics": {"token_file": str(token)}}) as c:
        c.metrics_token_file = token
        yield c


def _targets(cluster, **kwargs) -> httpx.Response:
    return httpx.get(f"{cluster.base_url}/api/metrics/targets", timeout=10, **kwargs)


def test_the_nodes_as_http_service_discovery(cluster):
    answer = _targets(cluster)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == [{"targets": ["127.0.0.1:9100"],
                              "labels": {"node": "node-a", "fabric": ""}}]
    other = _targets(cluster, params={"port": 9256},
                     headers={"authorization": f"Bearer {TOKEN}"})
    assert other.json()[0]["targets"] == ["127.0.0.1:9256"]
    assert _targets(cluster, headers={"authorization": f"Bearer {cluster.admin_token}"}
                    ).status_code == 200

    bad_port = _targets(cluster, params={"port": 0})
    assert bad_port.status_code == 400
    assert bad_port.json()["error"]["message"] == "port must be a TCP port, 1 to 65535, not 0"
    # Whom /metrics refuses, this refuses: a wrong token (even from loopback), an API key,
    # a request a proxy forwarded.
    for headers in ({"authorization": "Bearer nope"},
                    {"authorization": f"Bearer {cluster.api_key}"},
                    {"x-forwarded-for": "203.0.113.9"}):
        refused = _targets(cluster, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["code"] == "metrics_token_required"
        assert refused.headers["www-authenticate"] == "Bearer"


def _app(metrics: Metrics) -> Litestar:
    return Litestar([metrics_targets], state=State({"metrics": metrics, "admin_token": "admin"}),
                    exception_handlers={ApiError: _api_error})


def test_each_node_with_its_address_and_fabric():
    """In process, with nodes registered as agents would: an IPv6 address in brackets, the
    fabric as a label, nodes in id order. The test client is not loopback: only a token
    gets in, and with metrics turned off there is nothing here."""
    model = msgspec.convert({"name": MODEL, "profiles": [{"engine": "sim"}]}, Model)
    controller = SimpleNamespace(catalog=catalog_from_config([model]), replicas={},
                                 sessions=NodeSessions(Timeouts()))
    for node, address, fabric in (("gpu-2", "fd00::12", "ib-b"), ("gpu-1", "10.0.0.11", "ib-a"),
                                  ("cpu-1", "10.0.0.30", None)):
        controller.sessions.attach(wire.Register(
            node_id=node, address=address,
            inventory=wire.Inventory(hostname=node, fabric=fabric)), now=0)
    metrics = Metrics(controller, Router(), Access(token=TOKEN), process=False)  # type: ignore[arg-type]
    with TestClient(_app(metrics)) as client:
        assert client.get("/api/metrics/targets").status_code == 401
        answer = client.get("/api/metrics/targets", params={"port": 9835},
                            headers={"authorization": f"Bearer {TOKEN}"})
        assert answer.json() == [
            {"targets": ["10.0.0.30:9835"], "labels": {"node": "cpu-1", "fabric": ""}},
            {"targets": ["10.0.0.11:9835"], "labels": {"node": "gpu-1", "fabric": "ib-a"}},
            {"targets": ["[fd00::12]:9835"], "labels": {"node": "gpu-2", "fabric": "ib-b"}},
        ]
        metrics.access = Access(enabled=False, token=TOKEN)
        hidden = client.get("/api/metrics/targets", headers={"authorization": f"Bearer {TOKEN}"})
        assert hidden.status_code == 404
        assert "metrics.enabled is false" in hidden.json()["error"]["message"]


def _prometheus_config(cluster, root) -> dict:
    """deploy/monitoring/prometheus.yml for this cluster: plain HTTP on its port, the token
    file, every second. No node_exporter runs here, so the nodes' exporter port is the
    server's own: the node's target then answers, and its series carry the node's labels."""
    config = yaml.safe_load((KIT / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    del config["alerting"]  # no Alertmanager here
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    server, nodes = jobs["llmgw-server"], jobs["llmgw-nodes"]
    server["scheme"] = "http"
    del server["tls_config"]
    server["authorization"]["credentials_file"] = str(cluster.metrics_token_file)
    server["static_configs"] = [{"targets": [f"127.0.0.1:{cluster.port}"]}]
    (discovery,) = nodes["http_sd_configs"]
    discovery["url"] = f"{cluster.base_url}/api/metrics/targets?port={cluster.port}"
    discovery["refresh_interval"] = "1s"
    del discovery["tls_config"]
    discovery["authorization"]["credentials_file"] = str(cluster.metrics_token_file)
    shutil.copy(KIT / "llmgw-alerts.yml", root / "llmgw-alerts.yml")
    return config


@pytest.fixture
def prometheus(cluster, tmp_path):
    tool("prometheus")
    found = Prometheus(tmp_path, _prometheus_config(cluster, tmp_path))
    try:
        found.start()
        yield found
    finally:
        found.stop()


def test_prometheus_scrapes_the_cluster(cluster, prometheus):
    # Both jobs up: the server with its token, the node found through the server.
    eventually(prometheus, 'up{job="llmgw-server"}', 1)
    eventually(prometheus, 'up{job="llmgw-nodes", node="node-a"}', 1)
    (target,) = [t for t in prometheus.api("targets")["activeTargets"]
                 if t["labels"]["job"] == "llmgw-nodes"]
    assert target["labels"]["node"] == "node-a" and "fabric" not in target["labels"]
    assert target["scrapeUrl"] == f"http://127.0.0.1:{cluster.port}/metrics"

    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                           max_retries=0, timeout=20)
    prompt = completion = 0
    for words in ("one", "two words", "three more words"):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=4)
        assert chat.usage is not None
        prompt += chat.usage.prompt_tokens
        completion += chat.usage.completion_tokens
    assert completion == 12

    server = 'job="llmgw-server"'
    eventually(prometheus, f'sum(llmgw_requests_total{{{server}, model="{MODEL}", '
                           f'kind="chat", status="2xx"}})', 3)
    eventually(prometheus, f'sum(llmgw_tokens_total{{{server}, model="{MODEL}", '
                           f'direction="output"}})', completion)
    eventually(prometheus, f'sum(llmgw_tokens_total{{{server}, model="{MODEL}", '
                           f'direction="input"}})', prompt)


def test_the_alert_rules_run_on_the_real_series(prometheus):
    """Prometheus loads llmgw's rules and evaluates each without error; on a healthy
    cluster none is pending or firing."""

    def evaluated() -> list[dict] | None:
        (group,) = prometheus.api("rules", type="alert")["groups"]
        rules = group["rules"]
        return rules if all(r["health"] == "ok" for r in rules) else None

    rules = wait_for(evaluated, 30, "every alert rule evaluated once")
    assert len(rules) == 7
    assert {r["name"]: r["state"] for r in rules} == dict.fromkeys(
        (r["name"] for r in rules), "inactive")
    assert prometheus.api("alerts")["alerts"] == []
