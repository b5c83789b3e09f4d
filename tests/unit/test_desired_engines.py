"""What the control plane asks each node to install (core.desired_engines)."""

from __future__ import annotations

import pytest

from llmgw import config, wire
from llmgw.core import engine_names
from llmgw.core.desired_engines import desired_engines, settings_problems

V100 = wire.Gpu(index=0, name="Tesla V100-SXM2-32GB", memory_total_mib=32768,
                memory_free_mib=32000)
H100 = wire.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_mib=81559,
                memory_free_mib=81000)
NEW_AGENT = ["llama.cpp", "sglang", "vllm"]


def server(**yaml) -> config.ServerConfig:
    return config.parse(yaml, config.ServerConfig)


def register(node_id="n1", *, gpus=(), labels=None, disabled=(), installable=NEW_AGENT,
             features=()):
    return wire.Register(
        node_id=node_id, address="10.0.0.1",
        inventory=wire.Inventory(hostname=node_id, gpus=list(gpus), labels=labels or {},
                                 disabled_engines=list(disabled)),
        installable_engines=None if installable is None else list(installable),
        features=list(features))


def asked(cfg: config.ServerConfig, reg: wire.Register) -> dict[str, str]:
    return {e.name: e.version for e in desired_engines(cfg, reg)}


def test_by_default_every_node_gets_the_llama_cpp_this_release_was_checked_against():
    [llama] = desired_engines(server(), register())
    assert (llama.name, llama.version, llama.build) == ("llama.cpp", "b11434", "auto")
    assert llama.release_url == "https://github.com/ggml-org/llama.cpp/releases/download"
    assert llama.digests_url == (
        "https://api.github.com/repos/ggml-org/llama.cpp/releases/tags/b11434")


def test_vllm_is_off_unless_named_and_then_defaults_to_0_30_0():
    assert "vllm" not in asked(server(), register(gpus=[H100]))
    assert asked(server(engines={"llama.cpp": {}, "vllm": {}}), register(gpus=[H100])) == {
        "llama.cpp": "b11434", "vllm": "0.30.0"}


def test_an_agent_that_says_nothing_is_asked_for_llama_cpp_alone():
    cfg = server(engines={"llama.cpp": {}, "vllm": {}, "sglang": {"version": "0.5.23"}})
    assert asked(cfg, register(installable=None)) == {"llama.cpp": "b11434"}
    assert asked(cfg, register(installable=["llama.cpp", "vllm"])) == {
        "llama.cpp": "b11434", "vllm": "0.30.0"}


def test_an_engine_the_node_disables_is_not_asked_for():
    cfg = server(engines={"llama.cpp": {}, "vllm": {}})
    assert asked(cfg, register(disabled=["vllm"])) == {"llama.cpp": "b11434"}


def test_overrides_pick_nodes_by_gpu_class_id_or_labels():
    cfg = server(engines={"llama.cpp": {}, "vllm": {}}, engine_overrides=[
        {"gpu_class": "V100", "versions": {"vllm": "0.19.1"}},
        {"nodes": ["edge-1"], "build": {"llama.cpp": "vulkan"}, "disable": ["vllm"]},
        {"labels": {"pool": "canary"}, "versions": {"llama.cpp": "b11500"}},
    ])
    assert asked(cfg, register(gpus=[V100]))["vllm"] == "0.19.1"
    assert asked(cfg, register(gpus=[H100]))["vllm"] == "0.30.0"
    edge = desired_engines(cfg, register("edge-1"))
    assert [(e.name, e.build) for e in edge] == [("llama.cpp", "vulkan")]
    assert asked(cfg, register(labels={"pool": "canary"}))["llama.cpp"] == "b11500"
    assert asked(cfg, register(labels={"pool": "stable"}))["llama.cpp"] == "b11434"


def test_every_selector_of_an_override_must_match_and_the_later_one_wins():
    cfg = server(engine_overrides=[
        {"gpu_class": "H100", "labels": {"zone": "a"}, "versions": {"llama.cpp": "b1"}},
        {"nodes": ["n9"], "versions": {"llama.cpp": "b2"}},
    ])
    assert asked(cfg, register(gpus=[H100]))["llama.cpp"] == "b11434"
    assert asked(cfg, register(gpus=[H100], labels={"zone": "a"}))["llama.cpp"] == "b1"
    assert asked(cfg, register("n9", gpus=[H100], labels={"zone": "a"}))["llama.cpp"] == "b2"


def test_an_override_can_give_some_nodes_an_engine_the_others_lack():
    cfg = server(engine_overrides=[{"gpu_class": "H100", "versions": {"vllm": "0.30.0"}}])
    assert asked(cfg, register(gpus=[H100])) == {"llama.cpp": "b11434", "vllm": "0.30.0"}
    assert asked(cfg, register()) == {"llama.cpp": "b11434"}


