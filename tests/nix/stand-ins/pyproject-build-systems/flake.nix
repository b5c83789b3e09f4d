# Stands in for github:pyproject-nix/build-system-pkgs, for tests/nixos only (CI
# cannot fetch it, and its code is not vendored here): `--override-input
# pyproject-build-systems path:…`. Upstream's overlays put build systems (hatchling, ...)
# into the Python set, from its own uv.lock; these put in a derivation per build system,
# named <name>-build-system-stand-in, that only instantiates.
{
  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";
    # Declared as upstream does, so a consumer's `follows` applies; unused here.
    pyproject-nix.url = "github:pyproject-nix/pyproject.nix";
    pyproject-nix.inputs.nixpkgs.follows = "nixpkgs";
    uv2nix.url = "github:pyproject-nix/uv2nix";
    uv2nix.inputs.pyproject-nix.follows = "pyproject-nix";
    uv2nix.inputs.nixpkgs.follows = "nixpkgs";
  };

  outputs = { self, nixpkgs, ... }:
    let
      # llmgw's build system (pyproject.toml [build-system]); upstream has many more.
      names = [ "hatchling" ];
      overlay = final: _prev: nixpkgs.lib.genAttrs names (name: final.stdenv.mkDerivation {
        name = "${name}-build-system-stand-in";
        dontUnpack = true;
        passthru = { dependencies = { }; optional-dependencies = { }; dependency-groups = { }; };
      });
    in
    {
      overlays = { wheel = overlay; sdist = overlay; default = overlay; };
    };
}
