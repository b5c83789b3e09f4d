"""``/metrics``: what the gateway records per request (against a throwaway registry), who
may scrape, and the cluster gauges of a real cluster read at scrape time."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import psutil
import pytest
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import TestClient
from prometheus_client import ProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from llmgw.config import Model, ServerConfig, parse
from llmgw.core.catalog import catalog_from_config
from llmgw.core.inventory import Timeouts
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.auth import SecretsFileError, read_secret_file
from llmgw.server.metrics import (
    UNKNOWN_MODEL,
    Access,
    Metrics,
    _ProcessCollector,
    endpoint_kind,
    metrics_endpoint,
    status_class,
)
from llmgw.server.openai.router import Router

EVIL = 'evil"name{}'


def _metrics(*names: str) -> Metrics:
    models = [msgspec.convert({"name": n, "profiles": [{"engine": "sim"}]}, Model)
              for n in names]
    controller = SimpleNamespace(catalog=catalog_from_config(models), replicas={},
                                 sessions=NodeSessions(Timeouts()))
    return Metrics(controller, Router(), process=False)  # type: ignore[arg-type]


def _value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_requests_are_counted_by_model_kind_and_status_class():
    m = _metrics("m1")
    m.request_done("m1", "chat", 200, 0.3)
    m.request_done("m1", "chat", 200, 0.7)
    m.request_done("m1", "chat", 429, 0.001)
    m.request_done("m1", "embeddings", 503, 0.01)
    assert _value(m, "llmgw_requests_total", model="m1", kind="chat", status="2xx") == 2
    assert _value(m, "llmgw_requests_total", model="m1", kind="chat", status="4xx") == 1
    assert _value(m, "llmgw_requests_total", model="m1", kind="embeddings", status="5xx") == 1
    assert _value(m, "llmgw_request_duration_seconds_count", model="m1", kind="chat") == 3
    assert _value(m, "llmgw_request_duration_seconds_sum", model="m1",
                  kind="chat") == pytest.approx(1.001)
    assert _value(m, "llmgw_request_duration_seconds_bucket", model="m1", kind="chat",
                  le="0.5") == 2


def test_the_other_recorders():
    m = _metrics("m1")
    m.first_byte("m1", 0.2)
    m.retry("m1")
    m.retry("m1")
    m.refused("m1", "queue_full")
    m.refused("m1", "queue_timeout")
    m.refused("m1", "because I said so")
    assert _value(m, "llmgw_time_to_first_byte_seconds_count", model="m1") == 1
    assert _value(m, "llmgw_upstream_retries_total", model="m1") == 2
    for reason in ("queue_full", "queue_timeout", "other"):
        assert _value(m, "llmgw_refusals_total", model="m1", reason=reason) == 1


def test_a_name_the_catalog_does_not_declare_is_never_a_label():
    m = _metrics("m1")
    names = [EVIL, "m1 ", "M1", "", None, "x" * 10_000, "\n# HELP fake", UNKNOWN_MODEL,
             *(secrets.token_hex(8) for _ in range(500))]
    for name in names:
        m.request_done(name, "chat", 404, 0.001)
        m.request_done(name, "../../etc", 400, 0.001)
        m.first_byte(name, 0.1)
        m.retry(name)
        m.refused(name, secrets.token_hex(4))
    assert _value(m, "llmgw_requests_total", model=UNKNOWN_MODEL, kind="chat",
                  status="4xx") == len(names)
    assert _value(m, "llmgw_requests_total", model=UNKNOWN_MODEL, kind="other",
                  status="4xx") == len(names)
    assert _value(m, "llmgw_refusals_total", model=UNKNOWN_MODEL,
                  reason="other") == len(names)
    text = m.exposition().decode()
    labels = {(s.labels.get("model"), s.labels.get("kind"), s.labels.get("reason"))
              for family in text_string_to_metric_families(text) for s in family.samples}
    assert {model for model, _, _ in labels} <= {None, UNKNOWN_MODEL, "m1"}  # m1: gauges
    assert {kind for _, kind, _ in labels} <= {None, "chat", "other"}
    assert {reason for _, _, reason in labels} <= {None, "other"}
    # The caches keep catalog names only: made-up names do not pile up in memory.
    caches = (m._series, m._first_bytes, m._retry_counts, m._refusal_counts)
    assert sum(len(c) for c in caches) <= 10


def test_helpers():
    assert [endpoint_kind(p) for p in ("/v1/chat/completions", "/v1/completions",
                                       "/v1/embeddings", "/v1/rerank", "/v1/models")] == [
        "chat", "completions", "embeddings", "other", "other"]
    assert [status_class(s) for s in (101, 200, 302, 499, 503, 0, 999)] == [
        "1xx", "2xx", "3xx", "4xx", "5xx", "1xx", "5xx"]


def _request(host: str | None, **headers: str) -> SimpleNamespace:
    return SimpleNamespace(headers=headers,
                           client=SimpleNamespace(host=host) if host else None)


@pytest.mark.parametrize(("host", "headers", "allowed"), [
    ("127.0.0.1", {}, True),
    ("127.8.9.10", {}, True),
    ("::1", {}, True),
    ("::ffff:127.0.0.1", {}, True),
    ("10.0.0.5", {}, False),
    ("::ffff:10.0.0.5", {}, False),
    ("testclient", {}, False),
    (None, {}, False),
    # A proxy on the same host passes everyone's requests on from loopback.
    ("127.0.0.1", {"x-forwarded-for": "203.0.113.9"}, False),
    ("127.0.0.1", {"forwarded": "for=203.0.113.9"}, False),
    ("127.0.0.1", {"x-real-ip": "203.0.113.9"}, False),
    ("10.0.0.5", {"authorization": "Bearer scrape-me"}, True),
    ("10.0.0.5", {"authorization": "Bearer admin"}, True),
    ("10.0.0.5", {"authorization": "Bearer scrape-m"}, False),
    # A wrong token is refused even from loopback: it is a mistake worth seeing.
    ("127.0.0.1", {"authorization": "Bearer nope"}, False),
])
def test_who_may_scrape(host, headers, allowed):
    access = Access(token="scrape-me")
    assert access.allows(_request(host, **headers), "admin") is allowed  # type: ignore[arg-type]


def test_loopback_can_be_turned_off():
    access = Access(allow_loopback=False)
    assert not access.allows(_request("127.0.0.1"), "admin")  # type: ignore[arg-type]
    assert access.allows(_request("127.0.0.1", authorization="Bearer admin"),  # type: ignore[arg-type]
                         "admin")


def test_access_from_config(tmp_path):
    assert Access.from_config(ServerConfig()) == Access()
    token = tmp_path / "metrics-token"
    token.write_text("scrape-me\n")
    token.chmod(0o600)
    config = parse({"metrics": {"enabled": False, "allow_loopback": False,
                                "token_file": str(token)}}, ServerConfig)
    assert Access.from_config(config) == Access(
        enabled=False, allow_loopback=False, token="scrape-me")
    token.chmod(0o640)
    with pytest.raises(SecretsFileError, match="chmod 600"):
        read_secret_file(token, "metrics token")
    with pytest.raises(SecretsFileError, match="cannot read"):
        read_secret_file(tmp_path / "missing", "metrics token")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    os.chmod(empty, 0o600)
    with pytest.raises(SecretsFileError, match="empty"):
        read_secret_file(empty, "metrics token")


def test_process_metrics_without_proc_stat(tmp_path):
    """Under systemd's ProcSubset=pid /proc/stat is hidden and /proc/self is not:
    prometheus-client's own collector then reports nothing; llmgw's still does."""
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "stat").write_bytes(Path("/proc/self/stat").read_bytes())
    assert list(ProcessCollector(proc=str(tmp_path), registry=None).collect()) == []
    names = {m.name for m in _ProcessCollector(proc=str(tmp_path), registry=None).collect()}
    assert {"process_start_time_seconds", "process_resident_memory_bytes",
            "process_cpu_seconds"} <= names
    start = next(m for m in _ProcessCollector(proc=str(tmp_path), registry=None).collect()
                 if m.name == "process_start_time_seconds")
    assert abs(start.samples[0].value - psutil.Process().create_time()) < 2


def test_the_endpoint():
    """The test client's address is not loopback: only a token gets in."""
    m = _metrics("m1")
    app = Litestar([metrics_endpoint], state=State({"metrics": m, "admin_token": "admin"}))
    with TestClient(app) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        m.access = Access(token="scrape-me")
        for token in ("scrape-me", "admin"):
            scraped = client.get("/metrics", headers={"authorization": f"Bearer {token}"})
            assert scraped.status_code == 200
            assert scraped.headers["content-type"].startswith("text/plain; version=")
            assert 'llmgw_replicas_wanted{model="m1"} 1.0' in scraped.text
        m.access = Access(enabled=False, token="scrape-me")
        hidden = client.get("/metrics", headers={"authorization": "Bearer scrape-me"})
        assert hidden.status_code == 404


