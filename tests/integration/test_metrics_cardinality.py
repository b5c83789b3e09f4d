"""However clients fill their requests, /metrics keeps a bounded number of series.

A real server, agent and sim engine; 10,000 requests sent concurrently with random
models, API keys, `user` fields and paths under /v1 (most refused: unknown models, keys
that do not exist; some answered by the engine, streamed or not, with the keys of three
accounts and one key of no account). Then the scrape's series are counted against a
bound worked out from the catalog, the fixed label sets and the accounts, and every
label value is checked to come from those sets.
"""

from __future__ import annotations

import asyncio
import random
import string

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core import engine_names
from llmgw.core.inventory import NodeState
from llmgw.core.placement import REFUSAL_KINDS
from llmgw.core.replicas import ReplicaState
from llmgw.server.cluster_metrics import INSTALL_STATES
from llmgw.server.controller_stats import ACTIONS, PASS_BUCKETS
from llmgw.server.metrics import (
    DIRECTIONS,
    DURATION_BUCKETS,
    FIRST_BYTE_BUCKETS,
    INTER_TOKEN_BUCKETS,
    KINDS,
    REFUSAL_REASONS,
    STATUS_CLASSES,
    UNKNOWN_MODEL,
)
from tests.integration.conftest import SIM_SMALL, one_node_cluster

REQUESTS = 10_000
CONCURRENCY = 32
ACCOUNTS = ("alice", "bob", "carol")
# OWASP's minimum argon2id: the cheapest the server accepts, to make the users quickly.
FAST_AUTH = {"argon2_memory_kib": 19 * 1024, "argon2_time_cost": 2,
             "argon2_parallelism": 1, "hash_slots": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("cardinality"), request, [SIM_SMALL],
                          {"auth": FAST_AUTH}) as c:
        yield c


def _owned_keys(cluster) -> list[str]:
    keys = []
    for name in ACCOUNTS:
        made = cluster.admin("POST", "/api/users", json={
            "username": name, "password": f"{name}'s long password", "role": "user"})
        assert made.status_code == 201, made.text
        key = cluster.admin("POST", "/api/keys", json={"name": "load", "owner": name})
        assert key.status_code == 201, key.text
        keys.append(key.json()["key"])
    return keys


def _word(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + '-_."{}', k=n))


def _request(rng: random.Random, good_keys: list[str]) -> tuple[str, dict, dict]:
    """(path, headers, body) of one random request."""
    roll = rng.random()
    key = rng.choice(good_keys)
    user = {"user": rng.choice([_word(rng), rng.randint(0, 10**9), [_word(rng)], None])}
    chat = {"messages": [{"role": "user", "content": _word(rng, 20)}], "max_tokens": 2}
    if roll < 0.45:  # a key that does not exist, or is not one
        key = rng.choice(["llmgw_" + _word(rng, 40), _word(rng, 8), ""])
        return "/v1/chat/completions", {"authorization": f"Bearer {key}"}, {
            "model": _word(rng), **chat, **user}
    if roll < 0.85:  # a good key, a model nobody declared
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                           f"/v1/{_word(rng, 6).strip('.')}"])
        return path, {"authorization": f"Bearer {key}"}, {
            "model": rng.choice([_word(rng), _word(rng, 300), "SIM-SMALL"]),
            "prompt": "x", "input": "x", **chat, **user}
    if roll < 0.90:  # a good key, a path the engine does not have
        return f"/v1/{_word(rng, 8).strip('.')}", {"authorization": f"Bearer {key}"}, {
            "model": "sim-small", **user}
    stream = rng.random() < 0.5
    return "/v1/chat/completions", {"authorization": f"Bearer {key}"}, {
        "model": "sim-small", "stream": stream, **chat, **user,
        **({"stream_options": {"include_usage": True}} if stream else {})}


