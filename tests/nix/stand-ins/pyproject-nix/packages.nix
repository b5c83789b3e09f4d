# pyproject.nix's build.packages, cut down: a scope of Python packages that overlays (uv2nix's,
# the build systems') fill, and the virtual environment of a dependency specification.
{ lib }:

{ python, newScope, stdenv }:

let
  # The names a specification { name = [ extra-or-group ... ]; } reaches, following the
  # packages' passthru.dependencies / optional-dependencies / dependency-groups, as upstream's
  # resolveCyclic does. A node is a package ("name") or one of its extras ("name[extra]").
  resolve = set: spec:
    let
      nodes = name: extras: [ { key = name; inherit name; } ]
        ++ map (extra: { key = "${name}[${extra}]"; inherit name extra; }) extras;
      package = name: set.${name} or (throw "stand-in pyproject.nix: no package ${name} in the set");
      depsOf = node:
        let p = (package node.name).passthru; in
        if node ? extra then
          p.optional-dependencies.${node.extra} or p.dependency-groups.${node.extra}
            or (throw "stand-in pyproject.nix: ${node.name} has no extra or group ${node.extra}")
        else p.dependencies;
      closure = builtins.genericClosure {
        startSet = lib.concatLists (lib.mapAttrsToList nodes spec);
        operator = node: [ { key = node.name; inherit (node) name; } ]
          ++ lib.concatLists (lib.mapAttrsToList nodes (depsOf node));
      };
    in
    lib.unique (map (node: node.name) closure);
in
lib.makeScope newScope (final: {
  inherit python stdenv;

  resolveVirtualEnv = spec: map (name: final.${name}) (resolve final spec);
  resolveBuildSystem = spec: map (name: final.${name}) (resolve final spec);

  # Upstream links the packages into a venv (pyprojectMakeVenvHook) from the same variable.
  mkVirtualEnv = name: spec: stdenv.mkDerivation {
    inherit name;
    dontUnpack = true;
    nativeBuildInputs = [ python ];
    NIX_PYPROJECT_DEPS = lib.concatStringsSep ":" (map toString (final.resolveVirtualEnv spec));
  };
})
