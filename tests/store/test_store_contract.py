"""The store's contract, one suite run on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from llmgw.store import ApiKeyRecord, NodeRecord, Store, StoreError

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def node(node_id: str, **changes) -> NodeRecord:
    fields = {
        "id": node_id,
        "address": f"{node_id}.lan:7000",
        "state": "registering",
        "inventory": {"gpus": [{"name": "H100", "memory_mib": 81559}], "cpus": 64},
        "registered_at": T0,
        "last_seen_at": T0,
    }
    return NodeRecord(**(fields | changes))


def api_key(prefix: str, secret: str = "s3cr3t", **changes) -> ApiKeyRecord:
    fields = {
        "prefix": prefix,
        "secret_hash": hashlib.sha256(secret.encode()).hexdigest(),
        "name": f"key {prefix}",
        "created_at": T0,
    }
    return ApiKeyRecord(**(fields | changes))


# models ----------------------------------------------------------------------------


async def test_models_put_get_list_delete(store: Store) -> None:
    assert await store.get_model("llama") is None
    assert await store.list_models() == []

    await store.put_model("qwen", {"engine": "vllm", "replicas": 2})
    await store.put_model("llama", {"engine": "llama.cpp", "args": ["-c", "4096"]})

    got = await store.get_model("llama")
    assert got is not None
    assert got.spec == {"engine": "llama.cpp", "args": ["-c", "4096"]}
    assert [m.name for m in await store.list_models()] == ["llama", "qwen"]

    assert await store.delete_model("llama") is True
    assert await store.delete_model("llama") is False
    assert await store.get_model("llama") is None
    assert [m.name for m in await store.list_models()] == ["qwen"]


async def test_put_model_replaces_spec_and_keeps_created_at(store: Store) -> None:
    await store.put_model("qwen", {"replicas": 1})
    first = await store.get_model("qwen")
    await store.put_model("qwen", {"replicas": 3, "profile": {"gpus": 2}})
    second = await store.get_model("qwen")

    assert first is not None and second is not None
    assert second.spec == {"replicas": 3, "profile": {"gpus": 2}}
    assert second.created_at == first.created_at
    assert second.updated_at >= first.updated_at
    assert len(await store.list_models()) == 1


async def test_spec_that_is_not_json_is_refused(store: Store) -> None:
    with pytest.raises(StoreError, match="spec of model 'bad' is not JSON"):
        await store.put_model("bad", {"when": object()})


# nodes -----------------------------------------------------------------------------


async def test_nodes_upsert_by_id_and_list_in_order(store: Store) -> None:
    await store.put_node(node("node-b"))
    await store.put_node(node("node-a"))
    later = T0 + timedelta(minutes=5)
    await store.put_node(node("node-b", address="10.0.0.2:7000", last_seen_at=later, state="ready"))

    nodes = await store.list_nodes()
    assert [n.id for n in nodes] == ["node-a", "node-b"]
    assert nodes[1] == node("node-b", address="10.0.0.2:7000", last_seen_at=later, state="ready")
    assert await store.get_node("node-a") == node("node-a")
    assert await store.get_node("node-z") is None


async def test_set_node_state(store: Store) -> None:
    await store.put_node(node("gpu-1", state="ready"))
    at = T0 + timedelta(seconds=30)
    await store.set_node_state("gpu-1", "unreachable", at)

    got = await store.get_node("gpu-1")
    assert got is not None
    assert got.state == "unreachable"
    assert got.state_changed_at == at
    assert got.last_seen_at == T0  # not seen: only the state moved

    with pytest.raises(StoreError, match="no node 'ghost'"):
        await store.set_node_state("ghost", "lost", at)


# settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [{"interval_s": 5, "nested": {"a": [1, 2]}}, [1, "two", None], 42, 1.5, "text", True, None],
)
async def test_settings_roundtrip(store: Store, value) -> None:
    assert await store.get_setting("k") is None
    assert await store.get_setting("k", default="fallback") == "fallback"
    await store.put_setting("k", value)
    assert await store.get_setting("k", default="fallback") == value
    await store.put_setting("k", {"replaced": True})
    assert await store.get_setting("k") == {"replaced": True}


# the placement epoch ---------------------------------------------------------------


async def test_next_epoch_starts_at_one_and_increases(store: Store) -> None:
    assert [await store.next_epoch() for _ in range(3)] == [1, 2, 3]


async def test_next_epoch_is_unique_under_concurrent_callers(store: Store) -> None:
    epochs = await asyncio.gather(*(store.next_epoch() for _ in range(50)))
    assert sorted(epochs) == list(range(1, 51))
    assert await store.next_epoch() == 51


# API keys --------------------------------------------------------------------------


async def test_api_keys_add_find_list_revoke(store: Store) -> None:
    first = await store.add_api_key(api_key("llmgw_aaaa", allowed_models=["qwen", "llama"]))
    second = await store.add_api_key(api_key("llmgw_bbbb", expires_at=T0 + timedelta(days=30)))
    assert first.id is not None and second.id is not None and first.id != second.id
    assert first == api_key("llmgw_aaaa", allowed_models=["qwen", "llama"], id=first.id)

    assert await store.find_api_key("llmgw_aaaa") == first
    assert await store.find_api_key("llmgw_zzzz") is None
    assert await store.list_api_keys() == [first, second]

    at = T0 + timedelta(hours=1)
    assert await store.revoke_api_key("llmgw_aaaa", at) is True
    assert await store.revoke_api_key("llmgw_aaaa", at + timedelta(hours=1)) is True
    assert await store.revoke_api_key("llmgw_zzzz", at) is False
    revoked = await store.find_api_key("llmgw_aaaa")
    assert revoked is not None and revoked.revoked_at == at  # the first revocation stands
    assert (await store.find_api_key("llmgw_bbbb")).revoked_at is None


async def test_duplicate_prefix_is_refused(store: Store) -> None:
    await store.add_api_key(api_key("llmgw_dup1"))
    with pytest.raises(StoreError, match="prefix 'llmgw_dup1' already exists"):
        await store.add_api_key(api_key("llmgw_dup1", secret="other"))
    assert len(await store.list_api_keys()) == 1


async def test_api_key_rows_hold_no_plaintext_secret(store: Store, tmp_path) -> None:
    secret = "llmgw_sk_plaintext_9f8e7d6c5b4a"
    await store.add_api_key(api_key("llmgw_sk_p", secret=secret))

    async with store.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT * FROM api_keys"))).all()
    dump = repr([tuple(row) for row in rows])
    assert hashlib.sha256(secret.encode()).hexdigest() in dump
    assert secret not in dump
    assert secret.removeprefix("llmgw_sk_p") not in dump


# datetimes -------------------------------------------------------------------------


async def test_datetimes_come_back_aware_utc_and_equal(store: Store) -> None:
    berlin = timezone(timedelta(hours=2))
    local = datetime(2025, 6, 1, 14, 30, 15, 654321, tzinfo=berlin)
    await store.put_node(node("n1", registered_at=local, last_seen_at=local))
    await store.add_api_key(api_key("llmgw_tz", created_at=local, expires_at=local))
    await store.put_model("m", {})

    got_node = await store.get_node("n1")
    got_key = await store.find_api_key("llmgw_tz")
    got_model = await store.get_model("m")
    values = [got_node.registered_at, got_node.last_seen_at, got_key.created_at, got_key.expires_at]
    for value in values:
        assert value == local
        assert value.utcoffset() == timedelta(0)
    assert got_model.created_at.utcoffset() == timedelta(0)


async def test_naive_datetime_is_refused(store: Store) -> None:
    with pytest.raises(StoreError, match="naive datetime"):
        await store.put_node(node("n1", last_seen_at=datetime(2025, 1, 1, 12, 0)))
    assert await store.get_node("n1") is None


async def test_api_keys_without_an_account_belong_to_none(store: Store) -> None:
    """Keys made with the admin token (e.g. by `llmgw up`) have no owning account."""
    made = await store.add_api_key(api_key("llmgw_up01"))
    assert made.account_id is None
    assert (await store.find_api_key("llmgw_up01")).account_id is None
    assert await store.list_api_keys() == [made]
    assert await store.list_api_keys(account_id=1) == []


async def test_read_then_write_transactions_do_not_lock_each_other_out(store: Store) -> None:
    """revoke_api_key reads, then writes: on SQLite, concurrent ones must wait for the
    write lock, not fail with "database is locked"."""
    for i in range(10):
        await store.add_api_key(api_key(f"llmgw_c{i:03}"))
    at = T0 + timedelta(hours=1)
    done = await asyncio.gather(
        *(store.revoke_api_key(f"llmgw_c{i % 10:03}", at) for i in range(30))
    )
    assert done == [True] * 30
    assert all(k.revoked_at == at for k in await store.list_api_keys())
