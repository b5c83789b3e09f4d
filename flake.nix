{
  description = "llmgw: a self-hosted LLM cluster behind one OpenAI-compatible API";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";
    # The package is uv.lock's set, built by uv2nix with pyproject.nix's builders.
    pyproject-nix = {
      url = "github:pyproject-nix/pyproject.nix";
      inputs.nixpkgs.follows = "nixpkgs";
    };
    uv2nix = {
      url = "github:pyproject-nix/uv2nix";
      inputs.pyproject-nix.follows = "pyproject-nix";
      inputs.nixpkgs.follows = "nixpkgs";
    };
    pyproject-build-systems = {
      url = "github:pyproject-nix/build-system-pkgs";
      inputs.pyproject-nix.follows = "pyproject-nix";
      inputs.uv2nix.follows = "uv2nix";
      inputs.nixpkgs.follows = "nixpkgs";
    };
  };

  outputs = { self, nixpkgs, pyproject-nix, uv2nix, pyproject-build-systems }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = nixpkgs.lib.genAttrs systems;
      pkgsFor = system: nixpkgs.legacyPackages.${system};
    in
    {
      packages = forAllSystems (system:
        let
          llmgw = (pkgsFor system).callPackage ./nix/package.nix {
            inherit uv2nix pyproject-nix pyproject-build-systems;
          };
        in
        { inherit llmgw; default = llmgw; });

      apps = forAllSystems (system:
        let
          llmgw = self.packages.${system}.llmgw;
          ctl = (pkgsFor system).writeShellScript "llmgw-ctl" ''exec ${llmgw}/bin/llmgw ctl "$@"'';
        in
        {
          ctl = { type = "app"; program = "${ctl}"; meta.description = "llmgw ctl: operate a cluster"; };
          default = { type = "app"; program = "${llmgw}/bin/llmgw"; meta.description = "llmgw"; };
        });

      # Each role's `package` defaults to this flake's llmgw. The keys let a system import
      # `default` beside `server` or `agent` without declaring their options twice.
      nixosModules = {
        server = {
          key = "llmgw#nixosModules.server";
          imports = [ (import ./nixos-modules/server.nix { inherit (self) packages; }) ];
        };
        agent = {
          key = "llmgw#nixosModules.agent";
          imports = [ (import ./nixos-modules/agent.nix { inherit (self) packages; }) ];
        };
        default = { imports = [ self.nixosModules.server self.nixosModules.agent ]; };
      };

      checks = forAllSystems (system: {
        # The unit tests, on the package's own locked environment.
        llmgw = self.packages.${system}.llmgw.passthru.tests.unit;
        # One server, two agents, the sim engine, a restart that refuses nothing.
        vm = import ./nix/vm-test.nix { pkgs = pkgsFor system; inherit self; };
      });

      devShells = forAllSystems (system:
        let pkgs = pkgsFor system; in
        {
          default = pkgs.mkShell {
            packages = [ pkgs.python311 pkgs.uv pkgs.gnumake pkgs.postgresql pkgs.nix ];
            # `make test` builds .venv from uv.lock, as off Nix; uv must use this Python.
            env.UV_PYTHON = "${pkgs.python311}/bin/python3";
          };
        });
    };
}
