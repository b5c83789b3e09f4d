"""llmgw's Nix closure in a bundle and back: ``bundle create --nix-closure`` writes it as a
binary cache signed by a Nix key made for the bundle, the import checks it as any other
files, and ``bundle nix-copy`` takes it into an empty Nix store trusting only the key the
signed manifest names.

Nix here is ``../shared/nixos-eval``'s Nix 2.26, each store a private one in the test's
folder (nothing touches /nix). The closure is built by Nix, not added: an input-addressed
output (a stand-in for a NixOS system, named like one) that references a source folder,
so that its narinfo's signature is what Nix checks; sources, being content-addressed,
Nix checks by their content.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from llmgw.bundle import create, mirror, signing
from llmgw.bundle import manifest as mf
from llmgw.bundle.manifest import BundleError
from tests.integration.cluster import cannot

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.9.0"
# A derivation named as a NixOS system is: its output references the payload folder.
SYSTEM_NAME = "nixos-system-cp1-25.11.20261204"
DERIVATION = """
let payload = builtins.path { path = ./payload; name = "llmgw-payload"; }; in
derivation {
  name = "@NAME@";
  system = "x86_64-linux";
  builder = "/bin/sh";
  args = [ "-c" "echo ${payload} > $out" ];
}
""".replace("@NAME@", SYSTEM_NAME)


@dataclass
class Nix:
    """Nix 2.26 with ``store`` (a private store) as its default store."""

    wrapper: Path
    scratch: Path
    store: Path

    @property
    def command(self) -> list[str]:
        return [str(self.wrapper), "nix"]

    def env(self) -> dict[str, str]:
        config = "\n".join([
            "build-users-group =", "substituters =", "experimental-features = nix-command",
            f"store = {self.store}",
            # Builds run here, in Nix's sandbox, with the host's /bin/sh and its libraries;
            # no build hook (the wrapper cannot start one).
            "build-hook =", "builders =", "sandbox-paths = /bin? /lib? /lib64? /usr?",
        ])
        return {**os.environ, "NIX_CONFIG": config,
                "XDG_CACHE_HOME": str(self.scratch / "cache")}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.command, *args], capture_output=True, text=True,
                              env=self.env(), timeout=120, check=False, cwd=self.scratch)

    def ok(self, *args: str) -> str:
        done = self.run(*args)
        assert done.returncode == 0, f"nix {' '.join(args)}:\n{done.stderr[-4000:]}"
        return done.stdout


@dataclass
class Closure:
    nix: Nix
    result: Path  # nix-build's link to the root
    root: str
    payload: str  # the source folder the root references


@pytest.fixture(scope="module")
def closure(tmp_path_factory) -> Closure:
    """A store holding a closure of two paths, built once for these tests."""
    wrapper = Path(os.environ.get("LLMGW_NIXOS_EVAL", ROOT.parent / "shared" / "nixos-eval"))
    wrapper = wrapper / "nix"
    if not wrapper.exists():
        cannot(f"{wrapper} is missing (Nix 2.26 for the Nix closure in a bundle)")
    scratch = tmp_path_factory.mktemp("nix")
    nix = Nix(wrapper, scratch, scratch / "store-a")
    version = nix.run("--version")
    if version.returncode != 0 or "(Nix) 2.26." not in version.stdout:
        cannot(f"{wrapper} does not run here: {version.stderr[-2000:]}")
    (scratch / "payload").mkdir()
    (scratch / "payload" / "README").write_text("llmgw's closure, in a bundle\n")
    (scratch / "payload" / "run").write_text("#!/bin/sh\necho llmgw\n")
    (scratch / "payload" / "run").chmod(0o755)
    (scratch / "system.nix").write_text(DERIVATION)
    built = subprocess.run(
        [str(wrapper), "nix-build", "system.nix", "-o", "result"], capture_output=True,
        text=True, env=nix.env(), timeout=120, check=False, cwd=scratch)
    if built.returncode != 0:
        cannot(f"Nix cannot build in its sandbox here: {built.stderr[-2000:]}")
    root = os.readlink(scratch / "result")
    paths = nix.ok("path-info", "--recursive", root).split()
    (payload,) = [p for p in paths if p != root]
    assert root.endswith(f"-{SYSTEM_NAME}") and payload.endswith("-llmgw-payload")
    return Closure(nix, scratch / "result", root, payload)


@pytest.fixture
def nix(closure, monkeypatch) -> Nix:
    """The closure's Nix, for what runs in this process (create_bundle) too."""
    env = closure.nix.env()
    monkeypatch.setenv("NIX_CONFIG", env["NIX_CONFIG"])
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    return closure.nix


