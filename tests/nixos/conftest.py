"""Nix for the tests of llmgw's flake and NixOS modules.

nixpkgs cannot be downloaded here, and Debian 12's Nix (2.8) cannot evaluate nixpkgs 25.11's
lib. ``../shared/nixos-eval`` (beside the checkout) has what stands in: a Nix 2.26 run from a
cache directory, nixpkgs' real lib, and NixOS's own systemd code. Every call here runs with a
private store in a scratch directory, no substituters and no registry: nothing touches /nix
and nothing is fetched. Derivations are instantiated, never built.

Without ``../shared/nixos-eval`` these tests skip on a developer's machine and fail under
CI=true, where it is always laid beside the clone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "nix"
STORE_HASH = re.compile(r"/nix/store/[0-9a-z]{32}-")


def _nixos_eval() -> Path:
    return Path(os.environ.get("LLMGW_NIXOS_EVAL", ROOT.parent / "shared" / "nixos-eval"))


@dataclass
class Nix:
    """Nix 2.26 against a private store in ``scratch``."""

    tools: Path
    scratch: Path

    @property
    def lib(self) -> Path:
        return self.tools / "nixpkgs-lib" / "lib"

    @property
    def excerpts(self) -> Path:
        return self.tools / "nixos-excerpts"

    def env(self) -> dict[str, str]:
        config = "\n".join([
            "build-users-group =",
            "substituters =",
            "flake-registry =",
            "experimental-features = nix-command flakes",
            f"store = {self.scratch / 'root'}",
            "warn-dirty = false",
        ])
        return {**os.environ, "NIX_CONFIG": config, "XDG_CACHE_HOME": str(self.scratch / "cache"),
                "NIX_PATH": ""}

    def run(self, tool: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.tools / "nix"), tool, *args], capture_output=True,
                              text=True, env=self.env(), timeout=timeout, check=False,
                              cwd=self.scratch)

    def ok(self, tool: str, *args: str) -> str:
        result = self.run(tool, *args)
        assert result.returncode == 0, f"{tool} {' '.join(args)}:\n{result.stderr[-6000:]}"
        return result.stdout

    def eval(self, expression: str) -> Any:
        """The JSON value of an expression. Derivations it reaches are written to the
        private store (read-write mode), so ``derivations`` can read them."""
        return json.loads(self.ok("nix-instantiate", "--eval", "--strict", "--json",
                                  "--read-write-mode", "--expr", expression))

    def fails(self, expression: str) -> str:
        """The error an expression fails with; it must fail."""
        result = self.run("nix-instantiate", "--eval", "--strict", "--json", "--expr",
                          expression)
        assert result.returncode != 0, f"evaluated, but should have failed:\n{result.stdout}"
        return result.stderr

    def derivations(self, *drv_paths: str) -> dict[str, dict]:
        """Every derivation the given ones depend on, keyed by output path: what the .drv
        files in the store say (builder, arguments, environment)."""
        shown = json.loads(self.ok("nix", "derivation", "show", "-r", *drv_paths))
        by_output: dict[str, dict] = {}
        for drv in shown.values():
            for output in drv["outputs"].values():
                if "path" in output:
                    by_output[output["path"]] = drv
        return by_output


@pytest.fixture(scope="session")
def nix(tmp_path_factory: pytest.TempPathFactory) -> Nix:
    tools = _nixos_eval()
    if not (tools / "nix").exists() or not (tools / "nixpkgs-lib" / "lib").is_dir():
        why = (f"{tools} is missing (nixpkgs' lib, NixOS's systemd code and Nix 2.26 "
               "for evaluating the flake and modules)")
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"required in CI (CI=true): {why}", pytrace=False)
        pytest.skip(why)
    found = Nix(tools, tmp_path_factory.mktemp("nix"))
    version = found.ok("nix", "--version")
    assert "(Nix) 2.26." in version, version
    return found


def harness_expression(nix: Nix) -> str:
    """A Nix expression: llmgw's flake outputs with the stand-ins as inputs, and the small
    NixOS (tests/nix/llmgw.nix)."""
    return f"import {HARNESS}/llmgw.nix {{ lib = import {nix.lib}; excerpts = {nix.excerpts}; }}"


def copy_tree(source: Path, target: Path) -> None:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))


def section(unit: str, name: str) -> list[tuple[str, str]]:
    """A unit file's [name] section as (key, value) pairs, in order."""
    lines = unit.split(f"[{name}]\n", 1)[1].split("\n[", 1)[0].splitlines()
    return [tuple(line.split("=", 1)) for line in lines if "=" in line]  # type: ignore[misc]


def values(unit: str, name: str, key: str) -> list[str]:
    return [v for k, v in section(unit, name) if k == key]


class Rendered:
    """What a system's units and /etc files reach: its scripts and YAML files, read from
    the .drv files."""

    def __init__(self, nix: Nix, report: dict):
        self.report = report
        self.units = report["units"]
        self.drvs = nix.derivations(*report["unitDrvs"].values(),
                                    *report["etcDrvs"].values())

    def env(self, store_path: str) -> dict[str, str]:
        return self.drvs[store_path]["env"]

    def exec_start(self, unit: str) -> str:
        (value,) = values(self.units[unit], "Service", "ExecStart")
        return value

    def script(self, unit: str) -> str:
        """The text of the script a unit starts (writeShellScript)."""
        return self.env(self.exec_start(unit))["text"]

    def config_file(self, command: str) -> str:
        """The path a command's --config names: a store path, or a file the system links
        into /etc."""
        match = re.search(r"--config (/nix/store/\S+\.yaml|/etc/\S+)", command)
        assert match, command
        return match.group(1)

    def store_path(self, path: str) -> str:
        """The store path behind a path on the machine: /etc/X is the system's
        environment.etc entry X."""
        if not path.startswith("/etc/"):
            return path
        etc = self.report["etc"]
        target = path.removeprefix("/etc/")
        assert target in etc, f"{path} is not in the system's /etc: {sorted(etc)}"
        return etc[target]["source"]

    def yaml_of(self, command: str) -> dict:
        """The YAML a command's --config names, as pkgs.formats.yaml writes it."""
        return json.loads(self.env(self.store_path(self.config_file(command)))["value"])
