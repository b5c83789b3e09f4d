# llmgw as a Nix package, from pyproject.toml: its name, version and dependencies.
#
# buildPythonPackage, then python3.withPackages: the agent starts the sim engine (and
# Python engines) with sys.executable, which must be a Python that imports llmgw and its
# dependencies. The environment's wrappers point sys.executable at its own python; a
# buildPythonApplication's would be the bare interpreter.
#
# Every dependency is in nixpkgs (python3Packages): litestar, msgspec, sqlalchemy,
# alembic, aiosqlite, asyncpg, uvicorn, websockets, uvloop, httptools, aiohttp, psutil,
# pyyaml, rich, uv, argon2-cffi, nvidia-ml-py, pyroute2, dbus-fast, cryptography,
# prometheus-client — at
# nixpkgs' versions, which are not uv.lock's (pythonRelaxDeps). Not built here: this
# repository's CI has no nixpkgs (docs/nixos.md, "What is checked").
{ lib, python3 }:

let
  pyproject = builtins.fromTOML (builtins.readFile ../pyproject.toml);
  py = python3.pkgs;
  root = ../.;
  llmgw = py.buildPythonPackage {
    pname = pyproject.project.name;
    inherit (pyproject.project) version;
    pyproject = true;
    src = lib.fileset.toSource {
      inherit root;
      fileset = lib.fileset.unions [
        ../pyproject.toml
        ../README.md
        ../llmgw
        ../migrations
        ../tests
      ];
    };
    build-system = [ py.hatchling ];
    dependencies = map (name: py.${name}) (import ./deps.nix pyproject);
    pythonRelaxDeps = true;

    # The unit tests: pure, no processes, no PostgreSQL (tests/store and
    # tests/integration need both and run in CI, not in the sandbox).
    nativeCheckInputs = with py; [ pytestCheckHook pytest-asyncio hypothesis openai httpx ];
    enabledTestPaths = [ "tests/unit" ];
    # Runs nix-instantiate, which the build sandbox does not have (it skips without CI=true).
    disabledTestPaths = [ "tests/unit/test_nix.py" ];
    pythonImportsCheck = [ "llmgw" "llmgw.server.run" "llmgw.agent.run" ];

    meta = {
      description = pyproject.project.description;
      homepage = "https://llmgw.invalid";
      license = lib.licenses.asl20;
      mainProgram = "llmgw";
      platforms = lib.platforms.linux;
    };
  };
in
(python3.withPackages (_: [ llmgw ])).overrideAttrs (old: {
  name = "llmgw-${llmgw.version}";
  passthru = (old.passthru or { }) // { inherit llmgw; inherit (llmgw) version; };
  meta = llmgw.meta;
})