def llmgw(nix: Nix, *args: object, tmp: Path | None = None) -> subprocess.CompletedProcess:
    env = nix.env() if tmp is None else {**nix.env(), "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "llmgw", "bundle", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def make(closure: Closure, tmp_path: Path, **changes) -> tuple[create.Created, str]:
    """A bundle of the closure alone, and the public line of the key that signed it."""
    key = tmp_path / "signing.pem"
    trusted = signing.keygen(key) if not key.exists() else \
        signing.public_line(signing.load_private_key(key).public_key())
    fields = dict(out=tmp_path / "bundle", key_file=key, nix_closure=[str(closure.result)],
                  nix=closure.nix.command, llmgw_version=VERSION)
    request = create.Request(**{**fields, **changes})
    return asyncio.run(create.create_bundle(request)), trusted


def server_yaml(tmp_path: Path, trusted: str) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\nbundle:\n  trusted_keys:\n"
                    f"    - {trusted}\n")
    return path


def narinfo(cache: Path, store_path: str) -> Path:
    return cache / f"{store_path.removeprefix('/nix/store/')[:32]}.narinfo"


def test_the_closure_goes_into_a_bundle_and_back_trusting_the_manifest_key_only(
        closure, nix, tmp_path):
    key = tmp_path / "signing.pem"
    trusted = signing.keygen(key)
    out = tmp_path / "bundle"
    (tmp_path / "tmp").mkdir()
    made = llmgw(nix, "create", out, "--key", key, "--nix-closure", closure.result,
                 "--nix", " ".join(nix.command), "--llmgw-version", VERSION,
                 tmp=tmp_path / "tmp")
    assert made.returncode == 0, made.stderr
    sha = made.stdout.split()[2]

    manifest = mf.decode((out / mf.MANIFEST).read_bytes())
    release = manifest.llmgw
    assert release is not None
    assert (release.kind, release.roots) == ("nix", [closure.root])
    key_name, _, _ = release.nix_public_key.partition(":")
    assert key_name == f"llmgw-bundle-{manifest.created_at:%Y%m%dT%H%M%SZ}"
    cache = f"llmgw/{VERSION}/nix"
    listed = {f.path: f for f in manifest.files}
    assert sorted(release.files) == sorted(listed)
    narinfos = sorted(p for p in listed if p.endswith(".narinfo"))
    nars = sorted(p for p in listed if p.startswith(f"{cache}/nar/"))
    assert narinfos == sorted(f"{cache}/{p[11:43]}.narinfo"
                              for p in (closure.root, closure.payload))
    assert len(nars) == 2 and all(p.endswith(".nar.zst") for p in nars)
    assert set(listed) == {f"{cache}/nix-cache-info", *narinfos, *nars}
    for path, entry in listed.items():
        data = (out / mf.FILES / path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256)
    for path in narinfos:
        sigs = re.findall(r"^Sig: (\S+?):", (out / mf.FILES / path).read_text(), re.M)
        assert sigs == [key_name], path
    # The secret key was written in a private temporary folder only, and removed.
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "nix closure of " + closure.root in llmgw(
        nix, "verify", out, "--trusted-key", trusted, "--sha256", sha).stdout

    config = server_yaml(tmp_path, trusted)
    imported = llmgw(nix, "import", out, "--config", config, "--sha256", sha)
    assert imported.returncode == 0, imported.stderr
    current = mirror.current_dir(tmp_path / "state" / "mirror")
    assert current is not None

    store_b = tmp_path / "store-b"
    shown = llmgw(nix, "nix-copy", "--config", config, "--to", store_b,
                  "--nix", " ".join(nix.command), "--print")
    assert shown.returncode == 0, shown.stderr
    command = [*nix.command, "--extra-experimental-features", "nix-command", "copy",
               "--from", f"file://{current / mf.FILES / cache}",
               "--trusted-public-keys", release.nix_public_key, "--require-sigs",
               "--to", str(store_b), closure.root]
    lines = shown.stdout.splitlines()
    assert shlex.split(lines[1]) == command, lines
    assert lines[3:] == [
        f"nix-env -p /nix/var/nix/profiles/system --set {closure.root}",
        f"{closure.root}/bin/switch-to-configuration switch"]
    assert not store_b.exists()  # --print runs nothing

    copied = llmgw(nix, "nix-copy", "--config", config, "--to", store_b,
                   "--nix", " ".join(nix.command))
    assert copied.returncode == 0, copied.stderr
    assert copied.stdout.splitlines()[0] == (
        f"copied llmgw {VERSION}'s closure from bundle {current.name} into {store_b}: "
        f"{closure.root}")
    got = nix.ok("--store", str(store_b), "path-info", "--recursive", closure.root).split()
    assert sorted(got) == sorted([closure.root, closure.payload])
    assert (store_b / closure.root.lstrip("/")).read_text() == f"{closure.payload}\n"
    assert (store_b / closure.payload.lstrip("/") / "run").read_text() == \
        "#!/bin/sh\necho llmgw\n"
    nix.ok("--store", str(store_b), "store", "verify", "--recursive", "--sigs-needed", "1",
           "--trusted-public-keys", release.nix_public_key, closure.root)
    info = json.loads(nix.ok("--store", str(store_b), "path-info", "--json", closure.root))
    assert [s.partition(":")[0] for s in info[closure.root]["signatures"]] == [key_name]


