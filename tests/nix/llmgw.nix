# llmgw's flake outputs with the stand-ins as inputs, called without the flake CLI, and what
# tests/nixos reads of a NixOS system built with its modules.
#
#   import ./llmgw.nix { lib = <nixpkgs-lib/lib>; excerpts = <nixos-excerpts>; }
{ lib, excerpts }:

let
  # A flake's outputs, given its inputs; `self` is the outputs themselves.
  call = flake: inputs:
    let self = (import flake).outputs (inputs // { inherit self; }) // { outPath = dirOf flake; };
    in self;

  nixpkgs = import ./stand-ins/nixpkgs/outputs.nix { inherit lib excerpts; harness = ./.; };
  pyproject-nix = call ./stand-ins/pyproject-nix/flake.nix { inherit nixpkgs; };
  uv2nix = call ./stand-ins/uv2nix/flake.nix { inherit nixpkgs pyproject-nix; };
  pyproject-build-systems = call ./stand-ins/pyproject-build-systems/flake.nix {
    inherit nixpkgs pyproject-nix uv2nix;
  };
  llmgw = call ../../flake.nix { inherit nixpkgs uv2nix pyproject-nix pyproject-build-systems; };

  # What the tests check of one system: its assertions, its units as systemd reads them,
  # and the derivations behind them (`nix derivation show` reads the files they write).
  report = system:
    let inherit (system) config; in
    {
      inherit (system) failedAssertions warnings;
      units = lib.mapAttrs (_: unit: unit.text) system.units;
      unitDrvs = lib.mapAttrs (_: file: file.drvPath) system.unitFiles;
      firewall = { inherit (config.networking.firewall) allowedTCPPorts allowedTCPPortRanges; };
      tmpfiles = config.systemd.tmpfiles.rules;
      systemPackages = map (p: p.outPath) config.environment.systemPackages;
      # /etc as NixOS links it: each enabled file by its path under /etc.
      etc = lib.listToAttrs (map (file: lib.nameValuePair file.target {
          source = "${file.source}";
          inherit (file) mode;
        }) (lib.filter (file: file.enable) (lib.attrValues config.environment.etc)));
      etcDrvs = lib.listToAttrs (map (file: lib.nameValuePair file.target file.source.drvPath)
        (lib.filter (file: file.enable && file.source ? drvPath)
          (lib.attrValues config.environment.etc)));
    };
in
{
  inherit lib llmgw nixpkgs report;
  nixos = modules: report (nixpkgs.lib.nixosSystem { inherit modules; });
  # As NixOS does, a system with failed assertions is not rendered.
  assertions = modules: { inherit ((nixpkgs.lib.nixosSystem { inherit modules; })) failedAssertions; };
}
