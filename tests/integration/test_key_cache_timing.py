"""An API key id's existence does not show in the gateway's answer (issue 34, hole 3): a
real server on loopback answers a made-up key and a real key's id with a wrong secret with
the same status, body and headers, the first time and from memory after; and remembering
made-up ids never locks a new key out, whether it is made through the admin API or by
another server sharing the store (within ``auth.key_cache_s``). How many store reads and
how much memory a flood of made-up ids costs: tests/store/test_key_cache_unknown_ids.py."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import httpx
import pytest

from llmgw.server.auth import hash_key, key_id
from llmgw.server.auth.keys import _checksum, new_api_key
from llmgw.store import ApiKeyRecord, open_store, sqlite_url
from tests.integration.conftest import SIM_SMALL, one_node_cluster

KEY_CACHE_S = 1.0
CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """One server for the module, each test with keys of its own. No agent: every request
    here is answered (or refused) by the gateway itself."""
    with one_node_cluster(tmp_path_factory.mktemp("key-cache"), request, [SIM_SMALL],
                          {"auth": {"key_cache_s": KEY_CACHE_S}}, with_node=False) as c:
        yield c


def _answer(client: httpx.Client, method: str, path: str, key: str) -> tuple:
    resp = client.request(method, path, headers={"authorization": f"Bearer {key}"},
                          json=CHAT if method == "POST" else None)
    headers = sorted((k, v) for k, v in resp.headers.items() if k != "date")
    return resp.status_code, resp.content, headers


def test_an_unknown_id_and_a_wrong_secret_get_the_same_answer(server):
    body = key_id(server.api_key) + "x" * 32
    wrong_secret = body + _checksum(body)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("POST", "/v1/embeddings")):
            made_up = new_api_key()
            # Twice each: the first request reads the id, the second is answered from
            # what the server remembers of it.
            answers = [_answer(client, method, path, key)
                       for key in (wrong_secret, made_up, wrong_secret, made_up)]
            assert answers[0][0] == 401, answers[0]
            assert b'"code":"invalid_api_key"' in answers[0][1], answers[0]
            assert all(a == answers[0] for a in answers), (path, answers)


def test_a_key_made_after_its_id_was_refused_works_within_key_cache_s(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        # Through the admin API, after a stream of made-up ids: at once.
        for _ in range(200):
            assert _answer(client, "GET", "/v1/models", new_api_key())[0] == 401
        made = server.admin("POST", "/api/keys", json={"name": "new"})
        assert made.status_code == 201, made.text
        assert _answer(client, "GET", "/v1/models", made.json()["key"])[0] == 200

        # By another server sharing the store, for an id this one was asked for (and
        # refused) before it existed: within auth.key_cache_s, as a revoked key would be.
        key = new_api_key()
        assert _answer(client, "GET", "/v1/models", key)[0] == 401
        asyncio.run(_add_elsewhere(server.server_state / "llmgw.db", key))
        added = time.monotonic()
        while _answer(client, "GET", "/v1/models", key)[0] != 200:
            assert time.monotonic() - added < KEY_CACHE_S + 1.0, "still refused"
            time.sleep(0.02)


async def _add_elsewhere(path, key: str) -> None:
    store = await open_store(sqlite_url(path))
    try:
        await store.add_api_key(ApiKeyRecord(prefix=key_id(key), secret_hash=hash_key(key),
                                             name="made elsewhere",
                                             created_at=datetime.now(UTC)))
    finally:
        await store.close()
