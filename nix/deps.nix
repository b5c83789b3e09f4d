# pyproject.toml's [project] dependencies as nixpkgs python package names: the package
# is built from the same list, read from the file (builtins only; tests/unit/test_nix.py
# evaluates it). Versions are nixpkgs', not uv.lock's: package.nix relaxes the pins.
pyproject:
let
  # "sqlalchemy[asyncio]==2.1.9" -> "sqlalchemy"
  name = spec: builtins.head (builtins.match "([A-Za-z0-9_.-]+).*" spec);
  extras = spec:
    let found = builtins.match "[^[]*\\[([^]]*)].*" spec; in
    if found == null then [ ] else builtins.filter builtins.isString
      (builtins.split "," (builtins.head found));
  # Packages an extra pulls in, as nixpkgs names.
  extraPackages = { "sqlalchemy[asyncio]" = [ "greenlet" ]; };
  withExtras = spec: [ (name spec) ]
    ++ builtins.concatLists (map (extra: extraPackages."${name spec}[${extra}]" or [ ]) (extras spec));
in
builtins.concatLists (map withExtras pyproject.project.dependencies)