# --- a real cluster -------------------------------------------------------------------------


def _scrape(cluster, **headers: str) -> httpx.Response:
    return httpx.get(f"{cluster.base_url}/metrics", headers=headers, timeout=10)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_live_cluster_as_prometheus_sees_it(make_cluster):
    cluster = make_cluster()
    cluster.start_server()
    cluster.add_agent("node-a")
    cluster.wait_ready("sim-small")

    scraped = _scrape(cluster)
    assert scraped.status_code == 200, scraped.text
    assert scraped.headers["content-type"].startswith("text/plain; version=")
    samples = _samples(scraped.text)
    model = (("model", "sim-small"),)
    assert samples[("llmgw_replicas_ready", model)] == 1
    assert samples[("llmgw_replicas_wanted", model)] == 1
    assert samples[("llmgw_queue_length", model)] == 0
    assert samples[("llmgw_in_flight", model)] == 0
    assert samples[("llmgw_nodes", (("state", "ready"),))] == 1
    assert samples[("llmgw_nodes", (("state", "lost"),))] == 0
    assert samples[("process_resident_memory_bytes", ())] > 0

    # Names a client made up reach the gateway, and never the scrape.
    random_name = "model-" + secrets.token_hex(6)
    for name in (EVIL, random_name):
        answer = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=10,
                            headers={"authorization": f"Bearer {cluster.api_key}"},
                            json={"model": name, "messages": [{"role": "user", "content": "x"}]})
        assert answer.status_code == 404, answer.text
    text = _scrape(cluster).text
    for leaked in ("evil", random_name):
        assert leaked not in text
    models = {dict(labels).get("model") for _, labels in _samples(text)}
    assert models <= {None, "sim-small", UNKNOWN_MODEL}

    # Who else may scrape: the admin token; not an API key, not a forwarded request.
    assert _scrape(cluster, authorization=f"Bearer {cluster.admin_token}").status_code == 200
    refused = _scrape(cluster, authorization=f"Bearer {cluster.api_key}")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "metrics_token_required"
    assert _scrape(cluster, **{"x-forwarded-for": "203.0.113.9"}).status_code == 401
