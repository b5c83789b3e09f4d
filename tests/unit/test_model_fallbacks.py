"""Model fallbacks: how server.yaml and POST /api/models read them (unknown names and
cycles refused, naming them), the order a chain is tried in, and admission's decision for
a request whose model cannot take it: its next fallback the key may use, at once where
the model has no ready replica, or after its queue refused; the first model's refusal,
naming the fallbacks', where none takes it. In process, with a real router and catalog."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime
from types import SimpleNamespace

import msgspec
import pytest
import yaml

from llmgw.config import Gateway, ServerConfig, parse
from llmgw.core.catalog import Catalog, CatalogError, catalog_from_config
from llmgw.server.catalog import Entry, fallbacks_refused, parse_model
from llmgw.server.errors import ApiError
from llmgw.server.openai import routes
from llmgw.server.openai.admission import Ask, Wait, admit, decide, no_replica
from llmgw.server.openai.router import Lease, Router
from llmgw.store import ApiKeyRecord
from llmgw.transport.pool import JSON_TYPE

SIM = "profiles: [{engine: sim}]"


def catalog_of(text: str) -> Catalog:
    return catalog_from_config(parse(yaml.safe_load(text), ServerConfig).models)


def refusal_of(text: str) -> str:
    with pytest.raises(CatalogError) as caught:
        catalog_of(text)
    return str(caught.value)


# a falls back to b then c; b to d (an alias of it); d to nothing.
CATALOG = f"""
models:
  - name: a
    fallbacks: [b, c]
    {SIM}
  - name: b
    fallbacks: [dee]
    {SIM}
  - name: c
    {SIM}
  - name: d
    aliases: [dee]
    {SIM}
"""


def test_a_chain_is_the_model_s_own_list_then_theirs_each_once() -> None:
    catalog = catalog_of(CATALOG)
    a, b, c = (catalog.get(n) for n in "abc")
    assert [(n.name, n.model.name) for n in catalog.fallbacks_of(a)] == [
        ("b", "b"), ("c", "c"), ("dee", "d")]
    assert [n.model.name for n in catalog.fallbacks_of(b)] == ["d"]
    assert catalog.fallbacks_of(c) == ()


@pytest.mark.parametrize(("text", "words"), [
    (f"""
models:
  - name: a
    fallbacks: [b, gpt-5]
    {SIM}
  - name: b
    {SIM}
""", "models[0].fallbacks[1]: 'gpt-5' is not a model or an alias of one; declare it, "
     "or drop it from the fallbacks"),
    (f"""
models:
  - name: a
    fallbacks: [b]
    {SIM}
  - name: b
    fallbacks: [c]
    {SIM}
  - name: c
    fallbacks: [a]
    {SIM}
""", "models[0].fallbacks[0]: 'b' leads back to 'a' (a → b → c → a): a model's fallbacks "
     "must not fall back to it; drop one link"),
    (f"""
models:
  - name: a
    aliases: [ay]
    fallbacks: [ay]
    {SIM}
""", "models[0].fallbacks[0]: 'ay' is this model itself; drop it"),
    (f"""
models:
  - name: a
    fallbacks: [a]
    {SIM}
""", "models[0].fallbacks[0]: 'a' is this model itself; drop it"),
    (f"""
models:
  - name: b
    {SIM}
  - name: a
    fallbacks: [b, b]
    {SIM}
