# One server and two agents in NixOS VMs, serving the built-in sim engine; the shape of
# nixpkgs' nixos/tests/ollama.nix. `nix flake check` runs it (needs KVM).
{ pkgs, self }:

let
  port = 8080;
  agent = { ... }: {
    imports = [ self.nixosModules.agent ];
    services.llmgw.agent = {
      enable = true;
      openFirewall = true;
      settings = {
        servers = [ "http://server:${toString port}" ];
        allow_plain_http = true; # a test network: no TLS
        fabric = "test";
      };
    };
  };
in
pkgs.testers.runNixOSTest {
  name = "llmgw";

  nodes = {
    server = { ... }: {
      imports = [ self.nixosModules.server ];
      services.llmgw.server = {
        enable = true;
        openFirewall = true;
        settings = {
          listen = { host = "0.0.0.0"; inherit port; allow_plain_http = true; };
          models = [
            { name = "sim-small"; replicas = 2; profiles = [ { engine = "sim"; } ]; }
          ];
        };
      };
      # llmgw itself is on the PATH with the server.
      environment.systemPackages = [ pkgs.jq ];
    };
    agent1 = agent;
    agent2 = agent;
  };

  testScript = ''
    import json

    start_all()
    server.wait_for_unit("llmgw-server.socket")
    server.wait_for_unit("llmgw-server.service")
    server.wait_until_succeeds("curl -sf http://127.0.0.1:${toString port}/healthz")
    for node in (agent1, agent2):
        node.wait_for_unit("llmgw-agent.service")

    token = server.succeed("cat /var/lib/llmgw/secrets/admin-token").strip()
    ctl = f"LLMGW_SERVER=http://127.0.0.1:${toString port} LLMGW_TOKEN={token} llmgw ctl"
    server.wait_until_succeeds(
        f"{ctl} nodes list --json | jq -e '[.[] | select(.state == \"ready\")] | length == 2'",
        timeout=120)

    key = json.loads(server.succeed(f"{ctl} keys create vm-test --json"))["key"]
    chat = (
        "curl -sf http://127.0.0.1:${toString port}/v1/chat/completions"
        f" -H 'authorization: Bearer {key}' -H 'content-type: application/json'"
        """ -d '{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}'"""
    )
    server.wait_until_succeeds(chat, timeout=120)

    # A restart refuses no connection: llmgw-server.socket queues them meanwhile.
    server.succeed(
        "for i in $(seq 1 400); do curl -s -o /dev/null -w '%{http_code}\\n' --max-time 30"
        " http://127.0.0.1:${toString port}/healthz; done > /tmp/codes &"
        " timeout 30 sh -c 'until [ -s /tmp/codes ]; do sleep 0.1; done';"
        " systemctl restart llmgw-server.service; wait"
    )
    server.succeed("test $(grep -vc '^200$' /tmp/codes) -eq 0")
  '';
}