async def _flood(base: str, good_keys: list[str]) -> dict[int, int]:
    """REQUESTS random requests, CONCURRENCY at a time; the count of each status."""
    rng = random.Random(36)
    requests = [_request(rng, good_keys) for _ in range(REQUESTS)]
    statuses: dict[int, int] = {}
    left = iter(requests)

    async def client(http: aiohttp.ClientSession) -> None:
        for path, headers, body in left:
            async with http.post(base + path, json=body, headers=headers) as resp:
                await resp.read()
                statuses[resp.status] = statuses.get(resp.status, 0) + 1

    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))
    return statuses


def _samples(cluster) -> list:
    scraped = httpx.get(f"{cluster.base_url}/metrics", timeout=30)
    assert scraped.status_code == 200, scraped.text
    return [s for f in text_string_to_metric_families(scraped.text) for s in f.samples]


def _bound(models: int, accounts: int) -> int:
    """The most llmgw_* series a scrape can hold: ``models`` declared (and "unknown"),
    ``accounts`` owning keys (and anonymous, unowned, other)."""
    m = models + 1

    def histogram(buckets: tuple[float, ...]) -> int:
        return len(buckets) + 1 + 2  # the buckets and +Inf, _count, _sum

    gateway = (m * len(KINDS) * (len(STATUS_CLASSES) + histogram(DURATION_BUCKETS))
               + m * histogram(FIRST_BYTE_BUCKETS)  # time to first byte
               + m * (1 + len(REFUSAL_REASONS) + len(DIRECTIONS))  # retries, 429s, tokens
               + m * (histogram(FIRST_BYTE_BUCKETS) + histogram(INTER_TOKEN_BUCKETS))
               + (accounts + 3) * len(STATUS_CLASSES))
    cluster = (4 * m  # queue, in flight, ready, wanted
               + len(NodeState) + m * len(ReplicaState)
               + (len(engine_names.ALL) + 1) * (len(INSTALL_STATES) + 1))
    controller = (histogram(PASS_BUCKETS) + len(ACTIONS) + len(REFUSAL_KINDS) + 2 + m)
    return gateway + cluster + controller + 1  # and llmgw_store_up


def test_ten_thousand_random_requests_keep_the_series_bounded(cluster):
    good_keys = [*_owned_keys(cluster), cluster.api_key]
    before = _samples(cluster)
    statuses = asyncio.run(_flood(cluster.base_url, good_keys))
    assert sum(statuses.values()) == REQUESTS
    # Refused, mostly, and answered too, streams and whole answers alike.
    assert statuses.get(401, 0) > 3000 and statuses.get(404, 0) > 3000
    assert statuses.get(200, 0) > 300, statuses

    after = _samples(cluster)
    ours = [s for s in after if s.name.startswith("llmgw_")]
    bound = _bound(models=1, accounts=len(ACCOUNTS))
    assert len(ours) <= bound, f"{len(ours)} llmgw series, over the bound of {bound}"
    # Everything else (the process, the collector) was there before the flood.
    assert (sorted((s.name, tuple(sorted(s.labels.items()))) for s in after
                   if not s.name.startswith("llmgw_"))
            == sorted((s.name, tuple(sorted(s.labels.items()))) for s in before
                      if not s.name.startswith("llmgw_")))
    values: dict[str, set[str]] = {}
    for sample in ours:
        for label, value in sample.labels.items():
            values.setdefault(label, set()).add(value)
    assert values["model"] <= {"sim-small", UNKNOWN_MODEL}
    assert values["kind"] <= set(KINDS)
    assert values["status"] <= set(STATUS_CLASSES)
    assert values["owner"] <= {*ACCOUNTS, "anonymous", "unowned", "other"}
    assert {"alice", "bob", "carol", "anonymous", "unowned"} <= values["owner"]

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in ours if s.name == name
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    # Every request is counted once, by model and by owner.
    assert value("llmgw_requests_total") == REQUESTS
    assert value("llmgw_requests_by_owner_total") == REQUESTS
    assert value("llmgw_requests_by_owner_total", owner="anonymous") >= statuses[401]
    assert value("llmgw_tokens_total", model="sim-small", direction="output") > 0
