#!/usr/bin/env bash
# The Nix checks that need nixpkgs itself, so the internet (and KVM for the VM test): run on
# a machine with Nix >= 2.18 and flakes. `make test` evaluates the same flake offline
# against stand-ins (tests/nixos, docs/nixos.md); this builds and runs it for real.
#
#   nix/check.sh            # flake check, the package, its unit tests, the VM test
#   nix/check.sh --no-vm    # everything but the VM test (no KVM there)
set -euo pipefail
cd "$(dirname "$0")/.."
system=$(nix --extra-experimental-features nix-command eval --impure --raw --expr builtins.currentSystem)
flags=(--extra-experimental-features 'nix-command flakes' --print-build-logs)

# Every output of every system evaluates and instantiates.
nix flake check "${flags[@]}" --no-build --all-systems

# The package from uv.lock, then its unit tests on the same environment.
llmgw=$(nix build "${flags[@]}" --no-link --print-out-paths ".#packages.$system.llmgw")
"$llmgw/bin/llmgw" --version
nix build "${flags[@]}" --no-link ".#checks.$system.llmgw"

# One server and two agents in VMs, the sim engine, a restart under load (needs KVM).
[ "${1:-}" = --no-vm ] || nix build "${flags[@]}" --no-link ".#checks.$system.vm"
