# llmgw as a Nix package: a virtual environment of exactly uv.lock's pins, built by uv2nix
# (pyproject.nix's builders), on Python 3.11: the interpreter uv.lock is resolved for and CI
# tests on. Not nixpkgs' python3Packages, whose versions are not the locked ones.
#
# The flake calls it as
#   pkgs.callPackage ./nix/package.nix { inherit uv2nix pyproject-nix pyproject-build-systems; }
{
  lib,
  callPackage,
  stdenv,
  python311,
  git,
  uv2nix,
  pyproject-nix,
  pyproject-build-systems,
}:

let
  root = ../.;
  pyproject = lib.importTOML ../pyproject.toml;
  inherit (pyproject.project) version;

  # Reads uv.lock and pyproject.toml at evaluation time.
  workspace = uv2nix.lib.workspace.loadWorkspace { workspaceRoot = root; };

  # Every locked package has a manylinux wheel for cp311 on x86_64 and aarch64 (or a
  # pure one), so none is built from an sdist. Only llmgw itself is built: hatchling,
  # from pyproject-build-systems.
  overlay = workspace.mkPyprojectOverlay { sourcePreference = "wheel"; };

  llmgwOverrides = _final: prev: {
    llmgw = prev.llmgw.overrideAttrs (_: {
      # What the wheel is built from: hatchling force-includes migrations/. Nothing else,
      # so docs or tests changing rebuild nothing.
      src = lib.fileset.toSource {
        inherit root;
        fileset = lib.fileset.unions [
          ../pyproject.toml
          ../README.md
          ../llmgw
          ../migrations
        ];
      };
    });
  };

  pythonSet =
    (callPackage pyproject-nix.build.packages { python = python311; }).overrideScope
      (lib.composeManyExtensions [
        pyproject-build-systems.overlays.wheel
        overlay
        llmgwOverrides
      ]);

  # The default dependencies only, not the dev group. Its bin/python is the interpreter
  # the agent starts the sim engine with (sys.executable): the venv's own, which imports
  # llmgw; bin/llmgw runs under it too.
  venv = pythonSet.mkVirtualEnv "llmgw-${version}" workspace.deps.default;

  # The dev group too: pytest, hypothesis, openai, ...
  testVenv = pythonSet.mkVirtualEnv "llmgw-${version}-test-env" workspace.deps.all;

  # The unit tests: pure, no processes, no PostgreSQL (tests/store and tests/integration
  # need both and run in CI). Test dependencies stay out of the package, so the tests are
  # their own derivation (uv2nix's testing pattern).
  unit = stdenv.mkDerivation {
    name = "llmgw-${version}-unit-tests";
    src = lib.fileset.toSource {
      inherit root;
      # Not llmgw/: the tests import the package installed in the environment (pytest's
      # pythonpath is the source root, which then holds no llmgw to shadow it).
      fileset = lib.fileset.unions [
        ../pyproject.toml
        ../README.md
        ../tests
      ];
    };
    # git: tests/unit/test_weights.py compares its blob ids with git's.
    nativeBuildInputs = [ testVenv git ];
    dontConfigure = true;
    buildPhase = ''
      runHook preBuild
      export HOME=$(mktemp -d)
      # The package's own environment (isolated: not this source tree) imports what the
      # server and agent start with, and has the migrations inside the package.
      ${venv}/bin/python -I -c 'import llmgw.server.run, llmgw.agent.run
      from llmgw.store.migrate import migrations_dir
      assert migrations_dir().name == "_migrations", migrations_dir()'
      pytest tests/unit -p no:cacheprovider
      runHook postBuild
    '';
    installPhase = ''
      touch $out
    '';
  };
in
venv.overrideAttrs (old: {
  passthru = (old.passthru or { }) // {
    inherit version pythonSet workspace;
    tests = { inherit unit; };
  };
  meta = (old.meta or { }) // {
    inherit (pyproject.project) description;
    homepage = "https://llmgw.invalid";
    license = lib.licenses.asl20;
    mainProgram = "llmgw";
    platforms = lib.platforms.linux;
  };
})
