{
  description = "llmgw: a self-hosted LLM cluster behind one OpenAI-compatible API";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      # builtins, not nixpkgs.lib: the outputs' names evaluate without fetching nixpkgs
      # (tests/unit/test_nix.py does that with stub inputs).
      forAllSystems = f: builtins.listToAttrs
        (map (system: { name = system; value = f system; }) systems);
      pkgsFor = system: nixpkgs.legacyPackages.${system};
      withPackage = module: { lib, pkgs, ... }: {
        imports = [ module ];
        config.services.llmgw = {
          server.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.llmgw;
          agent.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.llmgw;
        };
      };
    in
    {
      packages = forAllSystems (system:
        let llmgw = (pkgsFor system).callPackage ./nix/package.nix { }; in
        { inherit llmgw; default = llmgw; });

      apps = forAllSystems (system:
        let
          pkgs = pkgsFor system;
          llmgw = self.packages.${system}.llmgw;
          ctl = pkgs.writeShellScript "llmgw-ctl" ''exec ${llmgw}/bin/llmgw ctl "$@"'';
        in
        {
          ctl = { type = "app"; program = "${ctl}"; meta.description = "llmgw ctl: operate a cluster"; };
          default = { type = "app"; program = "${llmgw}/bin/llmgw"; meta.description = "llmgw"; };
        });

      nixosModules = {
        server = withPackage ./nixos-modules/server.nix;
        agent = withPackage ./nixos-modules/agent.nix;
        default = { imports = [ self.nixosModules.server self.nixosModules.agent ]; };
      };

      checks = forAllSystems (system:
        let pkgs = pkgsFor system; in
        {
          # The package's unit tests run in its check phase.
          llmgw = self.packages.${system}.llmgw.passthru.llmgw;
          # One server, two agents, the sim engine, a restart that refuses nothing.
          vm = import ./nix/vm-test.nix { inherit pkgs self; };
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
