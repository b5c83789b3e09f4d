# uv2nix's lib.workspace, cut down to a single-project workspace, wheels only.
{ lib }:

let
  inherit (builtins) fromTOML readFile match compareVersions head elemAt length;

  # PEP 508 markers as uv.lock writes them for this project: comparisons joined by `and` /
  # `or`. Anything else (parentheses, `in`, extras) fails rather than guessing.
  evalMarker = env: marker:
    let
      compare = term:
        let m = match " *([a-z_]+) (==|!=|<=|>=|<|>) '([^']*)' *" term; in
        if m == null then throw "stand-in uv2nix: unsupported marker `${marker}`"
        else
          let
            var = elemAt m 0; op = elemAt m 1; want = elemAt m 2;
            have = env.${var} or (throw "stand-in uv2nix: unknown marker variable ${var}");
            isVersion = lib.hasPrefix "python_" var;
            c = if isVersion then compareVersions have want
                else if op == "==" || op == "!=" then (if have == want then 0 else 1)
                else throw "stand-in uv2nix: `${op}` on ${var}";
          in
          { "==" = c == 0; "!=" = c != 0; "<" = c < 0; "<=" = c <= 0; ">" = c > 0; ">=" = c >= 0; }.${op};
      split = sep: s: lib.splitString sep s;
    in
    if lib.hasInfix "(" marker then throw "stand-in uv2nix: unsupported marker `${marker}`"
    else lib.any (all: lib.all compare (split " and " all)) (split " or " marker);

  # A dependency list of uv.lock -> { name = [ extras ]; }, markers evaluated.
  mkSpec = env: deps: lib.listToAttrs (map (d: lib.nameValuePair d.name (d.extra or [ ]))
    (lib.filter (d: !(d ? marker) || evalMarker env d.marker) deps));

  # Tags of a wheel's file name: name-version[-build]-python-abi-platform.whl
  wheelTags = url:
    let parts = lib.splitString "-" (lib.removeSuffix ".whl" (baseNameOf url)); n = length parts; in
    {
      python = lib.splitString "." (elemAt parts (n - 3));
      abi = lib.splitString "." (elemAt parts (n - 2));
      platform = lib.splitString "." (elemAt parts (n - 1));
    };

  # The best wheel for CPython `cp` (e.g. "cp311") on Linux `arch`: manylinux before pure,
  # cp311's own ABI before abi3. The glibc version a manylinux tag asks for is not checked.
  selectWheel = { cp, arch }: package:
    let
      minor = lib.toInt (lib.removePrefix "cp3" cp);
      score = url:
        let
          t = wheelTags url;
          pyOk = lib.any (p: lib.elem p [ cp "py3" "py${lib.removePrefix "cp" cp}" ]) t.python
            || (lib.elem "abi3" t.abi && lib.any (p: match "cp3[0-9]+" p != null
                  && lib.toInt (lib.removePrefix "cp3" p) <= minor) t.python);
          abiOk = lib.any (a: lib.elem a [ "none" "abi3" cp ]) t.abi;
          native = lib.any (p: match "manylinux.*_${arch}" p != null) t.platform;
          platOk = native || lib.elem "any" t.platform;
        in
        if pyOk && abiOk && platOk then
          (if native then 2 else 0) + (if lib.elem cp t.abi then 1 else 0)
        else -1;
      scored = lib.filter (w: w.score >= 0)
        (map (w: w // { score = score w.url; }) (package.wheels or [ ]));
      best = lib.foldl' (a: b: if a == null || b.score > a.score then b else a) null scored;
    in
    if best == null
    then throw "stand-in uv2nix: no ${cp} wheel for ${arch} of ${package.name} ${package.version} (sdists are not built here)"
    else best;

  isLocal = p: p.source ? editable || p.source ? virtual || p.source ? directory;
in
{
  loadWorkspace = { workspaceRoot, ... }:
    let
      lock = fromTOML (readFile (workspaceRoot + "/uv.lock"));
      pyproject = fromTOML (readFile (workspaceRoot + "/pyproject.toml"));
      locals = lib.filter isLocal lock.package;
      remotes = lib.filter (p: !isLocal p) lock.package;
      groupsOf = p: lib.attrNames (p.optional-dependencies or { })
        ++ lib.attrNames (p.dev-dependencies or { });
    in
    assert lib.assertMsg (map (p: p.name) locals == [ pyproject.project.name ])
      "stand-in uv2nix: one local project, the workspace root's";
    {
      deps = {
        default = lib.genAttrs (map (p: p.name) locals) (_: pyproject.tool.uv.default-groups or [ ]);
        all = lib.listToAttrs (map (p: lib.nameValuePair p.name (groupsOf p)) locals);
      };

      mkPyprojectOverlay = { sourcePreference, ... }:
        assert lib.assertMsg (sourcePreference == "wheel") "stand-in uv2nix: wheels only";
        final: prev:
        let
          inherit (final) python stdenv;
          env = {
            python_full_version = python.version;
            python_version = python.pythonVersion;
            implementation_name = "cpython";
            platform_python_implementation = "CPython";
            sys_platform = "linux";
            platform_system = "Linux";
            os_name = "posix";
            platform_machine = arch;
          };
          arch = head (lib.splitString "-" stdenv.hostPlatform.system);
          cp = "cp" + lib.replaceStrings [ "." ] [ "" ] python.pythonVersion;
          passthruOf = p: {
            dependencies = mkSpec env (p.dependencies or [ ]);
            optional-dependencies = lib.mapAttrs (_: mkSpec env) (p.optional-dependencies or { });
            dependency-groups = lib.mapAttrs (_: mkSpec env) (p.dev-dependencies or { });
          };
          remote = p: final.callPackage ({ stdenv, fetchurl }:
            let wheel = selectWheel { inherit cp arch; } p; in
            stdenv.mkDerivation {
              pname = p.name;
              inherit (p) version;
              src = fetchurl {
                name = baseNameOf wheel.url;
                inherit (wheel) url;
                sha256 = lib.removePrefix "sha256:" wheel.hash;
              };
              passthru = passthruOf p;
            }) { };
          # The project itself, from the workspace root with its build system's packages.
          local = p: stdenv.mkDerivation {
            pname = p.name;
            inherit (p) version;
            src = workspaceRoot;
            nativeBuildInputs = final.resolveBuildSystem (lib.genAttrs
              (map (r: head (match "([A-Za-z0-9._-]+).*" r)) pyproject.build-system.requires)
              (_: [ ]));
            passthru = passthruOf p;
          };
        in
        lib.listToAttrs (map (p: lib.nameValuePair p.name (local p)) locals
          ++ map (p: lib.nameValuePair p.name (remote p)) remotes);
    };
}
