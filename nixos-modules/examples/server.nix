# services.llmgw.server as in docs/nixos.md; what the module renders from it is
# server.yaml beside this file (tests/unit/test_nix.py checks both).
{ pkgs }:
{
  enable = true;
  listen = { host = "10.0.0.1"; port = 8080; };
  openFirewall = true;
  store = {
    url = "postgresql+asyncpg://llmgw@db.internal:5432/llmgw";
    passwordFile = "/run/secrets/llmgw-db-password";
  };
  # Written once by `llmgw server init`, then kept wherever your secrets live.
  tls = {
    caFile = "/etc/llmgw/tls/ca.pem";
    caKeyFile = "/run/secrets/llmgw-ca-key.pem";
    certFile = "/etc/llmgw/tls/server.pem";
    keyFile = "/run/secrets/llmgw-server-key.pem";
    agentListen = { host = "10.0.0.1"; port = 8443; };
    publicUrls = [ "https://10.0.0.1:8080" ];
  };
  # Engines come from nixpkgs on each node (services.llmgw.agent.engines): none to install.
  engines = { };
  # server.yaml's own keys, as written there (docs/configuration.md).
  models = [
    {
      name = "qwen2.5-7b";
      replicas = 2;
      nodes = { gpu_class = "L40S"; };
      profiles = [
        {
          engine = "llama.cpp";
          gpus = 1;
          gpu_memory_mib = 12000;
          source = "hf://Qwen/Qwen2.5-7B-Instruct-GGUF";
          files = [ "*q4_k_m*.gguf" ];
          args = [ "--ctx-size" "8192" ];
        }
      ];
    }
    { name = "sim-small"; profiles = [ { engine = "sim"; } ]; }
  ];
  settings = {
    gateway = { queue_wait_s = 60; };
  };
}
