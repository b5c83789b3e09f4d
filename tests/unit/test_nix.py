"""The Nix flake and NixOS modules, as far as a machine without nixpkgs can check them.

What these tests prove, with Debian's nix-bin (Nix 2.8) and no nixpkgs:
- every .nix file in the repository parses (``nix-instantiate --parse``);
- flake.nix's ``inputs`` and ``outputs`` arguments match flake.lock, a lock file of
  version 7 pinning nixpkgs;
- calling ``outputs`` with stub inputs gives the expected output names for each system
  (packages, apps, checks, devShells, nixosModules): names only, no derivation is built
  or even evaluated, since each needs nixpkgs;
- the modules' renderers (nixos-modules/lib.nix, builtins only) turn the example options of
  docs/nixos.md into exactly nixos-modules/examples/*.yaml, and llmgw's own config loader
  accepts those files;
- nix/deps.nix, which the package's dependencies come from, names every dependency of
  pyproject.toml.
What they do not prove: that the modules evaluate under nixpkgs' module system, that the
package builds, or that the VM test passes; those need nixpkgs (`nix flake check`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from llmgw.config import AgentConfig, ServerConfig, load

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "nixos-modules" / "examples"
SYSTEMS = ["aarch64-linux", "x86_64-linux"]
# What the example's pkgs.llama-cpp.override gives, less the build: a store path.
STUB_PKGS = ('{ llama-cpp.override = _: { outPath = '
             '"/nix/store/00000000000000000000000000000000-llama-cpp-6981"; version = "6981"; }; }')


def _nix_instantiate() -> str:
    found = shutil.which("nix-instantiate")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("nix-instantiate is missing: .ci/run installs Debian's nix-bin")
    pytest.skip("nix-instantiate is not installed (apt-get install nix-bin)")


def _run(*args: str) -> str:
    result = subprocess.run([_nix_instantiate(), *args], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, f"nix-instantiate {' '.join(args)}:\n{result.stderr}"
    return result.stdout


def _eval(expression: str):
    """The JSON value of a Nix expression."""
    return json.loads(_run("--eval", "--strict", "--json", "--expr", expression))


def _nix_files() -> list[Path]:
    skip = {".venv", ".tools", ".git", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.nix") if not skip & set(p.relative_to(ROOT).parts))


def test_every_nix_file_parses():
    files = _nix_files()
    assert {"flake.nix", "nixos-modules/server.nix", "nixos-modules/agent.nix"} <= {
        str(p.relative_to(ROOT)) for p in files}
    for path in files:
        _run("--parse", str(path))


def test_flake_inputs_are_the_locked_ones():
    lock = json.loads((ROOT / "flake.lock").read_text())
    assert lock["version"] == 7
    root = lock["nodes"][lock["root"]]
    flake = _eval(f"let f = import {ROOT}/flake.nix; in "
                  "{ inputs = f.inputs; args = builtins.functionArgs f.outputs; }")
    assert set(flake["args"]) == {"self", *flake["inputs"]}
    assert set(flake["inputs"]) == set(root["inputs"])
    for name, spec in flake["inputs"].items():
        node = lock["nodes"][root["inputs"][name]]
        original = node["original"]
        assert spec["url"] == (f"{original['type']}:{original['owner']}/{original['repo']}/"
                               f"{original['ref']}")
        assert re.fullmatch(r"[0-9a-f]{40}", node["locked"]["rev"])
        assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", node["locked"]["narHash"])
    assert lock["nodes"]["nixpkgs"]["original"]["ref"].startswith("nixos-")


def test_flake_outputs_have_the_expected_names():
    # Stub inputs: nixpkgs is never forced while only names are read.
    names = _eval(f"""
      let
        flake = import {ROOT}/flake.nix;
        outputs = flake.outputs {{ self = outputs; nixpkgs = {{ }}; }};
        perSystem = name: builtins.mapAttrs (_: builtins.attrNames) outputs.${{name}};
      in {{
        top = builtins.attrNames outputs;
        packages = perSystem "packages";
        apps = perSystem "apps";
        checks = perSystem "checks";
        devShells = perSystem "devShells";
        modules = builtins.mapAttrs (_: m: builtins.isFunction m || builtins.isAttrs m)
          outputs.nixosModules;
        appTypes = builtins.mapAttrs (_: a: a.ctl.type) outputs.apps;
      }}""")
    assert names["top"] == ["apps", "checks", "devShells", "nixosModules", "packages"]
    assert names["packages"] == {s: ["default", "llmgw"] for s in SYSTEMS}
    assert names["apps"] == {s: ["ctl", "default"] for s in SYSTEMS}
    assert names["checks"] == {s: ["llmgw", "vm"] for s in SYSTEMS}
    assert names["devShells"] == {s: ["default"] for s in SYSTEMS}
    assert names["modules"] == {"agent": True, "default": True, "server": True}
    assert names["appTypes"] == {s: "app" for s in SYSTEMS}


@pytest.mark.parametrize(("role", "render"), [("server", "renderServer"),
                                               ("agent", "renderAgent")])
def test_the_module_renders_the_sample_file(role, render):
    rendered = _eval(f"(import {ROOT}/nixos-modules/lib.nix).{render} "
                     f"(import {EXAMPLES}/{role}.nix {{ pkgs = {STUB_PKGS}; }})")
    assert rendered == yaml.safe_load((EXAMPLES / f"{role}.yaml").read_text())


def test_options_left_null_are_not_written():
    """null means llmgw's own default, so the module never restates one."""
    rendered = _eval(f"""(import {ROOT}/nixos-modules/lib.nix).renderAgent {{
        servers = [ "http://10.0.0.1:8080" ]; nodeId = null; fabric = null; labels = null;
        weights = {{ directories = null; hub = null; tokenFile = null; }}; tls = null;
        settings = {{ reconnect.max_s = 10; }}; }}""")
    assert rendered == {"servers": ["http://10.0.0.1:8080"], "state_dir": "/var/lib/llmgw-agent",
                        "runtime": "systemd", "install_os_packages": False,
                        "reconnect": {"max_s": 10}}