def _altered(nix: Nix, cache: Path, root: str) -> None:
    """One character of the root's signature changed."""
    info = narinfo(cache, root)
    text = info.read_text()
    sig = re.search(r"^Sig: [^:]+:(.)", text, re.M)
    assert sig
    flipped = "B" if sig[1] == "A" else "A"
    info.write_text(text[:sig.start(1)] + flipped + text[sig.end(1):])


def _other_key(nix: Nix, cache: Path, root: str) -> None:
    """The root signed again by another key of the same name, its own signature gone."""
    info = narinfo(cache, root)
    text = info.read_text()
    name = re.search(r"^Sig: ([^:]+):", text, re.M)[1]  # type: ignore[index]
    info.write_text(re.sub(r"^Sig: .*\n", "", text, flags=re.M))
    (nix.scratch / "other.key").write_text(nix.ok("key", "generate-secret", "--key-name", name))
    nix.ok("store", "sign", "--store", f"file://{cache}", "--key-file",
           str(nix.scratch / "other.key"), root)
    assert re.findall(r"^Sig: ([^:]+):", info.read_text(), re.M) == [name]


@pytest.mark.parametrize("change", [_altered, _other_key], ids=["altered", "other-key"])
def test_nix_copy_refuses_a_narinfo_not_signed_by_the_manifest_key(closure, nix, tmp_path,
                                                                  change):
    made, trusted = make(closure, tmp_path)
    config = server_yaml(tmp_path, trusted)
    folder = tmp_path / "state" / "mirror"
    mirror.import_bundle(made.path, folder, [trusted])
    current = mirror.current_dir(folder)
    assert current is not None
    # Changed in the mirror after the import checked it: Nix is the check left.
    cache = current / mf.FILES / f"llmgw/{VERSION}/nix"
    change(nix, cache, closure.root)

    store_b = tmp_path / "store-b"
    copied = llmgw(nix, "nix-copy", "--config", config, "--to", store_b,
                   "--nix", " ".join(nix.command))
    assert copied.returncode == 2
    assert (f"error: cannot add path '{closure.root}' because it lacks a signature by a "
            "trusted key") in copied.stderr
    assert copied.stderr.splitlines()[-1] == (
        f"llmgw bundle nix-copy: nix copy exited 1 (its message is above): the closure of "
        f"bundle {current.name} was not taken; run `llmgw bundle nix-copy --print` to see "
        "the command")
    assert nix.run("--store", str(store_b), "path-info", closure.root).returncode != 0


