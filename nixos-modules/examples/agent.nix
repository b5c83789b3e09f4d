# services.llmgw.agent on a GPU node, as in docs/nixos.md; what the module renders from it
# is agent.yaml beside this file (tests/unit/test_nix.py checks both).
{ pkgs }:
{
  enable = true;
  servers = [ "https://10.0.0.1:8443" ];
  fabric = "ib-a";
  labels = { rack = "r12"; };
  openFirewall = true;
  # llama.cpp pinned by this flake's nixpkgs, built with CUDA.
  engines."llama.cpp".package = pkgs.llama-cpp.override { cudaSupport = true; };
  weights.directories = [
    { path = "/var/lib/llmgw-weights"; }
    { path = "/mnt/models"; shared = true; }
  ];
  # From `llmgw agent join` (docs/security.md).
  tls = {
    caFile = "/var/lib/llmgw-agent/tls/ca.pem";
    certFile = "/var/lib/llmgw-agent/tls/node.pem";
    keyFile = "/var/lib/llmgw-agent/tls/node-key.pem";
  };
}
