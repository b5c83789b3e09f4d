"""Every Nix example in docs/nixos.md, evaluated as an operator would use it.

Each ```nix block starts with a comment naming its file (``# cp1.nix``). The machines'
flake (``# flake.nix``) is called with the stand-in nixpkgs, whose ``lib.nixosSystem`` is
the small NixOS of tests/nix, and llmgw's own outputs; the other blocks are its modules.
Each ```yaml block named ``# server.yaml from cp1.nix`` is what the module must write from
that example, store hashes aside.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from llmgw.config import AgentConfig, ServerConfig, load
from tests.nixos.conftest import ROOT, STORE_HASH, Nix, Rendered, harness_expression

DOCS = ROOT / "docs" / "nixos.md"
BLOCK = re.compile(r"^```(nix|yaml)\n(.*?)^```", re.M | re.S)


def blocks(kind: str) -> dict[str, str]:
    """The page's blocks of one kind, by the name their first line gives."""
    found: dict[str, str] = {}
    for lang, body in BLOCK.findall(DOCS.read_text()):
        if lang != kind:
            continue
        first = body.splitlines()[0]
        match = re.fullmatch(r"# (\S+(?: from \S+)?)", first.strip())
        if kind == "nix":
            assert match and match.group(1).endswith(".nix"), (
                f"docs/nixos.md: a nix block must start with `# FILE.nix`, not {first!r}")
        if match:
            found[match.group(1)] = body
    return found


@pytest.fixture(scope="module")
def examples(nix: Nix, tmp_path_factory) -> dict[str, dict]:
    """Each machine the docs' examples make, evaluated."""
    directory = tmp_path_factory.mktemp("docs")
    files = blocks("nix")
    for name, body in files.items():
        (directory / name).write_text(body)
    modules = sorted(n for n in files if n != "flake.nix")
    machines = nix.eval(f"""
      let
        h = {harness_expression(nix)};
        machines = (import {directory}/flake.nix).outputs {{
          nixpkgs = h.nixpkgs; llmgw = h.llmgw; self = {{ }}; }};
      in builtins.mapAttrs (_: h.report) machines.nixosConfigurations
        // {{ {" ".join(f'"{n}" = h.nixos [ h.llmgw.nixosModules.default {directory}/{n} ];'
                        for n in modules)} }}""")
    return machines


def test_every_nix_example_evaluates(examples):
    files = set(blocks("nix"))
    assert {"flake.nix", "cp1.nix", "gpu-01.nix", "lab.nix"} <= files
    machines = {"cp1", "gpu-01"}  # the flake's nixosConfigurations
    assert machines | (files - {"flake.nix"}) == set(examples)
    for name, machine in examples.items():
        assert machine["failedAssertions"] == [], name
        assert machine["units"], name


def test_the_flake_imports_each_role_alone(examples):
    assert set(examples["cp1"]["units"]) == {"llmgw-server.service", "llmgw-server.socket"}
    assert set(examples["gpu-01"]["units"]) == {"llmgw-agent.service"}
    assert examples["cp1"]["firewall"]["allowedTCPPorts"] == [8080, 8443]
    assert examples["gpu-01"]["firewall"]["allowedTCPPortRanges"] == [
        {"from": 20000, "to": 20999}]
    assert examples["gpu-01"]["tmpfiles"] == ["d /var/lib/llmgw-weights 0755 root root -"]


def _normalised(data: dict) -> dict:
    return json.loads(STORE_HASH.sub("/nix/store/<hash>-", json.dumps(data)))


@pytest.mark.parametrize(("machine", "unit", "file", "kind"), [
    ("cp1", "llmgw-server.service", "server.yaml from cp1.nix", ServerConfig),
    ("gpu-01", "llmgw-agent.service", "agent.yaml from gpu-01.nix", AgentConfig),
])
def test_the_docs_show_what_the_module_writes(nix, examples, tmp_path: Path, machine, unit,
                                              file, kind):
    rendered = Rendered(nix, examples[machine])
    command = rendered.exec_start(unit)
    if command.endswith("-start"):  # the server's start script
        command = rendered.script(unit)
    written = rendered.yaml_of(command)
    shown = yaml.safe_load(blocks("yaml")[file])
    assert _normalised(written) == shown
    path = tmp_path / file.split()[0]
    path.write_text(yaml.safe_dump(written))
    load(path, kind)


def test_the_lab_machine_runs_both_roles_on_ipv6(nix, examples, tmp_path):
    lab = examples["lab.nix"]
    assert set(lab["units"]) == {"llmgw-server.service", "llmgw-server.socket",
                                 "llmgw-agent.service"}
    rendered = Rendered(nix, lab)
    assert "ListenStream=[::1]:8080" in lab["units"]["llmgw-server.socket"]
    agent = rendered.yaml_of(rendered.exec_start("llmgw-agent.service"))
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(agent))
    assert load(path, AgentConfig).servers == ["http://[::1]:8080"]
