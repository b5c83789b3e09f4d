# Stands in for github:NixOS/nixpkgs in `nix flake check --override-input nixpkgs path:…`
# (tests/nixos). The test copies this directory into a scratch one beside
# `lib` (nixpkgs' real lib), `excerpts` (NixOS's systemd code) and `harness` (tests/nix):
# a flake input must hold everything it reads.
{
  outputs = { self }: import ./outputs.nix {
    lib = import ./lib;
    excerpts = ./excerpts;
    harness = ./harness;
  };
}
