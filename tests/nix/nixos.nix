# A small NixOS for llmgw's modules: nixpkgs' own lib.evalModules, the options llmgw's
# modules and the examples in docs/nixos.md set, declared with the types NixOS gives them,
# and the systemd units rendered by NixOS's own code (../shared/nixos-eval/nixos-excerpts).
#
# Module checking stays on: a definition of an option nobody declared fails here exactly
# as it does in NixOS ("The option `…' does not exist"). The other ~2000 NixOS modules are
# not here, so an option of theirs that llmgw sets must be declared below.
#
#   nixos = import ./nixos.nix { inherit lib pkgs excerpts; };
#   system = nixos [ module … ];   # { config, failedAssertions, warnings, units, unitFiles }
{ lib, pkgs, excerpts }:

modules:

let
  inherit (lib) mkOption types;

  declarations = { config, ... }:
    let
      systemdUtils = {
        lib = import (excerpts + "/systemd-lib.nix") { inherit config lib pkgs; utils = { }; };
        unitOptions = import (excerpts + "/systemd-unit-options.nix") { inherit lib systemdUtils; };
      };
      inherit (systemdUtils) unitOptions;
      # nixos/lib/systemd-types.nix
      services = types.attrsOf (types.submodule [
        unitOptions.stage2ServiceOptions
        systemdUtils.lib.unitConfig
        systemdUtils.lib.stage2ServiceConfig
      ]);
      sockets = types.attrsOf (types.submodule [
        unitOptions.stage2SocketOptions
        systemdUtils.lib.unitConfig
        systemdUtils.lib.socketConfig
      ]);
      # nixos/modules/misc/nixpkgs.nix
      nixpkgsConfig = lib.mkOptionType {
        name = "nixpkgs-config";
        description = "nixpkgs config";
        check = x: builtins.isAttrs x || lib.isFunction x;
        merge = _: lib.foldr (def: acc: lib.recursiveUpdate acc def.value) { };
      };
    in
    {
      options = {
        # nixos/modules/misc/assertions.nix
        assertions = mkOption { type = types.listOf types.unspecified; internal = true; default = [ ]; };
        warnings = mkOption { type = types.listOf types.str; internal = true; default = [ ]; };

        # nixos/modules/config/system-path.nix
        environment.systemPackages = mkOption { type = types.listOf types.package; default = [ ]; };

        # nixos/modules/system/etc/etc.nix: the files linked (or copied) into /etc
        environment.etc = mkOption {
          default = { };
          type = types.attrsOf (types.submodule ({ name, config, options, ... }: {
            options = {
              enable = mkOption { type = types.bool; default = true; };
              target = mkOption { type = types.str; };
              text = mkOption { type = types.nullOr types.lines; default = null; };
              source = mkOption { type = types.path; };
              mode = mkOption { type = types.str; default = "symlink"; };
              uid = mkOption { type = types.int; default = 0; };
              gid = mkOption { type = types.int; default = 0; };
              user = mkOption { type = types.str; default = "+${toString config.uid}"; };
              group = mkOption { type = types.str; default = "+${toString config.gid}"; };
            };
            config = {
              target = lib.mkDefault name;
              source = lib.mkIf (config.text != null) (
                let name' = "etc-" + lib.replaceStrings [ "/" ] [ "-" ] name;
                in lib.mkDerivedConfig options.text (pkgs.writeText name'));
            };
          }));
        };

        # nixos/modules/services/networking/firewall.nix
        networking.firewall = {
          enable = mkOption { type = types.bool; default = true; };
          allowedTCPPorts = mkOption { type = types.listOf types.port; default = [ ]; };
          allowedTCPPortRanges = mkOption { type = types.listOf (types.attrsOf types.port); default = [ ]; };
        };
        networking.hostName = mkOption { type = types.strMatching "^$|^[[:alnum:]]([[:alnum:]_-]{0,61}[[:alnum:]])?$"; default = "nixos"; };

        # nixos/modules/system/boot/systemd.nix, systemd/tmpfiles.nix
        systemd = {
          package = mkOption { type = types.package; default = pkgs.systemd; };
          enableStrictShellChecks = mkOption { type = types.bool; default = false; };
          globalEnvironment = mkOption {
            type = with types; attrsOf (nullOr (oneOf [ str path package ]));
            default = { };
          };
          services = mkOption { type = services; default = { }; };
          sockets = mkOption { type = sockets; default = { }; };
          tmpfiles.rules = mkOption { type = types.listOf types.str; default = [ ]; };
        };

        # what the examples in docs/nixos.md set beside llmgw
        services.postgresql.enable = lib.mkEnableOption "PostgreSQL Server";
        services.xserver.videoDrivers = mkOption { type = types.listOf types.str; default = [ "modesetting" "fbdev" ]; };
        hardware.nvidia.open = mkOption { type = types.nullOr types.bool; default = null; };
        hardware.graphics.enable = lib.mkEnableOption "hardware accelerated graphics drivers";
        programs.nix-ld.enable = lib.mkEnableOption "nix-ld";
        nixpkgs.config = mkOption { type = nixpkgsConfig; default = { }; };
        system.stateVersion = mkOption { type = types.str; default = "25.11"; };
      };

      config._module.args = { inherit pkgs; utils = { inherit systemdUtils; }; };
    };

  evaluated = lib.evalModules { modules = [ declarations (import ./prometheus.nix { inherit lib; }) ] ++ modules; };
  inherit (evaluated) config;
  render = import (excerpts + "/systemd-lib.nix") { inherit config lib pkgs; utils = { }; };

  # nixos/modules/system/boot/systemd.nix: every enabled service and socket as a unit.
  units = lib.mapAttrs' (n: v: lib.nameValuePair "${n}.service" (render.serviceToUnit v))
      (lib.filterAttrs (_: v: v.enable) config.systemd.services)
    // lib.mapAttrs' (n: v: lib.nameValuePair "${n}.socket" (render.socketToUnit v))
      (lib.filterAttrs (_: v: v.enable) config.systemd.sockets);
in
{
  inherit config units;
  unitFiles = lib.mapAttrs (name: unit: render.makeUnit name unit) units;
  failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  inherit (config) warnings;
}