def test_build_none_keeps_an_engine_off_a_node():
    cfg = server(engine_overrides=[{"nodes": ["n1"], "build": {"llama.cpp": "none"}}])
    assert desired_engines(cfg, register("n1")) == []
    assert asked(cfg, register("n2")) == {"llama.cpp": "b11434"}


def test_a_mirror_serves_every_engine_with_its_sha256sums():
    cfg = server(engine_mirror="http://mirror.lan/engines/")
    [llama] = desired_engines(cfg, register())
    assert llama.release_url == "http://mirror.lan/engines/llama.cpp"
    assert llama.digests_url == "http://mirror.lan/engines/llama.cpp/b11434/SHA256SUMS"


def test_pinned_checksums_and_an_own_release_url_are_passed_on():
    pin = {"llama-b11434-bin-ubuntu-x64.tar.gz": "ab" * 32}
    cfg = server(engines={"llama.cpp": {"release_url": "http://files.lan/llama/",
                                        "sha256": pin}})
    [llama] = desired_engines(cfg, register())
    assert llama.release_url == "http://files.lan/llama"
    assert llama.sha256 == pin


@pytest.mark.parametrize("version", ["../x", "..", ".x", "a/b"])
def test_an_unsafe_version_is_never_sent_and_is_named_at_start(version):
    cfg = server(engines={"llama.cpp": {"version": version}})
    assert desired_engines(cfg, register()) == []
    [problem] = settings_problems(cfg)
    assert "engines.llama.cpp.version" in problem and "is not allowed" in problem


def test_settings_problems_name_the_key_of_a_bad_build_or_a_missing_version():
    cfg = server(engines={"sglang": {}},
                 engine_overrides=[{"nodes": ["n1"], "build": {"vllm": "cu118"}}])
    problems = settings_problems(cfg)
    assert problems == [
        "engines.sglang.version: sglang has no default version; name one",
        "engine_overrides[0].build.vllm: 'cu118' is not a build of vllm; use auto, none or "
        "one of cu130, cu129, cu128",
    ]
    assert settings_problems(server()) == []


def test_comfyui_takes_only_the_sha256_server_yaml_pins_for_its_tag_archive():
    pin = {"v0.3.60.tar.gz": "cd" * 32}
    cfg = server(engines={"comfyui": {"version": "0.3.60", "sha256": pin}})
    gpu = register(gpus=[H100], installable=[*NEW_AGENT, "comfyui"])
    [comfyui] = desired_engines(cfg, gpu)
    assert comfyui.release_url == "https://github.com/comfyanonymous/ComfyUI/archive/refs/tags"
    assert (comfyui.digests_url, comfyui.sha256) == ("", pin)
    assert settings_problems(cfg) == []
    # A mirror serves the archive; its SHA256SUMS is not asked for.
    [mirrored] = desired_engines(server(engines={"comfyui": {"version": "0.3.60"}},
                                        engine_mirror="http://mirror.lan/e"), gpu)
    assert (mirrored.release_url, mirrored.digests_url) == ("http://mirror.lan/e/comfyui", "")
    # An agent that cannot install it is not asked.
    assert "comfyui" not in asked(cfg, register(gpus=[H100]))


def test_a_comfyui_version_without_a_pinned_sha256_is_named_at_start():
    cfg = server(engines={"comfyui": {"version": "0.3.60",
                                      "sha256": {"v0.3.60.tar.gz": "cd" * 32}}},
                 engine_overrides=[{"gpu_class": "L4", "versions": {"comfyui": "0.3.59"}}])
    assert settings_problems(cfg) == [
        "engines.comfyui.sha256: no sha256 for v0.3.59.tar.gz; GitHub publishes no digest "
        "for a tag's source archive, so ComfyUI 0.3.59 cannot be checked and no node "
        "installs it: pin the archive's sha256 there"]


def test_an_unknown_engine_in_server_yaml_is_a_config_error_naming_the_key():
    with pytest.raises(config.ConfigError, match="engines"):
        server(engines={"vlm": {}})


def test_every_installable_engine_can_be_asked_for():
    cfg = server(engines={name: {"version": "1.0"} for name in engine_names.INSTALLABLE})
    every = register(installable=engine_names.INSTALLABLE)
    assert asked(cfg, every) == dict.fromkeys(engine_names.INSTALLABLE, "1.0")


# --- the control plane's own mirror (an imported bundle) ---------------------------------

