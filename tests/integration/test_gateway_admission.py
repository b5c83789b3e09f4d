"""Admission, decided once (``admission.decide``) for both ways a request is served: what it
decides for each kind of request, and that the task path (``admit``) waits for exactly what
the decision waits for. In process, with a real router and catalog; no engine is needed."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import msgspec
import pytest

from llmgw.core.usage import Limits
from llmgw.server.errors import ApiError
from llmgw.server.openai import routes
from llmgw.server.openai.admission import Ask, Wait, admit, decide
from llmgw.server.openai.router import Lease, Router
from llmgw.store import ApiKeyRecord
from llmgw.transport.pool import JSON_TYPE
from tests.integration.gateway_state import gateway_state

MODEL = "m1"
BODY = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "user": "u"}'


def _key(**fields) -> ApiKeyRecord:
    return ApiKeyRecord(id=7, prefix="abcd", secret_hash="00", name="k",
                        created_at=datetime(2026, 1, 1, tzinfo=UTC), **fields)


def _ask(body: bytes = BODY, key: ApiKeyRecord | None = None) -> Ask:
    return Ask("/v1/chat/completions", "chat", routes._parse(body, "messages"), body,
               JSON_TYPE, key)


def _state(*replicas: str, slots: int = 1):
    router = Router(rng=random.Random(3))
    router.update({MODEL: [(name, "127.0.0.1", 1000 + i, slots)
                           for i, name in enumerate(replicas)]})
    return gateway_state(MODEL, router, pool=None)


def test_a_request_a_free_replica_can_take_goes_with_a_lease():
    state = _state("r0")
    lease = decide(state, _ask())
    assert type(lease) is Lease and lease.replica == "r0"
    lease.release()


def test_a_model_the_key_may_not_use_is_refused_before_anything_waits():
    state = _state("r0")
    refusal = decide(state, _ask(key=_key(allowed_models=["other"])))
    assert isinstance(refusal, ApiError) and refusal.status == 403
    unknown = decide(state, _ask(BODY.replace(b'"m1"', b'"m2"')))
    assert isinstance(unknown, ApiError) and unknown.status == 404
    assert "did you mean m1" in str(unknown)
    # Refused, nothing was leased.
    assert state.router.in_flight() == {"r0": 0}


def test_a_key_with_limits_waits_for_the_store_and_one_without_does_not():
    state = _state("r0")
    limited = _ask(key=_key(limits=Limits(rpm=5)))
    assert decide(state, limited) is Wait.LIMITS
    assert state.router.in_flight() == {"r0": 0}  # no slot held while it waits
    limited.admitted = True  # what ``admit`` sets once the store counted it
    lease = decide(state, limited)
    assert type(lease) is Lease
    lease.release()
    unlimited = decide(state, _ask(key=_key()))
    assert type(unlimited) is Lease
    unlimited.release()


def test_a_full_model_waits_for_a_slot_and_one_already_tried_is_not_taken_again():
    state = _state("r0", "r1")
    ask = _ask()
    first = decide(state, ask)
    ask.refused_by(first.replica, "refused")
    second = decide(state, ask)
    assert type(second) is Lease and second.replica != first.replica
    ask.refused_by(second.replica, "refused")
    assert decide(state, ask) is Wait.SLOT
    first.release()
    second.release()


async def test_the_task_path_waits_in_the_queue_for_the_slot_the_decision_waited_for():
    state = _state("r0")
    held = decide(state, _ask())
    assert type(held) is Lease
    waiting = asyncio.ensure_future(admit(state, _ask()))
    for _ in range(100):  # until the task has run up to its wait, a few steps of the loop
        if state.router.queue_lengths().get(MODEL, 0):
            break
        await asyncio.sleep(0)
    # Queued, not refused.
    assert state.router.queue_lengths().get(MODEL, 0) == 1 and not waiting.done()
    held.release()
    lease = await asyncio.wait_for(waiting, 5)
    assert lease.replica == "r0"
    lease.release()


async def test_the_task_path_raises_the_refusal_the_decision_made():
    state = _state("r0")
    with pytest.raises(ApiError) as refused:
        await admit(state, _ask(key=_key(allowed_models=["other"])))
    assert refused.value.status == 403


def test_a_model_with_no_ready_replica_waits_and_the_task_path_gets_none():
    state = _state()
    assert decide(state, _ask()) is Wait.SLOT
    assert asyncio.run(admit(state, _ask())) is None


def test_a_request_waits_for_a_replica_on_its_way_and_goes_when_it_is_ready():
    async def run() -> tuple[Lease | None, float]:
        state = _state()
        state.controller.expecting = lambda model: True
        began = asyncio.get_running_loop().time()
        waiting = asyncio.create_task(admit(state, _ask()))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        state.router.update({MODEL: [("r0", "127.0.0.1", 1000, 1)]})
        lease = await waiting
        return lease, asyncio.get_running_loop().time() - began

    lease, waited = asyncio.run(run())
    assert lease is not None and lease.replica == "r0" and 0.05 <= waited < 1
    lease.release()


def test_a_replica_that_does_not_come_within_the_queue_wait_leaves_the_request_to_a_503():
    async def run() -> tuple[Lease | None, float]:
        state = _state()
        state.config.gateway = msgspec.structs.replace(state.config.gateway,
                                                       queue_wait_s=0.3)
        state.controller.expecting = lambda model: True
        began = asyncio.get_running_loop().time()
        return await admit(state, _ask()), asyncio.get_running_loop().time() - began

    lease, waited = asyncio.run(run())
    assert lease is None and 0.3 <= waited < 1.3
