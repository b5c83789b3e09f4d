# Stands in for github:pyproject-nix/uv2nix, for tests/nixos only (CI cannot fetch
# it, and its code is not vendored here): `--override-input uv2nix path:…`. Only what
# nix/package.nix calls, with upstream's names and call shapes:
#   lib.workspace.loadWorkspace { workspaceRoot } -> { mkPyprojectOverlay, deps.default, deps.all }
# It really reads uv.lock and pyproject.toml: one derivation per locked package, named
# <name>-<version> from uv.lock, its wheel fetched (instantiated only) by uv.lock's url and
# sha256, its dependencies uv.lock's, markers evaluated for Linux and the set's Python.
{
  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";
    # Declared as upstream does, so a consumer's `follows` applies; unused here.
    pyproject-nix.url = "github:pyproject-nix/pyproject.nix";
    pyproject-nix.inputs.nixpkgs.follows = "nixpkgs";
  };

  outputs = { self, nixpkgs, pyproject-nix }: {
    lib.workspace = import ./workspace.nix { inherit (nixpkgs) lib; };
  };
}
