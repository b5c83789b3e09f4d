"""The control plane's node upgrades in flight (server/agents/upgrades.py), by scenario:
what it sends the agent, and how the agent's reports, the node's registration and its
replicas move an upgrade to done or failed."""

from __future__ import annotations

import pytest

from llmgw import wire
from llmgw.core.replicas import Replica, ReplicaState, Shard
from llmgw.server.agents.upgrades import (
    ADOPTING,
    DONE,
    FAILED,
    RESTARTING,
    SENT,
    WORKING,
    AgentUpgrades,
    UpgradeBusy,
    UpgradeView,
)

OLD, NEW = "0.5.2", "0.6.0"
T0 = 1000.0
TIMEOUT_S = 600.0
WHEELS = [
    wire.UpgradeWheel(url=f"{wire.MIRROR_SCHEME}{wire.MIRROR_FILES}/wheels/"
                      "llmgw-0.6.0-py3-none-any.whl", sha256="11" * 32, size=900_000),
    wire.UpgradeWheel(url=f"{wire.MIRROR_SCHEME}{wire.MIRROR_FILES}/wheels/pydantic_core-"
                      "2.33.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                      sha256="22" * 32, size=2_000_000),
]


class Sent:
    """The controller's send: what each node was sent, and whether it was connected."""

    def __init__(self, connected: bool = True):
        self.connected = connected
        self.messages: list[tuple[str, wire.Down]] = []

    def __call__(self, node: str, message: wire.Down) -> bool:
        self.messages.append((node, message))
        return self.connected


def _running(replica: str, rank: int, world_size: int = 1) -> wire.RunningShard:
    return wire.RunningShard(replica=replica, rank=rank, world_size=world_size, epoch=3,
                             model="Qwen/Qwen2.5-7B", profile="tp1", engine="vllm",
                             port=20000 + rank, state="ready")


# gpu-1 runs rank 0 of a single-node replica and rank 1 of a two-node one.
SHARDS = [_running("qwen-e3", 0), _running("llama-70b-e3", 1, world_size=2)]


def _register(node: str = "gpu-1", version: str = OLD,
              running: list[wire.RunningShard] | None = None) -> wire.Register:
    return wire.Register(node_id=node, address="10.0.0.5",
                         inventory=wire.Inventory(hostname=node),
                         running=SHARDS if running is None else running,
                         agent_version=version, features=[wire.FEATURE_SELF_UPGRADE],
                         installation=wire.INSTALL_PYTHON)


def _replica(id: str, state: ReplicaState, *nodes: str) -> Replica:
    return Replica(id=id, model="m", profile="tp1", epoch=3, world_size=len(nodes),
                   shards=tuple(Shard(rank, node, "10.0.0.5", 20000 + rank,
                                      state="ready" if state is ReplicaState.READY
                                      else "starting")
                                for rank, node in enumerate(nodes)),
                   state=state, created_at=0.0)


def _status(upgrades: AgentUpgrades, sent: Sent, state: str, detail: str = "",
            now: float = T0 + 10, request: str | None = None, node: str = "gpu-1") -> None:
    if request is None:
        request = sent.messages[-1][1].request
    upgrades.reported(node, wire.UpgradeStatus(request=request, state=state, detail=detail),
                      now)


def _begin(upgrades: AgentUpgrades, node: str, register: wire.Register,
           now: float) -> UpgradeView:
    """begin(), with what the node serves as its Register lists it."""
    return upgrades.begin(node, NEW, WHEELS, register.agent_version,
                          [(s.replica, s.rank) for s in register.running], now, TIMEOUT_S)


def _begun(register: wire.Register | None = None) -> tuple[AgentUpgrades, Sent, UpgradeView]:
    sent = Sent()
    upgrades = AgentUpgrades(sent)
    view = _begin(upgrades, "gpu-1", register or _register(), T0)
    return upgrades, sent, view


def _restarted(register: wire.Register | None = None
               ) -> tuple[AgentUpgrades, Sent, UpgradeView]:
    """Begun, installed, and the agent about to run the new llmgw."""
    upgrades, sent, view = _begun(register)
    _status(upgrades, sent, wire.UPGRADE_WORKING, "installing llmgw 0.6.0", now=T0 + 10)
    _status(upgrades, sent, wire.UPGRADE_RESTARTING, "restarting into llmgw 0.6.0",
            now=T0 + 60)
    return upgrades, sent, view


# --- begin ---------------------------------------------------------------------------------


def test_begin_sends_the_agent_one_upgrade_with_the_wheels_and_version() -> None:
    upgrades, sent, view = _begun()

    [(node, message)] = sent.messages
    assert node == "gpu-1"
    assert isinstance(message, wire.UpgradeAgent)
    assert (message.version, message.wheels) == (NEW, WHEELS)
    assert len(message.request) == 16
    assert view == UpgradeView(node="gpu-1", version=NEW, from_version=OLD, state=SENT,
                               detail="asked the agent to upgrade", started_at=T0,
                               replicas=["llama-70b-e3", "qwen-e3"])
    assert upgrades.get("gpu-1") is view
    assert upgrades.under_way() is view
    assert upgrades.get("gpu-2") is None


def test_each_upgrade_has_its_own_request_id() -> None:
    upgrades, sent, _ = _begun()
    _status(upgrades, sent, wire.UPGRADE_FAILED, "no room")
    _begin(upgrades, "gpu-1", _register(), T0 + 100)
    first, second = (m.request for _, m in sent.messages)
    assert first != second


def test_a_second_node_waits_while_one_upgrades() -> None:
    upgrades, sent, _ = _begun()
    _status(upgrades, sent, wire.UPGRADE_WORKING, "downloading 2 wheels (2.9 MB)")

    with pytest.raises(UpgradeBusy) as refused:
        _begin(upgrades, "gpu-2", _register("gpu-2"), T0 + 20)

    assert str(refused.value) == (
        "node gpu-1 is upgrading to llmgw 0.6.0 (working: downloading 2 wheels (2.9 MB)); "
        "one node at a time: wait for it (llmgw ctl upgrade waits)")
    assert len(sent.messages) == 1
    assert upgrades.get("gpu-2") is None


def test_the_next_node_may_begin_once_one_has_finished() -> None:
    upgrades, sent, view = _begun()
    _status(upgrades, sent, wire.UPGRADE_FAILED, "no room")
    assert view.state == FAILED
    assert upgrades.under_way() is None

    second = _begin(upgrades, "gpu-2", _register("gpu-2"), T0 + 20)

    assert second.state == SENT
    assert [node for node, _ in sent.messages] == ["gpu-1", "gpu-2"]
    assert upgrades.get("gpu-1") is view  # the first one's outcome is still there to read


def test_begin_to_a_node_that_just_disconnected_fails_at_once() -> None:
    sent = Sent(connected=False)
    upgrades = AgentUpgrades(sent)

    view = _begin(upgrades, "gpu-1", _register(), T0)

    assert (view.state, view.finished_at) == (FAILED, T0)
    assert view.detail == "node gpu-1 disconnected just now; try again once it is back"
    assert upgrades.under_way() is None


def test_an_agent_that_never_said_its_version_upgrades_from_unknown() -> None:
    _, _, view = _begun(_register(version=""))
    assert view.from_version == "unknown"


# --- the agent's reports -------------------------------------------------------------------


def test_the_agent_reports_its_steps() -> None:
    upgrades, sent, view = _begun()

    _status(upgrades, sent, wire.UPGRADE_WORKING, "downloading 2 wheels (2.9 MB)")
    assert (view.state, view.detail) == (WORKING, "downloading 2 wheels (2.9 MB)")

    _status(upgrades, sent, wire.UPGRADE_WORKING, "checking that llmgw 0.6.0 runs")
    assert (view.state, view.detail) == (WORKING, "checking that llmgw 0.6.0 runs")

    _status(upgrades, sent, wire.UPGRADE_RESTARTING, "restarting into llmgw 0.6.0")
    assert (view.state, view.detail) == (RESTARTING, "restarting into llmgw 0.6.0")
    assert view.finished_at is None


def test_the_agent_failing_fails_the_upgrade_in_its_words() -> None:
    upgrades, sent, view = _begun()
    _status(upgrades, sent, wire.UPGRADE_WORKING, "installing llmgw 0.6.0")

    _status(upgrades, sent, wire.UPGRADE_FAILED,
            "llmgw 0.6.0 needs 11.4 MB free in /var/lib/llmgw/llmgw; 2.0 MB is", now=T0 + 30)

    assert (view.state, view.finished_at) == (FAILED, T0 + 30)
    assert view.detail == ("the agent did not upgrade: llmgw 0.6.0 needs 11.4 MB free in "
                           "/var/lib/llmgw/llmgw; 2.0 MB is")
    # Nothing moves a finished upgrade again.
    _status(upgrades, sent, wire.UPGRADE_WORKING, "late", now=T0 + 40)
    upgrades.registered(_register(version=NEW), T0 + 50)
    assert (view.state, view.finished_at) == (FAILED, T0 + 30)


def test_a_report_for_another_request_is_ignored() -> None:
    upgrades, sent, view = _begun()

    _status(upgrades, sent, wire.UPGRADE_FAILED, "from an upgrade asked of another leader",
            request="0123456789abcdef")
    _status(upgrades, sent, wire.UPGRADE_WORKING, "another node's", node="gpu-2")

    assert (view.state, view.detail) == (SENT, "asked the agent to upgrade")


# --- the node registering again ------------------------------------------------------------


def test_the_old_version_reconnecting_mid_install_is_a_blip() -> None:
    upgrades, sent, view = _begun()
    _status(upgrades, sent, wire.UPGRADE_WORKING, "installing llmgw 0.6.0")

    upgrades.registered(_register(version=OLD), T0 + 20)

    assert (view.state, view.detail) == (WORKING, "installing llmgw 0.6.0")
    _status(upgrades, sent, wire.UPGRADE_RESTARTING, "restarting into llmgw 0.6.0")
    assert view.state == RESTARTING  # the agent carried on


def test_the_old_version_back_after_the_restart_fails_the_upgrade() -> None:
    upgrades, _, view = _restarted()

    upgrades.registered(_register(version=OLD), T0 + 70)

    assert (view.state, view.finished_at) == (FAILED, T0 + 70)
    assert view.detail.startswith("the node came back running llmgw 0.5.2, not 0.6.0: ")


def test_the_new_version_with_every_shard_is_adopting() -> None:
    upgrades, _, view = _restarted()

    upgrades.registered(_register(version=NEW, running=list(reversed(SHARDS))), T0 + 70)

    assert (view.state, view.finished_at) == (ADOPTING, None)
    assert view.detail == "llmgw 0.6.0 registered and adopted 2 shard(s)"


def test_a_shard_not_running_after_the_restart_fails_the_upgrade_naming_it() -> None:
    upgrades, _, view = _restarted()

    upgrades.registered(_register(version=NEW, running=SHARDS[:1]), T0 + 70)

    assert (view.state, view.finished_at) == (FAILED, T0 + 70)
    assert view.detail == ("llmgw 0.6.0 runs, but it did not find llama-70b-e3 rank 1 "
                           "running as before: the control plane starts them again")


def test_a_node_that_ran_nothing_is_done_once_back() -> None:
    upgrades, _, view = _restarted(_register(running=[]))
    assert view.replicas == []

    upgrades.registered(_register(version=NEW, running=[]), T0 + 70)
    assert view.state == ADOPTING
    upgrades.refresh(T0 + 71, {})

    assert (view.state, view.finished_at) == (DONE, T0 + 71)
    assert view.detail == "llmgw 0.6.0 runs; no replica ran there"


def test_the_old_version_back_while_adopting_fails_the_upgrade() -> None:
    upgrades, _, view = _restarted()
    upgrades.registered(_register(version=NEW), T0 + 70)
    assert view.state == ADOPTING

    upgrades.registered(_register(version=OLD), T0 + 80)
    upgrades.refresh(T0 + 90, {"qwen-e3": _replica("qwen-e3", ReplicaState.READY, "gpu-1"),
                               "llama-70b-e3": _replica("llama-70b-e3", ReplicaState.READY,
                                                        "gpu-2", "gpu-1")})

    assert view.state == FAILED
    assert "came back running llmgw 0.5.2" in view.detail


def test_a_late_word_from_the_old_agent_changes_nothing_once_the_new_one_is_back() -> None:
    upgrades, sent, view = _restarted()
    upgrades.registered(_register(version=NEW), T0 + 70)

    _status(upgrades, sent, wire.UPGRADE_RESTARTING, "restarting into llmgw 0.6.0",
            now=T0 + 71)
    assert view.state == ADOPTING
    assert view.detail == "llmgw 0.6.0 registered and adopted 2 shard(s)"


# --- refresh -------------------------------------------------------------------------------


def test_adopting_waits_for_the_replicas_then_is_done() -> None:
    upgrades, _, view = _restarted()
    upgrades.registered(_register(version=NEW), T0 + 70)
    replicas = {
        "qwen-e3": _replica("qwen-e3", ReplicaState.READY, "gpu-1"),
        "llama-70b-e3": _replica("llama-70b-e3", ReplicaState.STARTING, "gpu-2", "gpu-1"),
        "other-e1": _replica("other-e1", ReplicaState.STARTING, "gpu-2"),  # not gpu-1's
    }

    upgrades.refresh(T0 + 80, replicas)
    assert (view.state, view.finished_at) == (ADOPTING, None)
    assert view.detail == "waiting for llama-70b-e3 to be ready again"
    assert upgrades.under_way() is view

    replicas["llama-70b-e3"] = _replica("llama-70b-e3", ReplicaState.READY, "gpu-2", "gpu-1")
    upgrades.refresh(T0 + 90, replicas)

    assert (view.state, view.finished_at) == (DONE, T0 + 90)
    assert view.detail == "llmgw 0.6.0 runs; 2 replica(s) adopted and ready"
    assert upgrades.under_way() is None


def test_adopting_names_every_replica_it_waits_for() -> None:
    upgrades, _, view = _restarted()
    upgrades.registered(_register(version=NEW), T0 + 70)

    upgrades.refresh(T0 + 80, {
        "qwen-e3": _replica("qwen-e3", ReplicaState.STARTING, "gpu-1"),
        "llama-70b-e3": _replica("llama-70b-e3", ReplicaState.FAILED, "gpu-2", "gpu-1"),
    })

    assert view.state == ADOPTING
    assert view.detail == "waiting for llama-70b-e3, qwen-e3 to be ready again"


def test_refresh_leaves_an_upgrade_within_its_time_alone() -> None:
    upgrades, sent, view = _begun()
    _status(upgrades, sent, wire.UPGRADE_WORKING, "installing llmgw 0.6.0")

    upgrades.refresh(T0 + TIMEOUT_S, {})

    assert (view.state, view.detail) == (WORKING, "installing llmgw 0.6.0")


@pytest.mark.parametrize("stage", ["sent", "working", "restarting", "adopting"])
def test_an_upgrade_not_done_in_time_fails_saying_where_it_was(stage: str) -> None:
    upgrades, sent, view = _begun()
    last = "asked the agent to upgrade"
    if stage != "sent":
        last = "installing llmgw 0.6.0"
        _status(upgrades, sent, wire.UPGRADE_WORKING, last)
    if stage in ("restarting", "adopting"):
        last = "restarting into llmgw 0.6.0"
        _status(upgrades, sent, wire.UPGRADE_RESTARTING, last)
    replicas = {"qwen-e3": _replica("qwen-e3", ReplicaState.STARTING, "gpu-1")}
    if stage == "adopting":
        upgrades.registered(_register(version=NEW), T0 + 70)
        last = "waiting for qwen-e3 to be ready again"

    upgrades.refresh(T0 + TIMEOUT_S + 1, replicas)

    assert (view.state, view.finished_at) == (FAILED, T0 + TIMEOUT_S + 1)
    assert view.detail == f"not done within 600 s; last: {last}"
