# A stand-in for nixpkgs' package set, for evaluating llmgw's flake and NixOS modules on a
# machine that cannot download nixpkgs (tests/nixos).
#
# Every attribute here is one nixpkgs has, with the shape llmgw's Nix code relies on, so a
# misspelt name fails as it would against nixpkgs. Each package is a builtins.derivation:
# it instantiates (real .drv files, real store paths, its inputs recorded), but its
# builder only fails. Nothing here is ever built.
{ lib, system, excerpts, nixos }:

let
  # A derivation that instantiates and never builds. `passthru` and `meta` stay out of the
  # .drv (they are not strings), as with stdenv.
  standIn = args@{ name, passthru ? { }, meta ? { }, ... }:
    let
      drv = derivation ({
        inherit system;
        builder = "/bin/sh";
        args = [ "-c" "echo 'stand-in for nixpkgs: evaluation only, never built' >&2; exit 1" ];
      } // removeAttrs args [ "passthru" "meta" "args" ]);
    in
    drv // passthru // {
      inherit passthru;
      meta = { inherit name; } // meta;
      overrideAttrs = f: standIn (args // (if lib.isFunction f then f args else f));
    };

  # A package with a version and a main program, as nixpkgs' are.
  package = pname: version: extra: standIn ({
    name = "${pname}-${version}";
    inherit pname version;
    meta.mainProgram = extra.mainProgram or pname;
  } // removeAttrs extra [ "mainProgram" ]);

  python = pname: version: package pname version {
    mainProgram = "python3";
    passthru = {
      pythonVersion = lib.versions.majorMinor version;
      inherit version;
      sitePackages = "lib/python${lib.versions.majorMinor version}/site-packages";
      executable = "python${lib.versions.majorMinor version}";
      implementation = "cpython";
      isPy3k = true;
    };
  };

  # llama.cpp as nixpkgs builds it; `override` gives another build (CUDA, ROCm, …), so
  # another store path.
  llamaCpp = flags: package "llama-cpp" "6981" ({
    mainProgram = "llama-cli";
    passthru.override = more: llamaCpp (flags // more);
  } // lib.mapAttrs (_: lib.boolToString) flags);

  pkgs = {
    inherit lib system;
    stdenv = {
      hostPlatform = { inherit system; isLinux = true; };
      buildPlatform = pkgs.stdenv.hostPlatform;
      mkDerivation = args: standIn ({ name = "${args.pname}-${args.version}"; } // args);
    };
    callPackage = lib.callPackageWith pkgs;
    newScope = extra: lib.callPackageWith (pkgs // extra);
    formats = import (excerpts + "/formats-yaml.nix") { inherit lib pkgs; };

    runCommand = name: env: buildCommand:
      standIn (env // { inherit name buildCommand; });
    writeText = name: text: standIn { inherit name text; passAsFile = [ "text" ]; };
    writeShellScript = name: text: standIn {
      inherit name text;
      executable = true;
      passAsFile = [ "text" ];
    };
    writeShellScriptBin = name: text: standIn {
      inherit name text;
      passAsFile = [ "text" ];
      meta.mainProgram = name;
    };
    writeShellApplication = { name, text, runtimeInputs ? [ ], ... }: standIn {
      inherit name text runtimeInputs;
      passAsFile = [ "text" ];
      meta.mainProgram = name;
    };
    mkShell = { packages ? [ ], env ? { }, ... }: standIn ({
      name = "nix-shell";
      inherit packages;
    } // env);
    fetchurl = { url, hash ? null, sha256 ? null, name ? baseNameOf url, ... }: standIn ({
      inherit name url;
      outputHashMode = "flat";
    } // (if hash != null then { outputHash = hash; }
          else { outputHashAlgo = "sha256"; outputHash = sha256; }));

    testers.runNixOSTest = { name, nodes, testScript, ... }:
      let
        evaluated = lib.mapAttrs (_: node: nixos [ node ]) nodes;
        failed = lib.concatLists (lib.mapAttrsToList
          (node: system: map (m: "${node}: ${m}") system.failedAssertions) evaluated);
      in
      if failed != [ ] then throw "runNixOSTest ${name}:\n${lib.concatStringsSep "\n" failed}"
      else
        let
          # The driver runs testScript against the nodes' systems: here, their units, so
          # each node's configuration is evaluated and instantiated.
          driver = standIn {
            name = "nixos-test-driver-${name}";
            inherit testScript;
            nodes = lib.concatLists (lib.mapAttrsToList (_: s: lib.attrValues s.unitFiles) evaluated);
            meta.mainProgram = "nixos-test-driver";
          };
        in
        standIn { name = "vm-test-run-${name}"; inherit driver; passthru = { inherit driver; }; };

    python3 = python "python3" "3.13.9";
    python311 = python "python3" "3.11.14";
    llama-cpp = llamaCpp { };
    coreutils = package "coreutils" "9.8" { mainProgram = "coreutils"; };
    findutils = package "findutils" "4.10.0" { mainProgram = "find"; };
    gnugrep = package "gnugrep" "3.12" { mainProgram = "grep"; };
    gnused = package "gnused" "4.9" { mainProgram = "sed"; };
    systemd = package "systemd" "258.2" { mainProgram = "systemctl"; };
    jq = package "jq" "1.8.1" { };
    remarshal_0_17 = package "remarshal" "0.17.1" { };
    uv = package "uv" "0.9.7" { };
    gnumake = package "gnumake" "4.4.1" { mainProgram = "make"; };
    postgresql = package "postgresql" "17.7" { mainProgram = "psql"; };
    nix = package "nix" "2.31.2" { };
    git = package "git" "2.51.2" { };
  };
in
pkgs
