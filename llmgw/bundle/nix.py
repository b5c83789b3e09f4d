"""llmgw's Nix closure in a bundle, and back out of the mirror into a Nix store.

On the connected side, ``nix copy --to file://…`` writes the closure of the given store
paths (a NixOS system, llmgw's package) as a binary cache under ``llmgw/<version>/nix``,
each narinfo signed by a Nix key made for this bundle alone. The secret key lives in a
private temporary folder while Nix signs, and is removed after: nothing can sign with it
again. Its public key goes into the manifest, which the bundle's Ed25519 signature covers;
that is what makes it trustworthy.

On the air-gapped side, ``nix copy --from file://<mirror>/…/nix`` trusts that key only,
taken from the verified manifest in the mirror and never from the cache, with signatures
required: a narinfo changed or signed by any other key is refused by Nix, and a changed
nar by its hash. (Content-addressed paths, such as sources added with ``nix store add``,
need no signature: Nix checks them by their content.)
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from llmgw.bundle import manifest as mf
from llmgw.bundle import mirror
from llmgw.bundle.manifest import BundleError, LlmgwRelease, Manifest

# `nix copy`, `nix key` and `nix path-info` are behind this feature on a stock Nix.
FEATURES = ("--extra-experimental-features", "nix-command")
COMPRESSION = "zstd"
SYSTEM_PROFILE = "/nix/var/nix/profiles/system"
# What a path may hold to go into a file:// store URL as it is: Nix reads ? as the start
# of the store's settings and does not unquote %.
_URL_PATH = re.compile(r"[A-Za-z0-9._+=@/,:~-]+")
_QUICK_S = 300  # key and path-info commands; a copy takes as long as the closure needs


def parse_command(text: str) -> list[str]:
    """``--nix``: the Nix command, split as a shell splits it (``nix`` by default)."""
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise BundleError(f"--nix {text!r}: {err}") from None
    if not words:
        raise BundleError("--nix is empty: give the nix command, e.g. /run/current-system/"
                          "sw/bin/nix")
    return words


def _run(nix: list[str], args: list[str], what: str, *, stdin: str | None = None,
         timeout: float | None = _QUICK_S) -> str:
    try:
        done = subprocess.run([*nix, *FEATURES, *args], input=stdin, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise BundleError(f"{nix[0]}: no such command: install Nix, or give its path with "
                          "--nix") from None
    except subprocess.TimeoutExpired:
        raise BundleError(f"{what}: {shlex.join(nix)} did not finish in {timeout:g} s"
                          ) from None
    if done.returncode != 0:
        said = "\n".join(done.stderr.strip().splitlines()[-6:]) or "(nothing on stderr)"
        raise BundleError(f"{what}: nix exited {done.returncode}: {said}")
    return done.stdout


def store_url(folder: Path, **settings: str) -> str:
    """A file:// binary cache store at ``folder``, with store settings."""
    path = str(folder.absolute())
    for value in (path, *settings.values()):
        if not _URL_PATH.fullmatch(value):
            raise BundleError(f"{value}: Nix cannot take this path in a file:// store URL "
                              "(only letters, digits and ._+=@/,:~-): put the bundle or the "
                              "mirror under a plainer path")
    query = "&".join(f"{k.replace('_', '-')}={v}" for k, v in settings.items())
    return f"file://{path}" + (f"?{query}" if query else "")


def key_name(now: datetime) -> str:
    """The Nix key's name, which its signatures carry: unique per bundle, so that keys of
    several bundles can be trusted side by side."""
    return f"llmgw-bundle-{now:%Y%m%dT%H%M%SZ}"


def store_roots(nix: list[str], given: list[str]) -> list[str]:
    """The store paths ``given`` names (store paths, or links to them such as ``nix build``'s
    ``result``), as Nix resolves them; each must be valid in the store."""
    shown = _run(nix, ["path-info", "--", *given], f"nix path-info {' '.join(given)}")
    roots = sorted(set(shown.split()))
    for root in roots:
        mf.check_store_path(root, "nix path-info gave")
    if not roots:
        raise BundleError(f"nix path-info {' '.join(given)} named no store path")
    return roots


