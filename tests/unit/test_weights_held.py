"""Where `/api/status` says a model's weights are, per fabric (`weights_held`)."""

from __future__ import annotations

from llmgw import config, wire
from llmgw.core.catalog import model_from_config
from llmgw.core.inventory import NodeLiveness, NodeState
from llmgw.server.admin.status import WeightsHeld, weights_held
from llmgw.server.agents.sessions import NodeSession

MODEL = model_from_config(config.Model(name="qwen",
                                       profiles=[config.Profile(engine="llama.cpp")]))


def _node(node_id: str, fabric: str | None, state: NodeState = NodeState.READY,
          *dirs: wire.WeightsDir) -> NodeSession:
    inventory = wire.Inventory(hostname=node_id, fabric=fabric, weights_dirs=list(dirs))
    return NodeSession(node_id, wire.Register(node_id=node_id, address="10.0.0.1",
                                              inventory=inventory),
                       NodeLiveness(last_seen=0.0), state=state)


def _holding(path: str, shared: bool = False) -> wire.WeightsDir:
    return wire.WeightsDir(path=path, shared=shared, held=["qwen"])


def test_a_lost_node_s_weights_do_not_count_in_its_fabric() -> None:
    sessions = [_node("n1", "ib-a", NodeState.READY, _holding("/w")),
                _node("n2", "ib-a", NodeState.LOST, _holding("/w")),
                _node("n3", "ib-b", NodeState.LOST, _holding("/w"))]
    assert weights_held(MODEL, sessions) == [WeightsHeld("ib-a", ["n1"], [])]


def test_a_lost_node_s_shared_filer_counts_while_a_live_node_sees_it() -> None:
    filer = _holding("/lustre/w", shared=True)
    lost_only = [_node("n1", "ib-a", NodeState.LOST, filer)]
    assert weights_held(MODEL, lost_only) == []
    seen = [*lost_only, _node("n2", "ib-a", NodeState.UNREACHABLE, filer)]
    assert weights_held(MODEL, seen) == [WeightsHeld("ib-a", [], ["/lustre/w"])]
