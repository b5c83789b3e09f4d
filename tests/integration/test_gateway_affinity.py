"""Which replica the real gateway picks (docs/gateway.md, "Choosing a replica"), told by
the engines' own request counters, and the 503 for a model that placement cannot place.
Traffic goes through the official `openai` client."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.cluster import Cluster, wait_for
from tests.integration.conftest import one_node_cluster

# Slow enough that a stream stays open while other requests go by; a one-token answer
# still takes only 50 ms.
PAIR = {"name": "sim-pair", "replicas": 2, "profiles": [
    {"engine": "sim", "args": ["--tokens-per-second", "20"]}]}
# 64 GPUs with 9765.6 GiB free each: no node has them.
HUGE = {"name": "sim-huge", "replicas": 1, "profiles": [
    {"engine": "sim", "gpus": 64, "gpu_memory_mib": 10_000_000}]}

# Twelve users whose keys fall on both replicas. The ring is a stable hash of the replica
# ids, and a fresh store names the first two placements sim-pair-e1 and sim-pair-e2: on
# that ring these names split 5 and 7 (checked once with llmgw.core.routing.Ring). Were
# the ids ever others (a replica re-placed after a crash), all twelve on one replica
# would still take odds of 2 in 4096.
USERS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
         "mallory", "oscar"]
# Longer than the 512 bytes of `messages` the key reads, so every turn below shares it.
SYSTEM = "You answer questions about the cluster. " * 16


def _ports(ready: list[dict]) -> dict[str, int]:
    """Each replica's engine port."""
    return {r["id"]: r["shards"][0]["port"] for r in ready}


@pytest.fixture(scope="module")
def affine(tmp_path_factory, request) -> Iterator[tuple[Cluster, dict[str, int]]]:
    """sim-pair from two replicas on one node, with affinity (the default), beside sim-huge,
    which no node can take; shared by the tests that only send requests, each of which
    leaves both engines idle. The cluster, and each sim-pair replica's engine port."""
    with one_node_cluster(tmp_path_factory.mktemp("affinity"), request, [PAIR, HUGE],
                          {"gateway": {"affinity": True}}, ready={"sim-pair": 2}) as c:
        yield c, _ports(c.ready_replicas("sim-pair"))


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key,
                         max_retries=0, timeout=30)


def _stats(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/sim/stats", timeout=5).json()


def _served_by(client: openai.OpenAI, engines: dict[str, int], **request) -> str:
    """Send one one-token chat request and return the replica whose engine served it: the
    one engine whose own request counter went up (the others' must not have moved)."""
    before = {rid: _stats(port)["requests_total"] for rid, port in engines.items()}
    request.setdefault("messages", [{"role": "user", "content": "hi"}])
    answer = client.chat.completions.create(model="sim-pair", max_tokens=1, **request)
    assert answer.choices[0].message.content
    rose = {rid: _stats(port)["requests_total"] - before[rid] for rid, port in engines.items()}
    served = [rid for rid, delta in rose.items() if delta]
    assert len(served) == 1 and rose[served[0]] == 1, rose
    return served[0]


def _busy_replica(engines: dict[str, int]) -> str:
    """The replica whose engine has exactly one request in flight (the others none)."""
    def one_busy() -> str | None:
        loads = {rid: _stats(port)["in_flight"] for rid, port in engines.items()}
        busy = [rid for rid, n in loads.items() if n]
        return busy[0] if len(busy) == 1 and loads[busy[0]] == 1 else None
    return wait_for(one_busy, 10, "one engine to hold the open stream")


def test_one_user_keeps_to_one_replica_while_many_users_use_both(affine):
    cluster, engines = affine
    client = _client(cluster)

    alice = [_served_by(client, engines, user="alice") for _ in range(12)]
    assert len(set(alice)) == 1, alice

    many = [_served_by(client, engines, user=user) for user in USERS]
    assert set(many) == set(engines), many
    # The owners do not move with what else was sent: alice's turn in the list agrees.
    assert many[USERS.index("alice")] == alice[0]


def test_one_conversation_start_keeps_to_one_replica_without_a_user(affine):
    cluster, engines = affine
    client = _client(cluster)
    # No `user`: the key is the conversation's first 512 bytes, here the shared system
    # prompt; the later turns differ. Chosen at random, twelve in a row on one replica
    # would take odds of 2 in 4096.
    turns = [_served_by(client, engines, messages=[
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"question {i}"},
    ]) for i in range(12)]
    assert len(set(turns)) == 1, turns


def _while_one_stream_is_open(cluster: Cluster, engines: dict[str, int]
                              ) -> tuple[str, list[str]]:
    """Hold one streamed request of alice's open, then send six more of hers one after
    another; the replica holding the stream, and the replica that served each of the six."""
    client = _client(cluster)
    # 2000 tokens at 20 per second: open far longer than the test; closed below.
    with client.chat.completions.create(
            model="sim-pair", stream=True, max_tokens=2000, user="alice",
            messages=[{"role": "user", "content": "talk"}]) as stream:
        assert next(iter(stream))
        busy = _busy_replica(engines)
        served = [_served_by(client, engines, user="alice") for _ in range(6)]
        # Still open: the six were chosen with the stream counted.
        assert _stats(engines[busy])["in_flight"] == 1
    wait_for(lambda: all(_stats(port)["in_flight"] == 0 for port in engines.values()), 10,
             "both engines to be idle once the stream is closed")
    return busy, served


def test_with_affinity_the_same_user_stays_on_its_replica_though_it_is_busier(affine):
    cluster, engines = affine
    busy, served = _while_one_stream_is_open(cluster, engines)
    # Alice's replica holds 1 request, under the bound ceil(1.25 * 2 / 2) = 2: it keeps
    # her, though the other replica is idle.
    assert served == [busy] * 6, (busy, served)


def test_without_affinity_the_same_user_goes_to_the_less_busy_replica(make_cluster):
    cluster = make_cluster(models=[PAIR], gateway={"affinity": False})
    cluster.start_server()
    cluster.add_agent("node-a")
    engines = _ports(cluster.wait_ready("sim-pair", 2, timeout_s=60))
    busy, served = _while_one_stream_is_open(cluster, engines)
    # With two replicas the power of two choices draws both, and the one with fewer
    # requests outstanding wins every time: the idle one, whoever the user is.
    [idle] = set(engines) - {busy}
    assert served == [idle] * 6, (busy, served)


def test_a_model_no_node_can_take_answers_503_with_placements_reason(affine):
    cluster, _ = affine

    def unplaced() -> str | None:
        [model] = [m for m in cluster.status()["models"] if m["name"] == "sim-huge"]
        # "no nodes have registered" until node-a has; then node-a's refusal.
        return model["unplaced"] if (model["unplaced"] or "").startswith("node-a:") else None

    reason = wait_for(unplaced, 30, "placement to say why node-a cannot take sim-huge")
    assert "node-a: needs 64 GPUs with 9765.6 GiB free, has " in reason

    client = _client(cluster)
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.with_raw_response.create(
            model="sim-huge", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    # Not queued for: a model without a ready replica is refused at once.
    assert time.monotonic() - began < 5
    err = refused.value
    assert err.status_code == 503 and err.code == "no_ready_replica"
    # The envelope's message (openai's own str() puts "Error code: 503 - " before it).
    assert err.body["message"] == f"no replica of 'sim-huge' can take the request: {reason}"
    assert err.response.headers["retry-after"] == "5"
