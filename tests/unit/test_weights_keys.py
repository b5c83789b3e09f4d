"""Weights sources and keys: what a profile names, and what a node holding it reports."""

from __future__ import annotations

import pytest

from llmgw import config
from llmgw.core.catalog import CatalogError, model_from_config
from llmgw.core.placement import place
from llmgw.core.weights import (
    Source,
    SourceError,
    check_patterns,
    directory_name,
    parse_source,
    weights_key,
)
from tests.unit.shapes import cpu_avx2, holding


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct", Source("Qwen/Qwen2.5-0.5B-Instruct")),
        ("hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0", Source("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")),
        ("hf://org/m@a1b2c3d4e5f60718293a4b5c6d7e8f9012345678",
         Source("org/m", "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678")),
        ("https://huggingface.co/Qwen/Qwen2.5-7B",
         Source("Qwen/Qwen2.5-7B", "main", "https://huggingface.co")),
        ("http://mirror.lan:8080/Qwen/Qwen2.5-7B/tree/refs/pr/3",
         Source("Qwen/Qwen2.5-7B", "refs/pr/3", "http://mirror.lan:8080")),
    ],
)
def test_sources_parse(text: str, source: Source) -> None:
    assert parse_source(text) == source


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("Qwen/Qwen2.5", "use hf://ORG/NAME"),
        ("hf://Qwen", "must be ORG/NAME"),
        ("hf://a/b/c", "must be ORG/NAME"),
        ("hf://../etc", "must be ORG/NAME"),
        ("hf://org/m@..", "not a branch"),
        ("https://user:pw@hub.lan/org/m", "without credentials"),
        ("https://hub.lan/org/m?token=x", "without credentials"),
        ("https://hub.lan/org", "expected https://HOST/ORG/NAME"),
        ("ftp://hub.lan/org/m", "use hf://ORG/NAME"),
    ],
)
def test_bad_sources_say_what_to_write(text: str, words: str) -> None:
    with pytest.raises(SourceError, match=words):
        parse_source(text)


def test_the_key_ignores_the_host_so_a_mirror_copy_counts() -> None:
    hub = parse_source("https://huggingface.co/org/m")
    mirror = parse_source("http://mirror.lan/org/m")
    assert weights_key(hub) == weights_key(mirror) == weights_key(parse_source("hf://org/m"))
    assert weights_key(hub) == "org/m@main"


def test_the_key_names_the_files_picked() -> None:
    source = parse_source("hf://org/m-GGUF@v2")
    key = weights_key(source, check_patterns(["*Q8_0.gguf", "*Q4_K_M.gguf", "*Q8_0.gguf"]))
    assert key == "org/m-GGUF@v2[*Q4_K_M.gguf,*Q8_0.gguf]"
    assert key != weights_key(source, ("*Q8_0.gguf",))


@pytest.mark.parametrize("pattern", ["../x", "/etc/passwd", "a b", "x;rm", ""])
def test_bad_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(SourceError, match="not allowed"):
        check_patterns([pattern])


def test_directory_names_are_one_safe_element_and_distinct() -> None:
    a = directory_name("org/m-GGUF@v2[*Q4_K_M.gguf]")
    b = directory_name("org/m-GGUF@v2[*Q8_0.gguf]")
    assert a != b
    for name in (a, b, directory_name("org/m@refs/pr/3")):
        assert "/" not in name and not name.startswith(".")
        assert name.startswith("org--m")


def _model(**profile) -> config.Model:
    return config.Model(name="qwen", profiles=[config.Profile(engine="llama.cpp", **profile)])


def test_the_catalog_keys_each_profile() -> None:
    model = model_from_config(_model(source="hf://org/q-GGUF", files=["*Q4_K_M.gguf"]))
    assert model.weights_key(model.profiles[0]) == "org/q-GGUF@main[*Q4_K_M.gguf]"
    plain = model_from_config(_model(weights="/models/q.gguf"))
    assert plain.weights_key(plain.profiles[0]) == "qwen"


@pytest.mark.parametrize(
    ("profile", "words"),
    [
        ({"source": "qwen"}, r"models\[0\].profiles\[0\]: weights source 'qwen'"),
        ({"source": "hf://org/q", "files": ["../x"]}, "file pattern '../x' is not allowed"),
        ({"files": ["*.gguf"]}, "files is set but source is not"),
    ],
)
def test_the_catalog_refuses_bad_sources_by_path(profile: dict, words: str) -> None:
    with pytest.raises(CatalogError, match=words):
        model_from_config(_model(**profile), "models[0]")


def test_placement_prefers_the_node_holding_the_profiles_key_not_the_models_name() -> None:
    model = model_from_config(_model(source="hf://org/q-GGUF", files=["*Q4_K_M.gguf"]))
    profile = model.profiles[0]
    nodes = [cpu_avx2("node1"), holding(cpu_avx2("node2"), "qwen"),
             holding(cpu_avx2("node3"), "org/q-GGUF@main[*Q4_K_M.gguf]")]

    result = place(model, profile, nodes, {})

    # node2 holds weights under the model's name, which is not this profile's key.
    assert result.placement.shards[0].node_id == "node3"
