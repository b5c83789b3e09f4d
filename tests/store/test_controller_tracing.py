"""The controller's traces and counts, against a real store: a replica's start is a span
whose context the StartShard carries, ended when the replica serves; with tracing off the
commands carry nothing; what the pass did is counted by kind."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw import config, wire
from llmgw.config import ServerConfig
from llmgw.core import reconcile
from llmgw.server.controller import Controller
from llmgw.store import Store
from llmgw.tracing import Tracing
from tests.store.controllers import controller_on


def _controller(store: Store, name: str, gpus: int = 0) -> Controller:
    """A controller whose server.yaml declares one model, of one replica."""
    model = config.Model(name=name, profiles=[config.Profile(engine="sim", gpus=gpus)])
    settings = ServerConfig(engines={}, models=[model])
    # The catalog comes from server.yaml's models at the first pass.
    return controller_on(store, settings=settings,
                         policy=reconcile.Policy(adoption_grace_s=0))


async def _node(controller: Controller, node_id: str) -> asyncio.Queue[wire.Down]:
    session, _ = await controller.node_registered(wire.Register(
        node_id=node_id, address="127.0.0.1", inventory=wire.Inventory(hostname=node_id)),
        controller.clock())
    return session.outbox


def _sent(outbox: asyncio.Queue[wire.Down], kind: type) -> list:
    found = []
    while not outbox.empty():
        message = outbox.get_nowait()
        if isinstance(message, kind):
            found.append(message)
    return found


async def test_a_start_carries_its_span_which_ends_when_the_replica_serves(
        store: Store) -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(config.Tracing(), exporter=exporter)
    controller = _controller(store, "m")
    controller.tracing = tracing
    outbox = await _node(controller, "node-a")
    await controller.pass_once()

    [start] = _sent(outbox, wire.StartShard)
    traceparent = start.trace["traceparent"]
    tracing.shutdown()  # flushes what ended so far: the pass and the placement
    ended = {s.name: s for s in exporter.get_finished_spans()}
    assert {"reconcile", "place m"} <= set(ended)
    assert f"start {start.replica}" not in ended, "open until the replica serves"
    trace_id = f"{ended['reconcile'].context.trace_id:032x}"
    assert traceparent.split("-")[1] == trace_id

    assert controller.stats.actions["place"].n == 1
    assert controller.stats.stream_connects.n == 1
    assert controller.stats.pass_seconds.counts != [0] * len(controller.stats.pass_seconds.counts)


async def test_with_tracing_off_commands_carry_no_trace_context(store: Store) -> None:
    controller = _controller(store, "m")
    outbox = await _node(controller, "node-a")
    await controller.pass_once()
    sent = _sent(outbox, wire.StartShard | wire.InstallEngines)
    assert {type(m) for m in sent} == {wire.StartShard, wire.InstallEngines}
    for message in sent:
        assert message.trace == {}
        assert b"trace" not in wire.encode(message)


async def test_a_refusal_is_counted_by_its_class_once_while_it_stays_the_same(
        store: Store) -> None:
    controller = _controller(store, "big", gpus=1)
    await _node(controller, "node-a")
    await _node(controller, "node-b")
    for _ in range(3):
        await controller.pass_once()
    assert {kind: count.n for kind, count in controller.stats.refusals.items()} == {"gpus": 2}
    assert controller.unplaced["big"] == ("node-a: needs 1 GPU, has no GPUs; "
                                          "node-b: needs 1 GPU, has no GPUs")
