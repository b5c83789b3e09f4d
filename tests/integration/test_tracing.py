"""Traces across real server and agent processes, received over OTLP/HTTP by a collector
the test runs (tests/otlp.py), decoded from protobuf and checked as trees."""

from __future__ import annotations

import os

import pytest

from tests.hub import hub_in_thread
from tests.integration.cluster import wait_for
from tests.otlp import Receiver

MODEL = "sim-traced"


@pytest.fixture
def receiver(monkeypatch):
    """Ask for it before make_cluster: it then outlives the processes, which send what
    they hold as they stop (to a closed port, the exporter retries for seconds)."""
    # The processes export every 100 ms instead of OpenTelemetry's default 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with Receiver() as received:
        yield received


def _tracing(receiver: Receiver) -> dict:
    return {"endpoint": receiver.endpoint, "sample_ratio": 0.0}


def test_one_trace_runs_from_placement_to_the_shards_readiness_on_its_node(
        receiver, make_cluster):
    weights = {"org/sim-weights": {"model.bin": os.urandom(4096)}}
    with hub_in_thread(weights) as hub:
        model = {"name": MODEL, "replicas": 1, "profiles": [{
            "engine": "sim", "source": "hf://org/sim-weights"}]}
        c = make_cluster(models=[model], tracing=_tracing(receiver))
        c.start_server()
        c.add_agent("node-a", tracing=_tracing(receiver),
                    weights={"directories": [{"path": str(c.root / "w")}], "hub": hub.url})
        [replica] = c.wait_ready(MODEL, timeout_s=60)
        rid = replica["id"]

        # On the server: reconcile -> place MODEL -> start RID, open until it served.
        start = receiver.wait_for(lambda s: s.name == f"start {rid}", "for the start")
        assert start.service == "llmgw-server" and start.error is None
        place, reconcile = list(receiver.ancestors(start))
        assert place.name == f"place {MODEL}" and place.attributes["llmgw.placed"] is True
        assert place.attributes["llmgw.nodes"] == ["node-a"]
        assert "node-a" in place.attributes["llmgw.placement"]
        assert reconcile.name == "reconcile" and reconcile.parent_id == ""

        # On the node, in the same trace: the shard's start and its steps, under it.
        shard = receiver.wait_for(lambda s: s.parent_id == start.span_id,
                                  "of the node under the start")
        assert shard.service == "llmgw-agent" and shard.trace_id == start.trace_id
        assert shard.name == f"start llmgw-shard-{rid}-0" and shard.error is None
        steps = {s.name: s for s in receiver.children(shard)}
        assert {"weights", "launch", "readiness"} <= set(steps), steps
        assert steps["readiness"].attributes["llmgw.ready"] is True
        assert steps["launch"].attributes["llmgw.pid"] > 0
        # The shard was ready before the control plane heard so and ended its start.
        assert shard.end_ns <= start.end_ns and start.start_ns <= shard.start_ns

        # The weights fetch is a model job of its own, linked to the shard's start, with a
        # span per step.
        job = receiver.wait_for(lambda s: s.name.startswith("weights ") and not s.parent_id,
                                "of the weights job")
        assert job.trace_id != start.trace_id
        assert job.attributes["llmgw.source"] == "hf://org/sim-weights"
        assert (shard.trace_id, shard.span_id) in job.links
        job_steps = [s.name for s in receiver.children(job)]
        assert job_steps == ["list files", "download model.bin", "place"], job_steps

        # A scale-down is a trace whose stop reaches the node.
        c.admin("PATCH", f"/api/models/{MODEL}", json={"replicas": 0}).raise_for_status()
        stop = receiver.wait_for(lambda s: s.name == f"scale_down {rid}", "for the stop")
        assert stop.attributes["llmgw.reason"] == "scaled down to 0"
        node_stop = receiver.wait_for(lambda s: s.parent_id == stop.span_id,
                                      "of the node under the stop")
        assert node_stop.name == f"stop llmgw-shard-{rid}-0"
        assert node_stop.service == "llmgw-agent"


def test_a_refused_placement_lists_every_candidate_with_its_reason(receiver, make_cluster):
    # Two CPU nodes, a model that needs a GPU: nowhere to go.
    model = {"name": "needs-gpu", "replicas": 1, "profiles": [{"engine": "sim", "gpus": 1}]}
    c = make_cluster(models=[model], tracing=_tracing(receiver))
    c.start_server()
    for node in ("node-a", "node-b"):
        c.add_agent(node)
    wait_for(lambda: all(c.node_state(n) == "ready" for n in ("node-a", "node-b")), 30,
             "both nodes ready")

    def both_refused(span) -> bool:
        return (span.name == "place needs-gpu"
                and {e[1]["llmgw.node"] for e in span.events} == {"node-a", "node-b"})

    place = receiver.wait_for(both_refused, "refusing both nodes")
    assert place.attributes["llmgw.placed"] is False and place.error
    assert place.attributes["llmgw.candidates_refused"] == 2
    for name, event in place.events:
        assert name == "refused"
        assert event["llmgw.reason"] == "needs 1 GPU, has no GPUs"
        assert event["llmgw.reason_class"] == "gpus"
    [reconcile] = receiver.ancestors(place)
    assert reconcile.name == "reconcile"
    # A refusal that stays the same is traced once, not on every pass.
    seen = _passes(c)
    wait_for(lambda: _passes(c) >= seen + 4, 30, "four more passes")
    assert len(receiver.find(both_refused)) == 1


def _passes(c) -> float:
    """How many passes the controller made, from /metrics."""
    for line in c.admin("GET", "/metrics").text.splitlines():
        if line.startswith("llmgw_controller_pass_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("/metrics has no llmgw_controller_pass_seconds_count")

