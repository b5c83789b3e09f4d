# Stands in for github:pyproject-nix/pyproject.nix, for tests/nixos only (CI cannot
# fetch it, and its code is not vendored here): `--override-input pyproject-nix path:…`.
# Only what nix/package.nix calls, with upstream's names and call shapes:
#   build.packages: callPackage-able { python, newScope, stdenv, ... } -> a scope with
#     overrideScope, callPackage, python, mkVirtualEnv, resolveBuildSystem, resolveVirtualEnv.
# Its derivations instantiate against the stand-in nixpkgs and are never built.
{
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs = { self, nixpkgs }: {
    build.packages = import ./packages.nix { inherit (nixpkgs) lib; };
  };
}