ARCHIVE = "llama-b11434-bin-ubuntu-x64.tar.gz"
VULKAN = "llama-b11434-bin-ubuntu-vulkan-x64.tar.gz"
BUNDLE = {"llama.cpp": {"b11434": {ARCHIVE: "1a" * 32, VULKAN: "2b" * 32}}}


def mirror_agent(node_id="n1", **kwargs):
    return register(node_id, features=[wire.FEATURE_MIRROR], **kwargs)


def test_a_bundled_version_comes_from_the_control_planes_mirror_pinned_by_the_manifest():
    [llama] = desired_engines(server(), mirror_agent(), BUNDLE)
    assert (llama.name, llama.version) == ("llama.cpp", "b11434")
    assert llama.release_url == "llmgw-mirror:/mirror/files/engines/llama.cpp"
    assert llama.release_url == f"{wire.MIRROR_ENGINES_URL}/llama.cpp"
    # Every file pinned from the manifest; no list of digests is ever read from the mirror.
    assert llama.sha256 == {ARCHIVE: "1a" * 32, VULKAN: "2b" * 32}
    assert llama.digests_url == ""


def test_the_mirror_wins_over_engine_mirror_and_over_pins_in_server_yaml():
    cfg = server(engine_mirror="http://mirror.lan/engines",
                 engines={"llama.cpp": {"sha256": {ARCHIVE: "ff" * 32}}})
    [llama] = desired_engines(cfg, mirror_agent(), BUNDLE)
    assert llama.release_url.startswith(wire.MIRROR_SCHEME)
    assert llama.sha256[ARCHIVE] == "1a" * 32


def test_a_version_the_bundle_lacks_comes_from_where_it_did():
    cfg = server(engines={"llama.cpp": {"version": "b12000"}})
    [llama] = desired_engines(cfg, mirror_agent(), BUNDLE)
    assert llama.version == "b12000"
    assert llama.release_url == "https://github.com/ggml-org/llama.cpp/releases/download"
    assert llama.sha256 == {}


def test_without_a_version_in_server_yaml_the_bundles_one_version_is_taken():
    bundle = {"llama.cpp": {"b12000": {ARCHIVE.replace("11434", "12000"): "3c" * 32}}}
    [llama] = desired_engines(server(), mirror_agent(), bundle)
    assert llama.version == "b12000" and llama.release_url.startswith(wire.MIRROR_SCHEME)
    # Several, none of them this release's default: which one is not guessed.
    several = {"llama.cpp": {"b12000": {}, "b12001": {}}}
    [llama] = desired_engines(server(), mirror_agent(), several)
    assert llama.version == "b11434" and not llama.release_url.startswith(wire.MIRROR_SCHEME)
    # The default among several: that one.
    [llama] = desired_engines(server(), mirror_agent(), {"llama.cpp": {
        "b12000": {}, "b11434": {ARCHIVE: "1a" * 32}}})
    assert llama.version == "b11434" and llama.sha256 == {ARCHIVE: "1a" * 32}


def test_an_agent_that_cannot_reach_the_mirror_is_sent_the_usual_urls():
    # An older agent would try to download "llmgw-mirror:/…" as it is.
    [llama] = desired_engines(server(), register(), BUNDLE)
    assert llama.release_url == "https://github.com/ggml-org/llama.cpp/releases/download"
    assert llama.sha256 == {}


def test_an_overrides_version_is_mirrored_for_the_nodes_it_picks():
    bundle = {"llama.cpp": {"b11434": {ARCHIVE: "1a" * 32}, "b11500": {"x.tar.gz": "4d" * 32}}}
    cfg = server(engine_overrides=[{"labels": {"pool": "canary"},
                                    "versions": {"llama.cpp": "b11500"}}])
    [canary] = desired_engines(cfg, mirror_agent(labels={"pool": "canary"}), bundle)
    assert (canary.version, canary.sha256) == ("b11500", {"x.tar.gz": "4d" * 32})
    [stable] = desired_engines(cfg, mirror_agent(), bundle)
    assert (stable.version, stable.sha256) == ("b11434", {ARCHIVE: "1a" * 32})


def test_a_mirrored_comfyui_archive_sits_under_its_version():
    bundle = {"comfyui": {"0.3.60": {"v0.3.60.tar.gz": "cd" * 32}}}
    cfg = server(engines={"comfyui": {"version": "0.3.60"}})
    gpu = mirror_agent(gpus=[H100], installable=[*NEW_AGENT, "comfyui"])
    [comfyui] = desired_engines(cfg, gpu, bundle)
    assert comfyui.release_url == "llmgw-mirror:/mirror/files/engines/comfyui/0.3.60"
    assert (comfyui.digests_url, comfyui.sha256) == ("", {"v0.3.60.tar.gz": "cd" * 32})
