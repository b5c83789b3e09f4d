"""The engine builds operators chose per node, kept in the store (SQLite and PostgreSQL),
and as a server holds them (server/engine_builds.py): a read from before this server's
own write never undoes it."""

from __future__ import annotations

from llmgw.server.engine_builds import EngineBuilds
from llmgw.store import Store, open_store


async def test_a_choice_is_kept_changed_and_forgotten(store: Store) -> None:
    assert await store.engine_builds() == {}

    await store.put_engine_build("gpu-1", "vllm", "cu129")
    await store.put_engine_build("gpu-1", "llama.cpp", "none")
    await store.put_engine_build("gpu-2", "vllm", "auto")
    assert await store.engine_builds() == {
        "gpu-1": {"llama.cpp": "none", "vllm": "cu129"}, "gpu-2": {"vllm": "auto"}}

    await store.put_engine_build("gpu-1", "vllm", "cu130")  # one upsert, not a second row
    await store.put_engine_build("gpu-2", "vllm", None)
    await store.put_engine_build("gpu-3", "vllm", None)  # nothing to forget: no error
    assert await store.engine_builds() == {"gpu-1": {"llama.cpp": "none", "vllm": "cu130"}}


async def test_choices_survive_the_store_being_opened_again(store: Store) -> None:
    await store.put_engine_build("gpu-1", "sglang", "cu129")
    again = await open_store(store.url)
    try:
        assert await again.engine_builds() == {"gpu-1": {"sglang": "cu129"}}
    finally:
        await again.close()


async def test_a_read_begun_before_this_servers_write_does_not_undo_it(store: Store) -> None:
    builds = EngineBuilds(store)
    assert builds.take(await builds.read()) == set()

    stale = await builds.read()  # as a pass reads it, before the operator chooses
    await builds.put("gpu-1", "vllm", "cu129")
    assert builds.take(stale) == set()
    assert builds.of("gpu-1") == {"vllm": "cu129"}

    # Another server's write reaches this one at its next read, naming the node.
    await store.put_engine_build("gpu-2", "vllm", "none")
    assert builds.take(await builds.read()) == {"gpu-2"}
    assert builds.by_node == {"gpu-1": {"vllm": "cu129"}, "gpu-2": {"vllm": "none"}}

    await builds.put("gpu-1", "vllm", None)
    assert builds.of("gpu-1") == {} and "gpu-1" not in builds.by_node
    assert await store.engine_builds() == {"gpu-2": {"vllm": "none"}}
