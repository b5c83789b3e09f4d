"""SIGHUP re-reads server.yaml on a real server process with one agent and sim engines:
a model added to the file is served without a restart; a key that needs a restart is
named in one log line and keeps its running value; a broken file changes nothing."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
import yaml

from tests.integration.cluster import free_port, wait_for
from tests.integration.conftest import one_node_cluster

SIM_A = {"name": "sim-a", "profiles": [{"engine": "sim"}], "replicas": 1}
SIM_B = {"name": "sim-b", "aliases": ["gpt-4o-mini"], "profiles": [{"engine": "sim"}],
         "replicas": 1}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("reload"), request, [SIM_A]) as c:
        yield c


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=c.api_key, max_retries=0,
                         timeout=20)


def _listed(c) -> list[str]:
    return [m.id for m in _client(c).models.list()]


def _edit_and_reload(c, edit) -> None:
    """Change server.yaml as an operator would, then `systemctl reload` (SIGHUP)."""
    path = c.root / "server.yaml"
    config = yaml.safe_load(path.read_text())
    edit(config)
    path.write_text(yaml.safe_dump(config))
    c.server.send_signal(signal.SIGHUP)


def _log_lines(c, *words: str) -> list[str]:
    return [line for line in (c.root / "server.log").read_text().splitlines()
            if all(w in line for w in words)]


def test_a_model_added_is_served_and_a_new_port_waits_for_a_restart(cluster):
    assert _listed(cluster) == ["sim-a"]
    new_port = free_port()

    def edit(config: dict) -> None:
        config["models"].append(SIM_B)
        config["listen"]["port"] = new_port
        config["gateway"] = {"queue_max": 7}

    _edit_and_reload(cluster, edit)
    applied = cluster.server_log_line("server.yaml reloaded: applied", timeout_s=10)
    assert "models" in applied and "gateway.queue_max" in applied, applied
    assert "listen.port" not in applied, applied
    # Placed on the node and answering, under its alias too, on the port it ran on.
    assert wait_for(lambda: "sim-b" in _listed(cluster), 5, "sim-b in /v1/models")
    assert _listed(cluster) == ["sim-a", "sim-b", "gpt-4o-mini"]
    cluster.wait_ready("sim-b", timeout_s=20)
    answer = _client(cluster).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content

    # The port: one line names it as needing a restart; the old port still serves.
    restart = _log_lines(cluster, "listen.port")
    assert len(restart) == 1, restart
    assert "not applied" in restart[0] and "restart" in restart[0], restart[0]
    assert httpx.get(f"{cluster.base_url}/healthz", timeout=5).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{new_port}/healthz", timeout=2)


def test_a_broken_file_changes_nothing_and_says_where(cluster):
    before = _listed(cluster)
    where: list[int] = []

    def edit(config: dict) -> None:
        where.append(len(config["models"]))  # sim-c's index
        config["models"].append({"name": "sim-c", "profiles": [{"engine": "sim",
                                                                "gpus": "two"}]})
        config["models"][0]["replicas"] = 0

    _edit_and_reload(cluster, edit)
    refused = cluster.server_log_line("server.yaml not reloaded", timeout_s=10)
    assert "nothing changed" in refused, refused
    assert f"models[{where[0]}].profiles[0].gpus: expected int, got str" in refused, refused
    # Not half applied: sim-a keeps its replica, sim-c is not there.
    assert _listed(cluster) == before
    assert len(cluster.ready_replicas("sim-a")) == 1
    assert [r for r in cluster.status()["replicas"] if r["model"] == "sim-c"] == []
