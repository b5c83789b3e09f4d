"""How far a node's llmgw is behind, and when a node is warned about."""

from __future__ import annotations

import pytest

import llmgw
from llmgw import wire
from llmgw.core.inventory import Timeouts
from llmgw.core.versions import behind_words, newer, releases_behind
from llmgw.server.admin.nodes import node_view
from llmgw.server.agents.sessions import NodeSessions


@pytest.mark.parametrize(("ours", "theirs", "behind"), [
    ("0.5.0", "0.5.3", 0),
    ("0.5.2", "0.5.0", 0),
    ("0.5.0", "0.4.9", 1),
    ("0.6.0rc1", "0.4.0", 2),
    ("1.0.0", "0.9.0", 1000),
    ("0.4.0", "0.6.0", 0),  # a node ahead is not behind
    ("0.5.0", "0.0.0+unknown", None),  # a source tree: cannot say
    ("0.5.0", "", None),
    ("0.5.0", "nightly", None),
])
def test_releases_behind(ours: str, theirs: str, behind: int | None) -> None:
    assert releases_behind(ours, theirs) == behind


@pytest.mark.parametrize(("version", "than", "later"), [
    ("0.10.1", "0.9.3", True),  # by number, not by string
    ("0.9.3", "0.10.1", False),
    ("0.6.0", "0.5.9", True),
    ("1.0.0", "0.99.99", True),
    ("0.5.1", "0.5", True),
    ("0.5", "0.5.1", False),
    ("0.1.0", "0.1.0", False),
    ("0.6.0rc1", "0.5.2", True),  # numbers differ: the suffix does not matter
    ("0.5.0rc1", "0.5.0", None),  # equal numbers, different versions: no order guessed
    ("0.5.0", "0.5.0rc1", None),
    ("1.0", "1.0.0", None),
    ("0.0.0+unknown", "0.5.0", False),
    ("nightly", "0.5.0", None),
    ("0.5.0", "", None),
    ("v0.6.0", "0.5.0", None),
])
def test_newer(version: str, than: str, later: bool | None) -> None:
    assert newer(version, than) is later


def test_a_node_two_releases_behind_is_warned_about_in_its_view(monkeypatch) -> None:
    assert behind_words("0.6.0", "0.5.1") is None  # one release behind: a rolling upgrade
    words = behind_words("0.6.0", "0.4.2")
    assert words == ("llmgw 0.4.2 is more than one release behind the control plane's "
                     "0.6.0: upgrade the node (docs/operations.md, Upgrading)")

    monkeypatch.setattr(llmgw, "__version__", "0.6.0", raising=False)
    sessions = NodeSessions(Timeouts())
    old, _ = sessions.attach(_register("gpu-1", "0.4.2"), 0.0)
    level, _ = sessions.attach(_register("gpu-2", "0.6.0"), 0.0)
    silent, _ = sessions.attach(_register("gpu-3", ""), 0.0)
    assert node_view(old, []).warnings == [words]
    assert node_view(old, []).llmgw_version == "0.4.2"
    assert node_view(level, []).warnings == []
    assert (node_view(silent, []).llmgw_version, node_view(silent, []).warnings) == (
        "unknown", [])


def _register(node: str, version: str) -> wire.Register:
    return wire.Register(node_id=node, address="10.0.0.5",
                         inventory=wire.Inventory(hostname=node), agent_version=version)