""", "models[1].fallbacks[1]: 'b' is listed twice; drop it"),
])
def test_server_yaml_refuses_fallbacks_that_cannot_be_followed(text: str, words: str) -> None:
    assert refusal_of(text) == words


def _entries(text: str) -> list[Entry]:
    return [Entry("config", {}, m, m.replicas, None) for m in catalog_of(text).models]


def test_an_added_model_s_fallbacks_must_name_models_and_not_lead_back() -> None:
    items = _entries(CATALOG)
    raw, _ = parse_model({"name": "e", "fallbacks": ["a", "dee"], "profiles": [{"engine": "sim"}]})
    assert fallbacks_refused(items, raw) is None
    raw, _ = parse_model({"name": "e", "fallbacks": ["a", "zz"], "profiles": [{"engine": "sim"}]})
    assert fallbacks_refused(items, raw) == (
        "fallbacks[1]", "'zz' is not a model or an alias of one; declare it, or drop it "
        "from the fallbacks")
    # A model that another named before it was added (and removed since) closes a loop.
    dangling = [*items, Entry("api", {}, parse_model(
        {"name": "m", "fallbacks": ["e"], "profiles": [{"engine": "sim"}]})[1], 1, None)]
    raw, _ = parse_model({"name": "e", "fallbacks": ["m"], "profiles": [{"engine": "sim"}]})
    key, why = fallbacks_refused(dangling, raw)
    assert key == "fallbacks[0]" and "'m' leads back to 'e' (e → m → e)" in why


# --- admission --------------------------------------------------------------------------

BODY = b'{"model": "a", "messages": [{"role": "user", "content": "hi"}]}'


def _key(**fields) -> ApiKeyRecord:
    return ApiKeyRecord(id=7, prefix="abcd", secret_hash="00", name="k",
                        created_at=datetime(2026, 1, 1, tzinfo=UTC), **fields)


def _ask(body: bytes = BODY, key: ApiKeyRecord | None = None) -> Ask:
    return Ask("/v1/chat/completions", "chat", routes._parse(body, "messages"), body,
               JSON_TYPE, key)


def _state(ready: dict[str, list[str]], queue_wait_s: float = 0.0, queue_max: int = 1024):
    """The gateway's state over CATALOG, with ``ready`` replicas (one slot each)."""
    router = Router(rng=random.Random(3), queue_wait_s=queue_wait_s)
    router.update({model: [(r, "127.0.0.1", 1000 + i, 1) for i, r in enumerate(names)]
                   for model, names in ready.items()})
    controller = SimpleNamespace(catalog=catalog_of(CATALOG),
                                 why_not_ready=lambda model: "no replica is placed yet",
                                 expecting=lambda model: False, sleepy=frozenset(),
                                 wake_left=lambda model: 0.0)
    return SimpleNamespace(router=router, controller=controller, awaiting={},
                           config=SimpleNamespace(gateway=Gateway(queue_wait_s=queue_wait_s,
                                                                  queue_max=queue_max)),
                           metrics=SimpleNamespace(refused=lambda model, code: None,
                                                   fell_back=lambda model, fallback: None))


def test_a_model_with_no_ready_replica_is_served_by_its_fallback_at_once() -> None:
    state = _state({"b": ["b0"]})
    ask = _ask()
    lease = decide(state, ask)
    assert type(lease) is Lease and lease.replica == "b0"
    # The request is b's now: routed, counted and forwarded as b, the header names b.
    assert ask.model == "b" and ask.shows_model and ask.requested == "a"
    assert msgspec.json.decode(ask.body)["model"] == "b"
    lease.release()


def test_a_chain_goes_on_past_a_fallback_with_no_replica_to_its_own_fallback() -> None:
    state = _state({"d": ["d0"]})
    ask = _ask()
    lease = decide(state, ask)
    assert type(lease) is Lease and lease.replica == "d0" and ask.model == "d"
    lease.release()


def test_a_model_that_can_serve_keeps_its_requests_and_says_so() -> None:
    state = _state({"a": ["a0"], "b": ["b0"]})
    ask = _ask()
    lease = decide(state, ask)
    assert lease.replica == "a0" and ask.model == "a" and ask.shows_model
    assert ask.body == BODY  # untouched
    lease.release()
    # A model without fallbacks is not told about: no header.
    plain = _ask(BODY.replace(b'"a"', b'"c"'))
    lease = decide(_state({"c": ["c0"]}), plain)
    assert lease.replica == "c0" and not plain.shows_model
    lease.release()


def test_a_fallback_the_key_may_not_use_is_passed_over() -> None:
    state = _state({"b": ["b0"], "c": ["c0"]})
    ask = _ask(key=_key(allowed_models=["a", "c"]))
    lease = decide(state, ask)
    assert lease.replica == "c0" and ask.model == "c"
    lease.release()