def test_an_engine_without_package_or_binary_is_refused():
    result = subprocess.run(
        [_nix_instantiate(), "--eval", "--strict", "--json", "--expr",
         f"(import {ROOT}/nixos-modules/lib.nix).renderAgent "
         '{ servers = [ "http://a:8080" ]; engines.vllm = { }; }'],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert 'services.llmgw.agent.engines."vllm": set package' in result.stderr


def test_the_package_takes_every_dependency_of_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower()
              for d in pyproject["project"]["dependencies"]}
    names = _eval(f"import {ROOT}/nix/deps.nix "
                  f"(builtins.fromTOML (builtins.readFile {ROOT}/pyproject.toml))")
    assert set(names) == wanted | {"greenlet"}  # sqlalchemy[asyncio]


# --- without Nix: the rendered files are what llmgw reads -----------------------------------


def test_the_samples_load_with_llmgw_config():
    server = load(EXAMPLES / "server.yaml", ServerConfig)
    assert server.listen.host == "10.0.0.1"
    assert server.tls is not None
    assert server.tls.key_file == "/run/credentials/llmgw-server.service/tls-key"
    assert server.store.url.startswith("postgresql+asyncpg://llmgw@")
    assert [m.name for m in server.models] == ["qwen2.5-7b", "sim-small"]
    agent = load(EXAMPLES / "agent.yaml", AgentConfig)
    assert agent.engines["llama.cpp"].binary.endswith("-llama-cpp-6981/bin/llama-server")
    assert agent.runtime == "systemd"
    assert [d.shared for d in agent.weights.directories] == [False, True]


def _tokens(nix: str) -> list[str]:
    return " ".join(line.split("#")[0] for line in nix.splitlines()).split()


@pytest.mark.parametrize("role", ["server", "agent"])
def test_the_docs_show_the_example(role):
    """docs/nixos.md's example is the one rendered above (comments and layout aside)."""
    example = (EXAMPLES / f"{role}.nix").read_text()
    body = _tokens(example.split("{ pkgs }:", 1)[1])
    docs = _tokens((ROOT / "docs" / "nixos.md").read_text())
    start = f"services.llmgw.{role} = ".split()
    at = next((i for i in range(len(docs)) if docs[i:i + len(start)] == start), None)
    assert at is not None, f"docs/nixos.md has no `services.llmgw.{role} = {{`"
    at += len(start)
    assert docs[at:at + len(body)] == [*body[:-1], body[-1] + ";"], (
        f"docs/nixos.md's services.llmgw.{role} differs from {EXAMPLES.name}/{role}.nix")
