# The stand-in for nixpkgs that tests/nixos evaluates llmgw's Nix code against:
# nixpkgs' real lib, a package set of derivations that are never built (pkgs.nix), and a
# small NixOS over NixOS's own systemd code (nixos.nix).
#
#   import ./. { lib = <nixpkgs-lib/lib>; excerpts = <nixos-excerpts>; system = "x86_64-linux"; }
{ lib, excerpts, system ? "x86_64-linux" }:

let
  pkgs = import ./pkgs.nix { inherit lib system excerpts nixos; };
  nixos = import ./nixos.nix { inherit lib pkgs excerpts; };
in
{ inherit lib pkgs nixos; }
