"""The flake through Nix's own flake CLI, offline, with its inputs replaced by stand-ins.

``nix flake check --no-build`` evaluates every output of every system and instantiates
each derivation (the package, the apps, the devShell, both checks with the VM test's
driver), as on a machine with nixpkgs, except that nothing is built. The package is uv.lock's
set through uv2nix's call shapes (tests/nix/stand-ins/uv2nix reads uv.lock itself).
"""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from tests.nixos.conftest import HARNESS, ROOT, Nix, copy_tree

SYSTEMS = ["aarch64-linux", "x86_64-linux"]
STAND_INS = ["uv2nix", "pyproject-nix", "pyproject-build-systems"]


@pytest.fixture(scope="module")
def flake(nix: Nix, tmp_path_factory) -> list[str]:
    """The flake reference and the arguments that replace its inputs."""
    # A flake input holds everything it reads: nixpkgs' lib and NixOS's code go inside.
    nixpkgs = tmp_path_factory.mktemp("inputs") / "nixpkgs"
    copy_tree(HARNESS / "stand-ins" / "nixpkgs", nixpkgs)
    copy_tree(nix.lib, nixpkgs / "lib")
    copy_tree(nix.excerpts, nixpkgs / "excerpts")
    copy_tree(HARNESS, nixpkgs / "harness")
    # The checkout as git sees it (tracked files, as in a clean clone); not .venv and the rest.
    reference = f"git+file://{ROOT}" if (ROOT / ".git").exists() else f"path:{ROOT}"
    args = ["--offline", "--no-write-lock-file", "--override-input", "nixpkgs", f"path:{nixpkgs}"]
    for name in STAND_INS:
        args += ["--override-input", name, f"path:{HARNESS / 'stand-ins' / name}"]
    return [reference, *args]


def evaluate(nix: Nix, flake: list[str], attribute: str, *flags: str) -> str:
    reference, *args = flake
    return nix.ok("nix", "eval", *flags, f"{reference}#{attribute}", *args)


def test_flake_check_evaluates_every_output_offline(nix, flake):
    reference, *args = flake
    result = nix.run("nix", "flake", "check", "--no-build", "--all-systems", reference, *args)
    assert result.returncode == 0, result.stderr[-6000:]
    # Nothing unknown or omitted: every output was checked.
    assert "omitted" not in result.stderr and "unknown flake output" not in result.stderr, \
        result.stderr


def test_every_output_instantiates(nix, flake):
    for system in SYSTEMS:
        for attribute in ("packages.{s}.default", "packages.{s}.llmgw", "devShells.{s}.default",
                          "checks.{s}.llmgw", "checks.{s}.vm", "checks.{s}.vm.driver"):
            drv = evaluate(nix, flake, attribute.format(s=system) + ".drvPath", "--raw")
            assert re.fullmatch(r"/nix/store/[0-9a-z]{32}-.+\.drv", drv), (attribute, drv)


def test_the_apps_run_the_package(nix, flake):
    system = "x86_64-linux"
    apps = json.loads(evaluate(nix, flake, f"apps.{system}", "--json"))
    package = evaluate(nix, flake, f"packages.{system}.llmgw.outPath", "--raw")
    assert apps["default"] == {"type": "app", "program": f"{package}/bin/llmgw",
                               "meta": {"description": "llmgw"}}
    assert apps["ctl"]["type"] == "app"
    # The program's string context names the derivation that writes it.
    (ctl_drv,) = json.loads(evaluate(nix, flake, f"apps.{system}.ctl.program", "--json",
                                     "--apply", "p: builtins.attrNames (builtins.getContext p)"))
    script = nix.derivations(ctl_drv)[apps["ctl"]["program"]]
    assert script["env"]["text"] == f'exec {package}/bin/llmgw ctl "$@"'


def test_the_package_is_uv_locks_set_on_python_3_11(nix, flake):
    """The environment holds exactly uv.lock's pins of the default dependencies: each of
    pyproject.toml's pins at its version, and nothing of nixpkgs' python3Packages."""
    drv = evaluate(nix, flake, "packages.x86_64-linux.llmgw.drvPath", "--raw")
    closure = nix.derivations(drv)
    names = {d["name"] for d in closure.values()}
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    locked = {p["name"]: p["version"] for p in lock["package"]}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for spec in pyproject["project"]["dependencies"]:
        name, version = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", spec).groups()
        assert locked[name] == version, spec
        assert f"{name}-{version}" in names, spec
    assert "python3-3.11.14" in names
    assert not [n for n in names if n.startswith(("python3.11-", "python3.13-"))], names
    # The dev group is not in the package; it is in the unit tests' environment.
    assert not [n for n in names if n.startswith(("pytest-", "hypothesis-"))]
    check = nix.derivations(evaluate(nix, flake, "checks.x86_64-linux.llmgw.drvPath", "--raw"))
    assert f"pytest-{locked['pytest']}" in {d["name"] for d in check.values()}


def test_the_lock_pins_each_input_by_rev_and_nar_hash():
    """The form of the lock; the hashes themselves are checked where the inputs can be
    fetched (nix/check.sh: `nix flake check` refuses a narHash its tree does not have)."""
    lock = json.loads((ROOT / "flake.lock").read_text())
    assert lock["version"] == 7
    root = lock["nodes"][lock["root"]]
    assert set(root["inputs"]) == {"nixpkgs", *STAND_INS}
    for name in root["inputs"]:
        locked = lock["nodes"][name]["locked"]
        assert locked["type"] == "github"
        assert re.fullmatch(r"[0-9a-f]{40}", locked["rev"]), name
        assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", locked["narHash"]), name
    # uv2nix and the build systems take this flake's nixpkgs and pyproject.nix.
    assert lock["nodes"]["uv2nix"]["inputs"] == {"nixpkgs": ["nixpkgs"],
                                                 "pyproject-nix": ["pyproject-nix"]}
    assert lock["nodes"]["pyproject-build-systems"]["inputs"] == {
        "nixpkgs": ["nixpkgs"], "pyproject-nix": ["pyproject-nix"], "uv2nix": ["uv2nix"]}