def export_closure(nix: list[str], given: list[str], cache: Path, name: str
                   ) -> tuple[str, list[str]]:
    """Write the closure of ``given`` as a binary cache at ``cache``, signed by a new Nix
    key called ``name`` that is thrown away after: (its public key, the roots)."""
    roots = store_roots(nix, given)
    with tempfile.TemporaryDirectory(prefix="llmgw-nix-key-") as private:  # 0700
        secret_file = Path(private) / "secret"
        secret = _run(nix, ["key", "generate-secret", "--key-name", name],
                      "nix key generate-secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        public = _run(nix, ["key", "convert-secret-to-public"],
                      "nix key convert-secret-to-public", stdin=secret).strip()
        url = store_url(cache, compression=COMPRESSION, secret_key=str(secret_file))
        # Signed as it is written: each narinfo gets the key's signature.
        _run(nix, ["copy", "--to", url, *roots], f"nix copy --to {store_url(cache)}",
             timeout=None)
    return public, roots


def cache_files(cache: Path) -> list[tuple[str, int, str]]:
    """The files Nix wrote under ``cache``: (path relative to it, size, sha256), each path
    of plain names as a bundle holds them."""
    found: list[tuple[str, int, str]] = []

    def walk(folder: Path, prefix: str) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            rel = prefix + entry.name
            try:
                mf.check_element(entry.name, "name")
            except BundleError as err:
                raise BundleError(f"nix copy wrote {rel}, which a bundle cannot hold: {err}"
                                  ) from None
            if entry.is_dir(follow_symlinks=False):
                walk(Path(entry.path), rel + "/")
            elif entry.is_file(follow_symlinks=False):
                hasher = hashlib.sha256()
                with open(entry.path, "rb") as f:
                    while chunk := f.read(2**20):
                        hasher.update(chunk)
                found.append((rel, entry.stat(follow_symlinks=False).st_size,
                              hasher.hexdigest()))
            else:
                raise BundleError(f"nix copy wrote {rel}, which is not a plain file")

    walk(cache, "")
    return found


@dataclass(frozen=True, slots=True)
class MirrorClosure:
    """The Nix closure of the mirror's current bundle."""

    bundle_id: str
    manifest: Manifest
    release: LlmgwRelease
    cache: Path


def from_mirror(mirror_dir: Path) -> MirrorClosure:
    """The current bundle's closure, its key and roots from the manifest the import
    verified."""
    folder = mirror.current_dir(mirror_dir)
    if folder is None:
        raise BundleError(f"the mirror {mirror_dir} holds no bundle: import one with "
                          "`llmgw bundle import BUNDLE --config server.yaml`")
    path = folder / mf.MANIFEST
    try:
        manifest = mf.decode(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise BundleError(f"{path} is missing: import the bundle again") from None
    release = manifest.llmgw
    if release is None or release.kind != "nix":
        held = "no llmgw" if release is None else f"llmgw's {release.kind}"
        raise BundleError(f"the mirror's bundle {folder.name} holds {held}, not llmgw's Nix "
                          "closure: make one with `llmgw bundle create --nix-closure PATH`")
    cache = folder / mf.FILES / mf.llmgw_path(release.version, mf.NIX_CACHE)
    return MirrorClosure(folder.name, manifest, release, cache)


def copy_args(found: MirrorClosure, to: str | None = None) -> list[str]:
    """``nix copy`` of the roots from the mirror's cache, trusting the manifest's key only
    and requiring signatures (whatever nix.conf says)."""
    args = [*FEATURES, "copy", "--from", store_url(found.cache),
            "--trusted-public-keys", found.release.nix_public_key, "--require-sigs"]
    return [*args, *(["--to", to] if to else []), *found.release.roots]


def switch_steps(roots: list[str]) -> list[str]:
    """For each root that is a NixOS system: make it the system profile, and switch."""
    steps = []
    for root in roots:
        if "-nixos-system-" in root:
            steps += [shlex.join(["nix-env", "-p", SYSTEM_PROFILE, "--set", root]),
                      shlex.join([f"{root}/bin/switch-to-configuration", "switch"])]
    return steps
