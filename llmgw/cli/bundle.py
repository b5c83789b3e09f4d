"""``llmgw bundle``: make a signed bundle of what an air-gapped cluster would download,
and check and import one into the control plane's mirror (docs/offline.md).

Exit codes: 0 done, 2 refused or bad usage (one line on stderr saying what was wrong and
what to do); an import that is refused leaves the mirror as it was.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from llmgw.bundle import wheelsets
from llmgw.config import ServerConfig, load
from llmgw.core.desired_engines import PYPI


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bundle",
        help="make, check and import bundles for air-gapped clusters",
        description="A bundle holds what a cluster would otherwise download (engine "
        "archives, model files, llmgw's wheels), each file's size and sha256 in a manifest "
        "signed with Ed25519. Make it where the internet is; verify and import it on the "
        "air-gapped control plane, whose nodes then install from its mirror.",
    )
    cmds = p.add_subparsers(dest="bundle_command", metavar="COMMAND", required=True)

    k = cmds.add_parser("keygen", help="make a signing key",
                        description="Write a new Ed25519 private key to FILE (0600) and "
                        "print its public key line, for the control plane's "
                        "bundle.trusted_keys.")
    k.add_argument("file", type=Path, metavar="FILE")
    k.set_defaults(func=_keygen)

    c = cmds.add_parser(
        "create", help="make a bundle (on a connected machine)",
        description="Download engine archives (checked against their publisher's sha256, "
        "or ComfyUI's against --engine-sha256), "
        "Python engines' wheel sets (resolved with uv for --python on --python-platform, "
        "each wheel checked against its index's sha256), model files (pinned to the commit "
        "their revision names, checked against the hub's listing) and llmgw's wheels or Nix "
        "closure into OUT, and sign the manifest. Prints "
        "the manifest's sha256: carry it apart from the bundle (on paper, in a ticket) and "
        "give it to `llmgw bundle import --sha256`.")
    c.add_argument("out", type=Path, metavar="OUT", help="the bundle folder (or tar) to make")
    c.add_argument("--tar", action="store_true", help="write OUT as one tar file")
    c.add_argument("--key", type=Path, required=True, metavar="FILE",
                   help="the signing key (`llmgw bundle keygen`)")
    c.add_argument("--engine", action="append", default=[], metavar="NAME[@VERSION]",
                   help="an engine to bundle: llama.cpp (its archives), vllm or sglang (the "
                   "wheels NAME==VERSION resolves to, and a requirements.txt pinning them), "
                   "comfyui (its source archive, pinned with --engine-sha256, and the wheels "
                   "its requirements.txt resolves to); default version: the one this llmgw "
                   "was checked against; repeat for several versions")
    c.add_argument("--engine-sha256", action="append", default=[], metavar="FILE=SHA256",
                   help="comfyui: the sha256 of its tag archive (v0.3.60.tar.gz=…), which "
                   "GitHub publishes none for: the one server.yaml pins under "
                   "engines.comfyui.sha256; repeatable")
    c.add_argument("--arch", action="append", default=[], metavar="ARCH",
                   help="llama.cpp: the nodes' processors (x86_64, aarch64); default x86_64")
    c.add_argument("--build", action="append", default=[], metavar="BUILD",
                   help="llama.cpp: only these builds (cpu, vulkan, cuda-13.3, cuda-12.8); "
                   "default all")
    c.add_argument("--python", default=wheelsets.DEFAULT_PYTHON, metavar="X.Y",
                   help="vllm, sglang, comfyui: the CPython version the nodes build engines "
                   f"with (default {wheelsets.DEFAULT_PYTHON}, as the agent does)")
    c.add_argument("--python-platform", default=wheelsets.DEFAULT_PLATFORM,
                   metavar="PLATFORM",
                   help="vllm, sglang, comfyui: the nodes' platform, ARCH-manylinux_2_NN with "
                   f"the oldest glibc among them (default {wheelsets.DEFAULT_PLATFORM}; "
                   "aarch64-manylinux_2_35 for Grace and other ARM nodes)")
    c.add_argument("--index-url", default=PYPI, metavar="URL",
                   help=f"vllm, sglang, comfyui: the package index (default {PYPI})")
    c.add_argument("--extra-index-url", action="append", default=[], metavar="URL",
                   help="vllm, sglang, comfyui: another index, searched first (e.g. "
                   "PyTorch's for a CUDA build of torch); repeatable")
    c.add_argument("--exclude-newer", default="", metavar="DATE",
                   help="vllm, sglang, comfyui: resolve as the indexes stood at DATE "
                   "(2025-06-30 or an RFC 3339 time); default now, and for comfyui a day "
                   "after its archive's file dates, as nodes resolve it")
    c.add_argument("--release-url", default="", metavar="URL",
                   help="where engine archives are: URL/VERSION/FILE with URL/VERSION/"
                   "SHA256SUMS (comfyui: URL/FILE, as engines.comfyui.release_url); default "
                   "the publisher's GitHub releases")
    c.add_argument("--model", action="append", default=[],
                   metavar="NAME=hf://ORG/REPO[@REVISION][:GLOB,...]",
                   help="a model's files, pinned to the commit REVISION (default main) "
                   "names now; GLOBs pick files (e.g. '*Q4_K_M.gguf')")
    c.add_argument("--hub", default="https://huggingface.co", metavar="URL",
                   help="the Hugging Face-style hub models come from")
    c.add_argument("--hub-token-file", type=Path, metavar="FILE",
                   help="a token for gated or private models (sent to --hub only)")
    c.add_argument("--wheels", type=Path, metavar="DIR",
                   help="a folder of llmgw's wheels (and its dependencies'), taken as they are")
    c.add_argument("--llmgw-lock", type=Path, metavar="DIR",
                   help="llmgw's wheels from its source checkout DIR: its dependencies at "
                   "the versions its uv.lock pins, one wheel each for every "
                   "--llmgw-platform, from --index-url, and llmgw's own wheel")
    c.add_argument("--llmgw-wheel", type=Path, metavar="FILE",
                   help="with --llmgw-lock: llmgw's own wheel (default: built from DIR "
                   "with uv build)")
    c.add_argument("--llmgw-python", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                   metavar="X.Y", help="with --llmgw-lock: the CPython the nodes run llmgw "
                   f"on (default {sys.version_info[0]}.{sys.version_info[1]}, this one)")
    c.add_argument("--llmgw-platform", action="append", default=[], metavar="PLATFORM",
                   help="with --llmgw-lock: a platform of the nodes, ARCH-manylinux_2_NN "
                   f"(default {wheelsets.DEFAULT_PLATFORM}); repeatable")
    c.add_argument("--nix-closure", action="append", default=[], metavar="STOREPATH",
                   help="llmgw's Nix closure instead of wheels: a store path or a link to "
                   "one (./result, a NixOS system built with `nix build`) and all it "
                   "references, as a binary cache signed with a Nix key made for this "
                   "bundle; repeatable")
    c.add_argument("--nix", default="nix", metavar="COMMAND",
                   help="the nix command for --nix-closure (default: nix on PATH)")
    c.add_argument("--llmgw-version", default="", metavar="VERSION",
                   help="the llmgw release the bundle is for (default this llmgw's)")
    c.add_argument("--expires-in", default="90d", metavar="DURATION",
                   help="how long the bundle may be imported: 30d, 12h (default 90d)")
    c.set_defaults(func=_create)

    v = cmds.add_parser(
        "verify", help="check a bundle without importing it",
        description="Check the signature against the trusted keys, the manifest's sha256 "
        "if given, the expiry, then every file's size and sha256, and that no file is "
        "missing or extra.")
    v.add_argument("bundle", type=Path, metavar="BUNDLE", help="a bundle folder or tar")
    keys = v.add_mutually_exclusive_group(required=True)
    keys.add_argument("--trusted-key", action="append", metavar="LINE",
                      help="a public key line (`llmgw bundle keygen` printed it); repeatable")
    keys.add_argument("--config", "-c", metavar="server.yaml",
                      help="take the trusted keys from server.yaml's bundle.trusted_keys")
    v.add_argument("--sha256", metavar="HEX", help="the manifest's sha256, carried apart")
    v.set_defaults(func=_verify)

    i = cmds.add_parser(
        "import", help="verify a bundle and make it the mirror's current one",
        description="Verify the bundle (as `verify`) into the mirror (server.yaml's "
        "bundle.mirror_dir, else <state_dir>/mirror) and switch the mirror to it. A bundle "
        "made before the mirror's current one is refused unless --allow-downgrade. Any "
        "refusal leaves the mirror as it was.")
    i.add_argument("bundle", type=Path, metavar="BUNDLE", help="a bundle folder or tar")
    i.add_argument("--config", "-c", required=True, metavar="server.yaml",
                   help="the control plane's configuration: its trusted keys and mirror")
    i.add_argument("--sha256", metavar="HEX", help="the manifest's sha256, carried apart")
    i.add_argument("--allow-downgrade", action="store_true",
                   help="accept a bundle older than the mirror's current one")
    i.set_defaults(func=_import)

    n = cmds.add_parser(
        "nix-copy", help="copy llmgw's Nix closure from the mirror into a Nix store",
        description="Copy the closure that the mirror's current bundle holds (`create "
        "--nix-closure`) into a Nix store with `nix copy`, trusting only the Nix key that "
        "the bundle's signed manifest names and requiring its signatures, then print the "
        "steps that switch a NixOS machine to a system in it. Run it as root (a trusted "
        "Nix user) on the control plane.")
    n.add_argument("--config", "-c", required=True, metavar="server.yaml",
                   help="the control plane's configuration: where its mirror is")
    n.add_argument("--to", metavar="STORE",
                   help="the Nix store to copy into (default: the machine's own)")
    n.add_argument("--nix", default="nix", metavar="COMMAND",
                   help="the nix command (default: nix on PATH)")
    n.add_argument("--print", action="store_true", dest="print_only",
                   help="print the commands instead of running them")
    n.set_defaults(func=_nix_copy)


def _fail(command: str, err: Exception) -> int:
    print(f"llmgw bundle {command}: {err}", file=sys.stderr)
    return 2


def _keygen(args: argparse.Namespace) -> int:
    from llmgw.bundle import signing
    from llmgw.bundle.manifest import BundleError

    try:
        line = signing.keygen(args.file)
    except BundleError as err:
        return _fail("keygen", err)
    key_id = signing.key_id(signing.load_public_key(line))
    print(f"wrote {args.file} (key {key_id}); list this line in server.yaml's "
          "bundle.trusted_keys:", file=sys.stderr)
    print(line)
    return 0


def _create(args: argparse.Namespace) -> int:
    from llmgw.bundle import create, nix
    from llmgw.bundle.manifest import BundleError

    def say(text: str) -> None:
        print(text, file=sys.stderr)

    try:
        token = None
        if args.hub_token_file is not None:
            try:
                token = args.hub_token_file.read_text().strip()
            except OSError as err:
                raise BundleError(f"--hub-token-file {args.hub_token_file}: "
                                  f"{err.strerror}") from None
        arches = tuple(args.arch) or create.DEFAULT_ARCHES
        request = create.Request(
            out=args.out, key_file=args.key, tar=args.tar,
            engines=[create.parse_engine(e, arches, tuple(args.build)) for e in args.engine],
            models=[create.parse_model(m) for m in args.model], wheels=args.wheels,
            llmgw_lock=args.llmgw_lock, llmgw_wheel=args.llmgw_wheel,
            llmgw_targets=[wheelsets.Target(
                python=args.llmgw_python, platform=platform, index_url=args.index_url,
                extra_index_urls=tuple(args.extra_index_url))
                for platform in args.llmgw_platform or [wheelsets.DEFAULT_PLATFORM]],
            nix_closure=args.nix_closure, nix=nix.parse_command(args.nix),
            llmgw_version=args.llmgw_version,
            expires_in=create.parse_duration(args.expires_in),
            release_url=args.release_url, hub=args.hub, hub_token=token,
            engine_sha256=dict(create.parse_engine_sha256(p) for p in args.engine_sha256),
            python_target=wheelsets.Target(
                python=args.python, platform=args.python_platform, index_url=args.index_url,
                extra_index_urls=tuple(args.extra_index_url),
                exclude_newer=args.exclude_newer))
        if not (request.engines or request.models or request.wheels or request.nix_closure
                or request.llmgw_lock):
            raise BundleError("nothing to bundle: give --engine, --model, --wheels, "
                              "--llmgw-lock or --nix-closure")
        made = asyncio.run(create.create_bundle(request, say))
    except BundleError as err:
        return _fail("create", err)
    m = made.manifest
    print(f"wrote {made.path}: {len(m.files)} files, {made.size:,} bytes, signed by key "
          f"{made.key_id}, expires {m.expires_at.isoformat()}", file=sys.stderr)
    print("carry the manifest's sha256 apart from the bundle and give it to "
          "`llmgw bundle import --sha256`:", file=sys.stderr)
    print(f"manifest sha256 {made.sha256}")
    print(f"key id {made.key_id}")
    return 0


def _trusted(config_path: str) -> tuple[ServerConfig, list[str]]:
    config = load(config_path, ServerConfig)
    return config, list(config.bundle.trusted_keys)


def _contents(manifest) -> list[str]:
    lines = []
    if manifest.llmgw is not None:
        lines.append(f"llmgw {manifest.llmgw.version} ({manifest.llmgw.kind}, "
                     f"{len(manifest.llmgw.files)} files)")
        lines += [f"nix closure of {root}" for root in manifest.llmgw.roots]
    lines += [f"{e.name} {e.version} ({len(e.files)} files)" for e in manifest.engines]
    lines += [f"model {m.name}: {m.repo}@{m.revision} ({len(m.files)} files)"
              for m in manifest.models]
    return lines


def _verify(args: argparse.Namespace) -> int:
    from llmgw.bundle import verify
    from llmgw.bundle.manifest import BundleError

    keys = args.trusted_key if args.config is None else _trusted(args.config)[1]
    try:
        checked = verify.verify_bundle(args.bundle, keys, args.sha256)
    except BundleError as err:
        return _fail("verify", err)
    except OSError as err:
        return _fail("verify", f"{err.filename or args.bundle}: {err.strerror}")
    m = checked.manifest
    print(f"{args.bundle}: good: signed by key {m.key_id}, made {m.created_at.isoformat()}, "
          f"expires {m.expires_at.isoformat()}, for llmgw {m.llmgw_version}; "
          f"{checked.files} files, {checked.size:,} bytes, manifest sha256 {checked.sha256}")
    for line in _contents(m):
        print(f"  {line}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from llmgw.bundle import mirror
    from llmgw.bundle.manifest import BundleError

    config, keys = _trusted(args.config)
    folder = mirror.configured_dir(config)
    try:
        done = mirror.import_bundle(args.bundle, folder, keys, args.sha256,
                                    args.allow_downgrade)
    except BundleError as err:
        return _fail("import", f"{err} (the mirror {folder} is unchanged)")
    except OSError as err:
        return _fail("import", f"{err.filename or folder}: {err.strerror}")
    m = done.manifest
    if done.unchanged:
        print(f"{folder}: bundle {done.bundle_id} is already the current one; nothing "
              "changed")
        return 0
    print(f"{folder}: imported bundle {done.bundle_id} (made {m.created_at.isoformat()}, "
          f"expires {m.expires_at.isoformat()}, for llmgw {m.llmgw_version}): "
          f"{done.files} files, {done.size:,} bytes")
    for line in _contents(m):
        print(f"  {line}")
    return 0


def _nix_copy(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    from llmgw.bundle import mirror, nix
    from llmgw.bundle.manifest import BundleError

    config = load(args.config, ServerConfig)
    try:
        command = nix.parse_command(args.nix)
        found = nix.from_mirror(mirror.configured_dir(config))
        argv = [*command, *nix.copy_args(found, args.to)]
    except BundleError as err:
        return _fail("nix-copy", err)
    release, steps = found.release, nix.switch_steps(found.release.roots)
    switch = ["# then, on the machine each system is for, as root:", *steps] if steps else []
    if args.print_only:
        print(f"# llmgw {release.version}'s closure from bundle {found.bundle_id}, "
              "trusting only the key its signed manifest names:")
        print(shlex.join(argv))
        for line in switch:
            print(line)
        return 0
    try:
        done = subprocess.run(argv, check=False)
    except FileNotFoundError:
        return _fail("nix-copy", f"{command[0]}: no such command: install Nix, or give its "
                     "path with --nix")
    if done.returncode != 0:
        return _fail("nix-copy", f"nix copy exited {done.returncode} (its message is above): "
                     f"the closure of bundle {found.bundle_id} was not taken; run "
                     "`llmgw bundle nix-copy --print` to see the command")
    print(f"copied llmgw {release.version}'s closure from bundle {found.bundle_id} into "
          f"{args.to or 'the Nix store'}: " + " ".join(release.roots))
    for line in switch:
        print(line)
    return 0