def test_a_changed_nar_is_refused_by_the_import(closure, nix, tmp_path):
    made, trusted = make(closure, tmp_path)
    nar = next(f for f in made.manifest.files if f.path.endswith(".nar.zst"))
    target = made.path / mf.FILES / nar.path
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    folder = tmp_path / "mirror"
    with pytest.raises(BundleError, match=re.escape(f"{mf.FILES}/{nar.path} has sha256 ")
                       + r"[0-9a-f]{64}; the manifest says " + nar.sha256):
        mirror.import_bundle(made.path, folder, [trusted])
    assert mirror.current_dir(folder) is None


def test_create_refuses_what_is_not_a_store_path_and_leaves_nothing(closure, nix, tmp_path):
    missing = "/nix/store/" + "0" * 32 + "-not-built"
    with pytest.raises(BundleError, match=r"(?s)^nix path-info .*nix exited 1: .*not-built"):
        make(closure, tmp_path, nix_closure=[missing])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["signing.pem"]

    with pytest.raises(BundleError, match="--wheels and --nix-closure: a bundle carries "
                       "llmgw one way"):
        make(closure, tmp_path, wheels=tmp_path)


def _release(**changes) -> bytes:
    """A manifest holding a Nix closure, with ``changes`` made to its llmgw entry."""
    root = "/nix/store/" + "a" * 32 + "-nixos-system-cp1-25.11"
    narinfo_path = f"llmgw/{VERSION}/nix/{'a' * 32}.narinfo"
    release = {"version": VERSION, "kind": "nix", "files": [narinfo_path],
               "nix_public_key": "llmgw-bundle-20261204T181600Z:" + "A" * 43 + "=",
               "roots": [root], **changes}
    doc = {"llmgw_version": VERSION, "created_at": "2026-12-04T18:16:00Z",
           "expires_at": "2027-01-04T18:16:00Z", "key_id": "0" * 16, "llmgw": release,
           "files": [{"path": p, "size": 1, "sha256": "0" * 64} for p in release["files"]]}
    return msgspec.json.encode(doc)


@pytest.mark.parametrize(("changes", "error"), [
    ({}, None),
    ({"roots": ["/usr/bin/llmgw"]},
     "root '/usr/bin/llmgw' is not a Nix store path (/nix/store/HASH-NAME)"),
    ({"roots": ["/nix/store/" + "e" * 32 + "-x"]}, "is not a Nix store path"),
    ({"roots": ["/nix/store/" + "b" * 32 + "-x"]},
     f"the root /nix/store/{'b' * 32}-x has no llmgw/{VERSION}/nix/{'b' * 32}.narinfo"),
    ({"roots": []}, "a Nix closure names its roots"),
    ({"nix_public_key": "llmgw-bundle-ed25519:" + "A" * 10},
     "is not a Nix public key (NAME:base64 of 32 bytes)"),
    ({"kind": "wheels"}, "roots and nix_public_key belong to a Nix closure (kind nix), "
                         "not to wheels"),
], ids=["good", "not-a-store-path", "not-nix-base32", "root-without-narinfo", "no-roots",
        "not-a-nix-key", "wheels-with-roots"])
def test_the_manifest_checks_a_nix_closure(changes, error):
    if error is None:
        assert mf.decode(_release(**changes)).llmgw.kind == "nix"  # type: ignore[union-attr]
        return
    with pytest.raises(BundleError, match=re.escape(error)):
        mf.decode(_release(**changes))
