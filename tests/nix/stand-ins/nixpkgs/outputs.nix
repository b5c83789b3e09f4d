# The outputs of the stand-in for nixpkgs' flake: nixpkgs' real lib (with lib.nixosSystem
# as the small NixOS of ../../nixos.nix) and legacyPackages from ../../pkgs.nix.
{ lib, excerpts, harness }:

let
  systems = [ "x86_64-linux" "aarch64-linux" ];
  perSystem = lib.genAttrs systems (system: import harness { inherit lib excerpts system; });
in
{
  lib = lib // {
    nixosSystem = { system ? "x86_64-linux", modules, ... }: perSystem.${system}.nixos modules;
  };
  legacyPackages = lib.mapAttrs (_: h: h.pkgs) perSystem;
}
