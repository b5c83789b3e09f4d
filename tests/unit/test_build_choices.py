"""The build an operator chooses per node (core.desired_engines): which choices are
refused and in what words, and how a choice wins over server.yaml's engine_overrides."""

from __future__ import annotations

import pytest

from llmgw import config, wire
from llmgw.core.builds import BUILD_NAMES
from llmgw.core.desired_engines import (
    BuildChoice,
    build_choice_refusal,
    build_choices,
    desired_engines,
)

H100 = wire.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_mib=81559,
                memory_free_mib=81000)


def server(**yaml) -> config.ServerConfig:
    return config.parse(yaml, config.ServerConfig)


def register(node_id="gpu-1", gpus=(H100,)) -> wire.Register:
    return wire.Register(
        node_id=node_id, address="10.0.0.1",
        inventory=wire.Inventory(hostname=node_id, gpus=list(gpus)),
        installable_engines=["llama.cpp", "sglang", "vllm"])


def builds(cfg: config.ServerConfig, reg: wire.Register, chosen=None) -> dict[str, str]:
    return {e.name: e.build for e in desired_engines(cfg, reg, chosen=chosen)}


@pytest.mark.parametrize(("engine", "choice"), [
    ("vllm", "cu129"), ("vllm", "auto"), ("vllm", "none"), ("llama.cpp", "vulkan"),
    ("llama.cpp", "cpu"), ("sglang", "cu130"), ("comfyui", "cu129")])
def test_auto_none_and_every_build_of_the_engine_are_choices(engine, choice):
    assert build_choice_refusal(engine, choice) is None
    assert build_choice_refusal(engine, choice, default_too=True) is None


def test_a_build_of_another_engine_is_refused_naming_this_engines():
    assert build_choice_refusal("llama.cpp", "cu129", default_too=True) == (
        "'cu129' is not a build of llama.cpp; use default, auto, none or one of "
        "cuda-13.3, cuda-12.8, vulkan, cpu")
    assert build_choice_refusal("vllm", "cu118") == (
        "'cu118' is not a build of vllm; use auto, none or one of cu130, cu129, cu128")


def test_default_is_a_choice_only_where_it_can_clear_one():
    assert build_choice_refusal("vllm", "default", default_too=True) is None
    assert "use auto, none or one of" in build_choice_refusal("vllm", "default")


def test_an_engine_llmgw_does_not_install_is_refused_naming_those_it_does():
    refusal = build_choice_refusal("sim", "auto", default_too=True)
    assert refusal == ("llmgw installs no engine 'sim'; name one of "
                       + ", ".join(BUILD_NAMES))
    assert "llama.cpp, vllm, sglang, comfyui" in refusal


def test_a_nodes_choice_wins_over_the_overrides_build_for_that_node_alone():
    cfg = server(engines={"llama.cpp": {}, "vllm": {}},
                 engine_overrides=[{"gpu_class": "H100", "build": {"vllm": "cu130"}}])
    assert builds(cfg, register()) == {"llama.cpp": "auto", "vllm": "cu130"}
    assert builds(cfg, register(), {"vllm": "cu129"}) == {"llama.cpp": "auto",
                                                          "vllm": "cu129"}
    # A stored auto is a choice too: the node takes its best, whatever the override says.
    assert builds(cfg, register(), {"vllm": "auto"})["vllm"] == "auto"
    assert builds(cfg, register("gpu-2"), {}) == {"llama.cpp": "auto", "vllm": "cu130"}


def test_none_keeps_the_engine_off_the_node():
    cfg = server(engines={"llama.cpp": {}, "vllm": {}})
    assert builds(cfg, register(), {"llama.cpp": "none"}) == {"vllm": "auto"}


def test_a_choice_names_no_engine_server_yaml_does_not_ask_for():
    assert builds(server(), register(), {"vllm": "cu129"}) == {"llama.cpp": "auto"}


def test_build_choices_say_what_decided_each_build():
    cfg = server(engines={"llama.cpp": {}, "vllm": {}, "sglang": {"version": "0.5.23"}},
                 engine_overrides=[{"nodes": ["gpu-1"], "build": {"sglang": "cu129",
                                                                  "vllm": "none"}}])
    assert build_choices(cfg, register(), {"vllm": "cu130", "comfyui": "cu129"}) == {
        "comfyui": BuildChoice("cu129", "node"),
        "llama.cpp": BuildChoice("auto", "default"),
        "sglang": BuildChoice("cu129", "server.yaml"),
        "vllm": BuildChoice("cu130", "node"),
    }
    assert build_choices(cfg, register("gpu-2")) == {
        "llama.cpp": BuildChoice("auto", "default"), "sglang": BuildChoice("auto", "default"),
        "vllm": BuildChoice("auto", "default")}
