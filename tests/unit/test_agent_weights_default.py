"""Where a hand-run agent keeps weights when agent.yaml names no weights directories: under
its state_dir, never /var/lib, so that an agent run as a user from elsewhere writes only
where it was told."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.agent.weights import WeightsStore
from llmgw.config import AgentConfig, ConfigError, WeightsDirectory, load, parse

SERVERS = "servers: [http://127.0.0.1:8080]\n"


def test_without_a_weights_section_the_weights_live_under_state_dir(tmp_path):
    state = tmp_path / "agent-state"
    (tmp_path / "agent.yaml").write_text(SERVERS + f"state_dir: {state}\n")
    config = load(tmp_path / "agent.yaml", AgentConfig)
    assert config.weights_directories() == [WeightsDirectory(path=str(state / "weights"))]

    # What the agent does at start: its store is made from the config and prepared.
    store = WeightsStore.from_config(config)
    assert [d.path for d in store.directories] == [state / "weights"]
    assert store.prepare() == [f"created {state / 'weights'}"]
    assert (state / "weights").is_dir()
    assert all("/var/lib" not in str(d.path) for d in store.directories)


def test_a_weights_section_without_directories_follows_state_dir_too(tmp_path):
    config = parse({"servers": ["http://127.0.0.1:8080"], "state_dir": str(tmp_path),
                    "weights": {"hub": "http://mirror.example:8080"}}, AgentConfig)
    assert [d.path for d in config.weights_directories()] == [str(tmp_path / "weights")]


def test_directories_agent_yaml_names_are_kept(tmp_path):
    config = parse({"servers": ["http://127.0.0.1:8080"], "state_dir": str(tmp_path),
                    "weights": {"directories": [{"path": "/srv/models", "shared": True}]}},
                   AgentConfig)
    assert config.weights_directories() == [WeightsDirectory(path="/srv/models", shared=True)]


def test_the_default_state_dir_keeps_the_weights_where_nodes_have_them():
    # Nodes set up with the defaults have their weights in /var/lib/llmgw-weights: an
    # upgrade must not send them looking elsewhere (and fetch everything again).
    config = parse({"servers": ["http://127.0.0.1:8080"]}, AgentConfig)
    assert config.weights_directories() == [WeightsDirectory(path="/var/lib/llmgw-weights")]


def test_an_empty_list_of_directories_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"weights.directories: expected array of length >= 1"):
        parse({"servers": ["http://127.0.0.1:8080"], "weights": {"directories": []}},
              AgentConfig)


def test_the_derived_directory_is_never_written_back(tmp_path):
    # `llmgw agent join` writes the keys that differ from the defaults: the directory made
    # from state_dir must not be among them, so that it keeps following state_dir.
    config = parse({"servers": ["http://127.0.0.1:8080"], "state_dir": str(tmp_path)},
                   AgentConfig)
    assert msgspec.to_builtins(config)["weights"] == {}