def test_a_key_that_may_use_no_fallback_gets_the_model_s_own_refusal() -> None:
    state = _state({"b": ["b0"]})
    ask = _ask(key=_key(allowed_models=["a"]))
    assert decide(state, ask) is Wait.SLOT
    assert asyncio.run(admit(state, ask)) is None
    refusal = no_replica(state, ask)
    assert (refusal.status, refusal.code) == (503, "no_ready_replica")
    assert refusal.message == ("no replica of 'a' can take the request: no replica is "
                               "placed yet")


def test_nothing_in_the_chain_can_serve_the_first_refusal_names_each() -> None:
    state = _state({})
    ask = _ask()
    assert decide(state, ask) is Wait.SLOT  # the task path's to answer
    assert asyncio.run(admit(state, ask)) is None
    refusal = no_replica(state, ask)
    assert refusal.status == 503 and refusal.message == (
        "no replica of 'a' can take the request: no replica is placed yet; its fallbacks "
        "could not take it either: no replica of 'b' can take the request: no replica is "
        "placed yet; no replica of 'c' can take the request: no replica is placed yet; no "
        "replica of 'd' can take the request: no replica is placed yet")


def test_a_replica_on_its_way_is_waited_for_before_falling_back() -> None:
    state = _state({"b": ["b0"]}, queue_wait_s=0.2)
    state.controller.expecting = lambda model: model == "a"
    ask = _ask()
    assert decide(state, ask) is Wait.SLOT  # a's replica may come: not b yet

    async def run() -> tuple[Lease | None, float]:
        began = asyncio.get_running_loop().time()
        return await admit(state, ask), asyncio.get_running_loop().time() - began
    lease, waited = asyncio.run(run())
    assert lease is not None and lease.replica == "b0" and 0.2 <= waited < 1.2
    lease.release()


def test_a_full_queue_sends_the_request_to_the_fallback_and_the_last_refusal_names_all():
    async def run() -> None:
        state = _state({"a": ["a0"], "b": ["b0"], "c": ["c0"], "d": ["d0"]})
        held = [decide(state, _ask(BODY.replace(b'"a"', f'"{m}"'.encode())))
                for m in "abc"]
        assert [h.replica for h in held] == ["a0", "b0", "c0"]  # each at its one slot
        ask = _ask()
        assert decide(state, ask) is Wait.SLOT  # a is busy, not gone: it would queue
        lease = await admit(state, ask)  # a's queue refuses (no wait): b's, c's; then d
        assert lease.replica == "d0" and ask.model == "d"
        lease.release()
        held.append(decide(state, _ask(BODY.replace(b'"a"', b'"d"'))))
        refused = _ask()
        with pytest.raises(ApiError) as caught:
            await admit(state, refused)
        err = caught.value
        assert (err.status, err.code) == (429, "queue_full")
        assert err.message.startswith("every replica of 'a' is busy")
        assert "its fallbacks could not take it either: every replica of 'b' is busy" in \
            err.message and "every replica of 'd' is busy" in err.message
        for h in held:
            h.release()
    asyncio.run(run())


def test_requests_waiting_for_a_replica_on_its_way_are_as_many_as_the_queue_holds() -> None:
    """A flood for a model whose replica is starting (a wake, a restart) waits in a
    bounded number; the rest are refused at once, or go to a fallback."""
    state = _state({}, queue_wait_s=5, queue_max=2)
    state.controller.expecting = lambda model: model == "c"
    body = BODY.replace(b'"a"', b'"c"')  # c names no fallbacks

    async def run() -> None:
        waiting = [asyncio.create_task(admit(state, _ask(body))) for _ in range(2)]
        for _ in range(100):  # loop turns until both wait (one is enough today)
            if state.awaiting.get("c") == 2:
                break
            await asyncio.sleep(0)
        assert state.awaiting == {"c": 2}
        with pytest.raises(ApiError) as refused:
            await admit(state, _ask(body))
        assert (refused.value.status, refused.value.code) == (429, "queue_full")
        assert refused.value.message.startswith(
            "2 request(s) already wait for a replica of 'c' to start"), refused.value.message
        state.router.update({"c": [("c0", "127.0.0.1", 1000, 2)]})
        leases = await asyncio.gather(*waiting)
        assert [lease.replica for lease in leases] == ["c0", "c0"]
        assert state.awaiting == {}
        for lease in leases:
            lease.release()
    asyncio.run(run())
