"""server.yaml and agent.yaml: what an operator writes is checked strictly, and every error
names the file and the key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw import config
from llmgw.config import AgentConfig, ConfigError, ServerConfig, load, parse
from llmgw.core.catalog import Catalog, CatalogError, Model, Profile, catalog_from_config

SERVER_YAML = """\
listen:
  host: 0.0.0.0
  port: 8443
state_dir: /srv/llmgw
store:
  url: postgresql+asyncpg://llmgw@db/llmgw
nodes:
  heartbeat_interval_s: 2
  unreachable_after_s: 10
  lost_after_s: 45
controller:
  restart_backoff_initial_s: 5
models:
  - name: Qwen/Qwen2.5-72B-Instruct
    replicas: 2
    description: the big one
    profiles:
      - name: tp8
        engine: vllm
        gpus: 8
        gpu_memory_mib: 70000
        args: [--max-model-len, "32768"]
        env: {VLLM_USE_V1: "1", HF_HUB_OFFLINE: "1"}
        startup_timeout_s: 1200
      - name: cpu
        engine: llama.cpp
        weights: /models/qwen2.5-72b-q4_k_m.gguf
  - name: sim:tiny
    profiles:
      - engine: sim
log_level: debug
"""

AGENT_YAML = """\
servers: [https://cp1:8443, https://cp2:8443]
node_id: node03
port_range: [21000, 21999]
fabric: ib-b
labels: {rack: r12}
engines:
  llama.cpp: {binary: /opt/llama/bin/llama-server, version: b10991}
reconnect: {initial_s: 1, max_s: 60}
"""


def write(tmp_path: Path, text: str, name: str = "server.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(text: str, kind: type = ServerConfig, source: str = "server.yaml") -> str:
    with pytest.raises(ConfigError) as caught:
        parse(yaml.safe_load(text), kind, source)
    return str(caught.value)


def with_profile(line: str) -> str:
    return f"models:\n  - name: m\n    profiles:\n      - engine: vllm\n        {line}\n"


# --- good files ------------------------------------------------------------------------------


def test_load_a_good_server_yaml(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, SERVER_YAML), ServerConfig)

    assert cfg.listen.host == "0.0.0.0"
    assert cfg.listen.port == 8443
    assert cfg.store.url == "postgresql+asyncpg://llmgw@db/llmgw"
    assert cfg.nodes.lost_after_s == 45.0
    assert cfg.controller.restart_backoff_initial_s == 5.0
    assert cfg.controller.restart_backoff_max_s == 300.0  # the default
    assert cfg.log_level == "debug"
    big, tiny = cfg.models
    assert (big.name, big.replicas, [p.name for p in big.profiles]) == (
        "Qwen/Qwen2.5-72B-Instruct", 2, ["tp8", "cpu"]
    )
    assert big.profiles[0].gpus == 8
    assert big.profiles[0].args == ["--max-model-len", "32768"]
    assert big.profiles[1].weights == "/models/qwen2.5-72b-q4_k_m.gguf"
    assert (tiny.replicas, tiny.profiles[0].name) == (1, "default")


def test_load_a_good_agent_yaml(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, AGENT_YAML, "agent.yaml"), AgentConfig)

    assert cfg.servers == ["https://cp1:8443", "https://cp2:8443"]
    assert cfg.node_id == "node03"
    assert cfg.port_range == (21000, 21999)
    assert cfg.fabric == "ib-b"
    assert cfg.labels == {"rack": "r12"}
    assert cfg.engines["llama.cpp"] == config.EnginePath("/opt/llama/bin/llama-server", "b10991")
    assert cfg.reconnect.max_s == 60.0
    assert cfg.runtime == "auto"
    assert cfg.stop_shards_on_exit is False


def test_an_empty_server_yaml_is_all_defaults(tmp_path: Path) -> None:
    assert load(write(tmp_path, ""), ServerConfig) == ServerConfig()


@pytest.mark.parametrize(("text", "kind"), [(SERVER_YAML, ServerConfig), (AGENT_YAML, AgentConfig)])
def test_dump_reads_back_the_same(text: str, kind: type) -> None:
    cfg = parse(yaml.safe_load(text), kind)

    assert parse(yaml.safe_load(config.dump(cfg)), kind) == cfg


# --- errors name the file and the key path -------------------------------------------------


def test_unknown_key_names_its_path_and_says_it_is_unknown() -> None:
    message = error_of(with_profile("gpu: 2"))

    assert message == "server.yaml: models[0].profiles[0]: object contains unknown field gpu"


def test_unknown_top_level_key() -> None:
    assert error_of("listen_port: 8080") == (
        "server.yaml: object contains unknown field listen_port"
    )


def test_wrong_type_names_the_path_and_both_types() -> None:
    message = error_of(with_profile('gpus: "two"'))

    assert message.startswith("server.yaml: models[0].profiles[0].gpus: expected int, got str")


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        (with_profile("gpus: -1"), ServerConfig, "models[0].profiles[0].gpus: expected int >= 0"),
        (with_profile("nodes: 0"), ServerConfig, "models[0].profiles[0].nodes: expected int >= 1"),
        ("models: [{name: m, endpoints: [{url: 1}]}]", ServerConfig,
         "models[0].endpoints[0].url: expected str, got int"),
        ("models: [{profiles: [{engine: sim}]}]", ServerConfig,
         "models[0]: object missing required field name"),
        ("listen: {port: 70000}", ServerConfig, "listen.port: expected int <= 65535"),
        ("nodes: {lost_after_s: 0}", ServerConfig, "nodes.lost_after_s: expected float > 0"),
        ("auth: {require_api_key: 'yes'}", ServerConfig,
         "auth.require_api_key: expected bool, got str"),
        ("log_level: loud", ServerConfig, "log_level: invalid enum value 'loud'"),
        ("{}", AgentConfig, "object missing required field servers"),
        ("servers: []", AgentConfig, "servers: expected array of length >= 1"),
        ("servers: [a]\nport_range: [1, 2, 3]", AgentConfig, "port_range: expected array"),
        ("servers: [a]\nport_range: [0, 2]", AgentConfig, "port_range[0]: expected int >= 1"),
        ("servers: [a]\nruntime: docker", AgentConfig, "runtime: invalid enum value 'docker'"),
    ],
)
def test_type_and_range_errors_name_the_key(text: str, kind: type, expected: str) -> None:
    assert error_of(text, kind).startswith(f"server.yaml: {expected}")


def test_a_non_string_key_names_its_path_like_any_other_error() -> None:
    message = error_of("listen:\n  8080: true\n")

    assert message.startswith("server.yaml: listen: ")
    assert "$" not in message


# --- rules across fields -------------------------------------------------------------------


def test_duplicate_model_names_are_refused() -> None:
    text = "models:\n" + "  - {name: m, profiles: [{engine: sim}]}\n" * 2

    assert error_of(text) == "server.yaml: models[1].name: 'm' is declared twice"


def test_a_key_written_twice_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "models:\n  - {name: a, profiles: [{engine: sim}]}\n"
        "listen: {port: 8443}\n"
        "models:\n  - {name: b, profiles: [{engine: sim}]}\n",
    )

    with pytest.raises(ConfigError, match="models"):
        load(path, ServerConfig)


@pytest.mark.parametrize(
    ("profiles", "index", "name"),
    [
        ("[{engine: sim}, {engine: vllm}]", 1, "default"),
        ("[{name: a, engine: sim}, {name: b, engine: sim}, {name: a, engine: vllm}]", 2, "a"),
    ],
)
def test_duplicate_profile_names_are_refused(profiles: str, index: int, name: str) -> None:
    message = error_of(f"models:\n  - name: m\n    profiles: {profiles}\n")

    assert message.startswith(f"server.yaml: models[0].profiles[{index}].name: {name!r} is used")


@pytest.mark.parametrize(
    "nodes",
    [
        "{unreachable_after_s: 100}",  # above the default lost_after_s of 60
        "{heartbeat_interval_s: 15}",  # equal to the default unreachable_after_s
        "{heartbeat_interval_s: 5, unreachable_after_s: 30, lost_after_s: 30}",
    ],
)
def test_timeouts_out_of_order_are_refused(nodes: str) -> None:
    assert error_of(f"nodes: {nodes}") == (
        "server.yaml: nodes: need heartbeat_interval_s < unreachable_after_s < lost_after_s"
    )


def test_reversed_port_range_is_refused() -> None:
    message = error_of("servers: [a]\nport_range: [20999, 20000]", AgentConfig, "agent.yaml")

    assert message == "agent.yaml: port_range: 20999 is above 20000; write it low, high"


def test_a_one_port_range_is_allowed() -> None:
    assert parse({"servers": ["a"], "port_range": [20000, 20000]}, AgentConfig).port_range == (
        20000, 20000
    )


# --- files that are not config -------------------------------------------------------------


def test_not_yaml_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "models: [\n  - name: m\n")

    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        load(path, ServerConfig)
    assert str(caught.value).startswith(f"{path}: not valid YAML")


@pytest.mark.parametrize(
    ("text", "got"), [("- a\n- b\n", "list"), ("just words\n", "str"), ("42\n", "int")]
)
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str, got: str) -> None:
    path = write(tmp_path, text)

    with pytest.raises(ConfigError) as caught:
        load(path, ServerConfig)
    assert str(caught.value) == f"{path}: expected a mapping at the top level, got {got}"


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "server.yaml"

    with pytest.raises(ConfigError) as caught:
        load(path, ServerConfig)
    assert str(caught.value) == f"{path}: cannot read: No such file or directory"


def test_a_binary_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe binary")

    with pytest.raises(ConfigError) as caught:
        load(path, ServerConfig)
    assert str(caught.value).startswith(f"{path}: ")


# --- the catalog from config -----------------------------------------------------------------


def models_of(text: str) -> list[config.Model]:
    return parse(yaml.safe_load(text), ServerConfig).models


def catalog_error(text: str) -> str:
    with pytest.raises(CatalogError) as caught:
        catalog_from_config(models_of(text))
    return str(caught.value)


def test_catalog_from_a_good_config() -> None:
    catalog = catalog_from_config(models_of(SERVER_YAML))

    assert catalog.names() == ["Qwen/Qwen2.5-72B-Instruct", "sim:tiny"]
    big = catalog.get("Qwen/Qwen2.5-72B-Instruct")
    assert big is not None
    assert big.replicas == 2
    assert big.description == "the big one"
    assert big.profile("tp8") == Profile(
        name="tp8",
        engine="vllm",
        gpus=8,
        gpu_memory_mib=70000,
        args=("--max-model-len", "32768"),
        env=(("HF_HUB_OFFLINE", "1"), ("VLLM_USE_V1", "1")),
        startup_timeout_s=1200.0,
    )
    assert catalog.get("sim:tiny") == Model("sim:tiny", (Profile("default", "sim"),))
    assert catalog.get("sim:huge") is None
    assert catalog_from_config([]) == Catalog()


def test_catalog_lookup_by_name_finds_the_first_of_a_name_and_is_not_compared() -> None:
    first, second = Model("m", (Profile("a", "sim"),)), Model("m", (Profile("b", "sim"),))
    other = Model("n", (Profile("a", "sim"),))
    catalog = Catalog((first, second, other))
    assert catalog.get("m") is first and catalog.get("n") is other
    assert catalog.get("x") is None
    assert catalog == Catalog((first, second, other))  # the index takes no part
    assert "_by_name" not in repr(catalog)


def test_unknown_engine_is_refused_listing_the_known_ones() -> None:
    message = catalog_error("models: [{name: m, profiles: [{engine: ollama}]}]")

    assert message == (
        "models[0].profiles[0].engine: unknown engine 'ollama'; "
        "use one of comfyui, llama.cpp, sglang, sim, vllm"
    )


@pytest.mark.parametrize("name", ["../x", "", "a b", ".hidden", "x/../y", "-flag", "a" * 129])
def test_bad_model_name_is_refused(name: str) -> None:
    text = "models:\n  - {name: m, profiles: [{engine: sim}]}\n"
    text += f"  - {{name: {name!r}, profiles: [{{engine: sim}}]}}\n"

    assert catalog_error(text).startswith(f"models[1].name: model name {name!r} is not allowed")


@pytest.mark.parametrize("name", ["a/b", "../x", ".x", "with space"])
def test_bad_profile_name_is_refused(name: str) -> None:
    message = catalog_error(f"models: [{{name: m, profiles: [{{name: {name!r}, engine: sim}}]}}]")

    assert message.startswith(f"models[0].profiles[0].name: profile name {name!r} is not allowed")


def test_gpu_memory_without_gpus_is_refused() -> None:
    message = catalog_error(
        "models: [{name: m, profiles: [{engine: sim}, {name: v, engine: vllm, "
        "gpu_memory_mib: 20000}]}]"
    )

    assert message == "models[0].profiles[1].gpu_memory_mib is set but gpus is 0; set gpus too"
