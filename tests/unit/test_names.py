"""Name rules: what a model, a profile, a replica and a shard unit may be called."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.names import (
    NameRuleError,
    check_element,
    check_model_name,
    hostport,
    is_loopback_host,
    replica_id,
    shard_unit,
    unbracket,
    url_host,
)

# What systemd accepts in a unit name, without the escaping character.
UNIT_SAFE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@pytest.mark.parametrize(
    ("model", "epoch", "expected"),
    [
        ("Qwen/Qwen2.5-7B", 3, "qwen-qwen2.5-7b-e3"),
        ("meta-llama/Llama-3.1-8B-Instruct", 12, "meta-llama-llama-3.1-8b-instruct-e12"),
        ("org/name:tag", 1, "org-name-tag-e1"),
        ("sim:tiny", 40, "sim-tiny-e40"),
        ("a+b", 2, "a-b-e2"),
        ("////", 9, "model-e9"),
    ],
)
def test_replica_id_is_a_lowercase_unit_safe_slug_with_the_epoch(
    model: str, epoch: int, expected: str
) -> None:
    assert replica_id(model, epoch) == expected


def test_replica_id_of_a_long_name_is_cut_but_keeps_the_epoch() -> None:
    rid = replica_id("org/" + "x" * 200, 123456)

    assert rid.endswith("-e123456")
    assert len(rid) <= 48 + len("-e123456")


def test_replica_ids_differ_by_epoch_even_when_slugs_collide() -> None:
    # Two model names that slug alike still get distinct replicas: the epoch tells them apart.
    assert replica_id("Org/Model", 1) != replica_id("org-model", 2)


@settings(max_examples=200, deadline=None)
@given(
    model=st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}\Z").filter(
        lambda s: ".." not in s
    ),
    epoch=st.integers(1, 10**12),
)
def test_replica_id_of_any_valid_model_name_is_unit_safe(model: str, epoch: int) -> None:
    check_model_name(model)

    rid = replica_id(model, epoch)

    assert UNIT_SAFE.match(rid), rid
    assert rid.endswith(f"-e{epoch}")
    assert UNIT_SAFE.match(shard_unit(rid, 0))


@pytest.mark.parametrize(
    ("replica", "rank", "unit"),
    [
        ("qwen-qwen2.5-7b-e3", 0, "llmgw-shard-qwen-qwen2.5-7b-e3-0"),
        ("m-e1", 7, "llmgw-shard-m-e1-7"),
    ],
)
def test_shard_unit_names_the_replica_and_rank(replica: str, rank: int, unit: str) -> None:
    assert shard_unit(replica, rank) == unit


# --- model names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "org/name:tag",
        "Qwen/Qwen2.5-7B-Instruct",
        "llama3.1:8b",
        "llama3.1:8b-instruct-q4_K_M",
        "nvidia/Llama-3_1-Nemotron-51B-Instruct",
        "sim",
        "a+b",
        "x" * 128,
    ],
)
def test_check_model_name_accepts_the_usual_shapes(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "..", "org/../x", "a..b", ".hidden", "/abs", "-flag", ":tag", "a b", "a\tb", "é",
     "x" * 129, "a;rm", "a\\b"],
)
def test_check_model_name_rejects(name: str) -> None:
    with pytest.raises(NameRuleError, match=r"^model name .* is not allowed"):
        check_model_name(name)


# --- path elements --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tp8", "cpu", "q4.gguf", "a+b", "node-01", "x" * 64])
def test_check_element_accepts(name: str) -> None:
    assert check_element(name, "profile name") == name


@pytest.mark.parametrize(
    "name", ["", "../x", "..", ".hidden", "a/b", "a b", "-x", "x" * 65, "a:b", "a\\b"]
)
def test_check_element_rejects(name: str) -> None:
    with pytest.raises(NameRuleError, match=f"^profile name {re.escape(repr(name))} is not"):
        check_element(name, "profile name")


@pytest.mark.parametrize("check", [check_model_name, lambda n: check_element(n, "profile name")],
                         ids=["model", "element"])
def test_a_trailing_newline_is_rejected(check) -> None:
    with pytest.raises(NameRuleError):
        check("tp8\n")


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
    ("::ffff:127.0.0.1", True), ("localhost", True), ("fe80::1%lo", False),
    ("10.0.0.1", False), ("0.0.0.0", False), ("::", False), ("example.com", False),
    ("", False), (None, False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(("host", "shown"), [
    ("10.0.0.1", "10.0.0.1"), ("cp.example.org", "cp.example.org"), ("localhost", "localhost"),
    ("::1", "[::1]"), ("::", "[::]"), ("::ffff:10.0.0.1", "[::ffff:10.0.0.1]"),
    ("fe80::1%eth0", "[fe80::1%eth0]"), ("[::1]", "[::1]"), ("", "")])
def test_url_host_brackets_ipv6_once(host, shown):
    assert url_host(host) == shown
    assert hostport(host, 8443) == f"{shown}:8443"


@pytest.mark.parametrize(("host", "bare"), [
    ("[::1]", "::1"), ("[fe80::1%eth0]", "fe80::1%eth0"), ("::1", "::1"),
    ("10.0.0.1", "10.0.0.1"), ("cp.example.org", "cp.example.org"), ("[]", ""),
    ("[::1", "[::1"), ("::1]", "::1]")])
def test_unbracket_takes_off_one_pair(host, bare):
    assert unbracket(host) == bare


@given(st.ip_addresses().map(str))
def test_unbracket_undoes_url_host(address):
    assert unbracket(url_host(address)) == address
