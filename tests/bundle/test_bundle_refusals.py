"""Every way a bundle can be wrong is refused as a whole, saying what is wrong, and the
mirror is left as it was: ``current`` points where it did, the same bundles are kept and
no staging is left behind."""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from llmgw.bundle import manifest as mf
from llmgw.bundle import mirror, signing, verify
from llmgw.bundle.manifest import BundleError
from tests.bundle.conftest import COMMIT, GGUF, LLMGW_VERSION, REPO, snapshot


def refused(bundle: Path, folder: Path, match: str, trusted: list[str], **options) -> str:
    """Import ``bundle``: refused with a message matching ``match``, the mirror as it was."""
    before = snapshot(folder)
    with pytest.raises(BundleError, match=match) as caught:
        mirror.import_bundle(bundle, folder, trusted, **options)
    assert snapshot(folder) == before
    assert before.staging == []
    return str(caught.value)


def resign(bundle: Path, key: Path, change: Callable[[dict], None] = lambda _: None) -> None:
    """Rewrite the bundle's manifest with ``change`` and sign it with ``key`` (its key id
    set to that key's): a bundle as someone holding the key would make it."""
    private = signing.load_private_key(key)
    doc = json.loads((bundle / mf.MANIFEST).read_bytes())
    doc["key_id"] = signing.key_id(private.public_key())
    change(doc)
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    (bundle / mf.MANIFEST).write_bytes(data)
    (bundle / mf.SIGNATURE).write_bytes(signing.sign(private, data))


def pack(folder: Path, out: Path, *extra: tarfile.TarInfo) -> Path:
    """``folder`` as a tar, with ``extra`` entries (links, odd names) after its own."""
    with tarfile.open(out, "w") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
        for info in extra:
            data = b"x" * info.size
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _file_of(made, kind: str) -> str:
    m = made.manifest
    return {"engine": m.engines[0].files[0],
            "model": mf.model_path(REPO, COMMIT, GGUF),
            "wheel": m.llmgw.files[0]}[kind]


@pytest.mark.parametrize("kind", ["engine", "model", "wheel"])
def test_a_flipped_byte_is_refused(parts, made, bundle, mirror_dir, kind):
    path = _file_of(made, kind)
    _flip(bundle / "files" / path)
    text = refused(bundle, mirror_dir, rf"files/{path} has sha256 [0-9a-f]{{64}}; the "
                   rf"manifest says [0-9a-f]{{64}}: the file was changed or damaged",
                   [parts.trusted])
    assert str(bundle) in text
    with pytest.raises(BundleError, match="changed or damaged"):
        verify.verify_bundle(bundle, [parts.trusted])


def test_a_flipped_byte_inside_a_tar_is_refused(parts, made, bundle, mirror_dir, tmp_path):
    _flip(bundle / "files" / _file_of(made, "model"))
    tar = pack(bundle, tmp_path / "bundle.tar")
    refused(tar, mirror_dir, rf"files/{mf.model_path(REPO, COMMIT, GGUF)} has sha256",
            [parts.trusted])


@pytest.mark.parametrize("name", ["models/extra.bin", "models/.hidden", "engines/llama.cpp/x"])
def test_a_file_the_manifest_does_not_list_is_refused(parts, bundle, mirror_dir, name):
    (bundle / "files" / name).write_bytes(b"not in the manifest")
    refused(bundle, mirror_dir, rf"extra file files/{name}: the manifest does not list it",
            [parts.trusted])


def test_a_file_beside_the_bundle_s_own_is_refused(parts, bundle, mirror_dir):
    (bundle / "notes.txt").write_text("hello")
    refused(bundle, mirror_dir, "extra file notes.txt", [parts.trusted])


def test_a_missing_or_shortened_file_is_refused(parts, made, bundle, mirror_dir):
    gguf = bundle / "files" / mf.model_path(REPO, COMMIT, GGUF)
    data = gguf.read_bytes()
    gguf.write_bytes(data[:-1])
    refused(bundle, mirror_dir, rf"{GGUF} is {len(data) - 1} bytes; the manifest says "
            rf"{len(data)}", [parts.trusted])
    gguf.unlink()
    refused(bundle, mirror_dir, rf"files/{mf.model_path(REPO, COMMIT, GGUF)} is missing",
            [parts.trusted])


def test_a_manifest_changed_after_signing_is_refused(parts, bundle, mirror_dir):
    path = bundle / mf.MANIFEST
    path.write_bytes(path.read_bytes().replace(f'"{LLMGW_VERSION}"'.encode(), b'"9.9.9"'))
    refused(bundle, mirror_dir, r"the signature does not match the manifest \(it was changed "
            r"after signing, or signed by another key\)", [parts.trusted])


def test_a_bundle_signed_by_a_key_that_is_not_trusted_is_refused(parts, bundle, mirror_dir):
    resign(bundle, parts.other_key)
    other = signing.key_id(signing.load_private_key(parts.other_key).public_key())
    refused(bundle, mirror_dir, rf"signed by key {other}, which bundle.trusted_keys does "
            r"not list", [parts.trusted])
    # Claiming the trusted key's id does not help: its signature does not match.
    resign(bundle, parts.other_key, lambda doc: doc.update(
        key_id=signing.key_id(signing.load_public_key(parts.trusted))))
    refused(bundle, mirror_dir, "the signature does not match the manifest", [parts.trusted])


def test_no_trusted_key_or_a_malformed_one_is_refused(parts, bundle, mirror_dir):
    refused(bundle, mirror_dir, "no key is trusted", [])
    refused(bundle, mirror_dir, r"trusted key 'ssh-ed25519 AAAA' does not start with "
            "llmgw-bundle-ed25519:", [parts.trusted, "ssh-ed25519 AAAA"])
    refused(bundle, mirror_dir, "is not 32 bytes of base64",
            ["llmgw-bundle-ed25519:AAAA", parts.trusted])


def test_a_bundle_that_is_not_the_one_carried_is_refused(parts, made, bundle, mirror_dir):
    wrong = "0" * 64
    refused(bundle, mirror_dir, rf"the manifest's sha256 is {made.sha256}, not the {wrong} "
            "you carried", [parts.trusted], sha256=wrong)


def test_an_expired_bundle_is_refused(parts, made, bundle, mirror_dir, tmp_path):
    later = made.manifest.expires_at + timedelta(seconds=1)
    refused(bundle, mirror_dir, rf"the bundle expired at "
            rf"{re.escape(made.manifest.expires_at.isoformat())}.*make a new one",
            [parts.trusted], now=later)
    # One made long ago, with a short life, is refused for its expiry (not as a downgrade).
    old = parts.make_small(tmp_path / "old", made.manifest.created_at - timedelta(days=30),
                           expires_in=timedelta(days=1))
    refused(old.path, mirror_dir, "the bundle expired at", [parts.trusted])


def test_a_bundle_older_than_the_current_one_is_refused_unless_allowed(
        parts, made, mirror_dir, tmp_path):
    older = parts.make_small(tmp_path / "older", made.manifest.created_at - timedelta(days=14))
    refused(older.path, mirror_dir, r"before the mirror's current one .*: going back is "
            "refused unless you pass --allow-downgrade", [parts.trusted])
    done = mirror.import_bundle(older.path, mirror_dir, [parts.trusted], allow_downgrade=True)
    assert mirror.current_manifest(mirror_dir) == older.manifest
    assert done.bundle_id in mirror.bundles(mirror_dir)


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d["files"][0].update(path="../../escape"), r"'\.\.' is not one plain"),
    (lambda d: d["files"][0].update(path="/etc/escape"), "is not a relative path"),
    (lambda d: d["files"][0].update(path="models/.cache/x"), r"'\.cache' is not one plain"),
    (lambda d: d["engines"][0].update(version=".."), "llama.cpp version '..'"),
    (lambda d: d["models"][0].update(revision=".hidden"), "revision '.hidden'"),
    (lambda d: d["models"][0].update(repo="../HuggingFaceTB"), "repository '..'"),
    (lambda d: d["llmgw"].update(version=".0.9"), "llmgw version '.0.9'"),
], ids=["dotdot-path", "absolute-path", "dotted-path", "engine-version", "model-revision",
        "model-repo", "llmgw-version"])
def test_dotdot_and_dotted_names_in_a_signed_manifest_are_refused(
        parts, bundle, mirror_dir, tmp_path, change, match):
    resign(bundle, parts.key, change)
    refused(bundle, mirror_dir, match, [parts.trusted])
    assert not any(p.name == "escape" for p in tmp_path.rglob("*"))


def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _file(name: str, size: int = 3) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


@pytest.mark.parametrize(("entry", "match"), [
    (_link("files/models/link", tarfile.SYMTYPE, "/etc/passwd"), "is a symbolic link"),
    (_link("files/models/link", tarfile.LNKTYPE, "manifest.json"), "is a hard link"),
    (_link("files/models/dev", tarfile.CHRTYPE, ""), "is a character device"),
    (_file("../escape"), r"entry '\.\./escape'"),
    (_file("/tmp/escape"), "entry '/tmp/escape'"),
    (_file("files/.hidden"), r"'\.hidden' is not one plain"),
    (_file("manifest.json"), "manifest.json is in the tar twice"),
], ids=["symlink", "hardlink", "device", "dotdot", "absolute", "dotted", "twice"])
def test_a_tar_with_links_odd_entries_or_escaping_names_is_refused(
        parts, bundle, mirror_dir, tmp_path, entry, match):
    tar = pack(bundle, tmp_path / "bundle.tar", entry)
    refused(tar, mirror_dir, match, [parts.trusted])
    with pytest.raises(BundleError, match=match):
        verify.verify_bundle(tar, [parts.trusted])
    assert not (tmp_path / "escape").exists()


def test_a_symbolic_link_in_a_bundle_folder_is_refused(parts, made, bundle, mirror_dir):
    # Even one pointing at the very bytes the manifest lists.
    gguf = bundle / "files" / mf.model_path(REPO, COMMIT, GGUF)
    gguf.unlink()
    gguf.symlink_to(made.path / "files" / mf.model_path(REPO, COMMIT, GGUF))
    refused(bundle, mirror_dir, f"files/{mf.model_path(REPO, COMMIT, GGUF)} is a symbolic "
            "link", [parts.trusted])


def test_a_staging_folder_left_by_a_killed_import_is_cleared_by_the_next(
        parts, made, mirror_dir):
    left = mirror_dir / (mirror.STAGING_PREFIX + "killed")
    (left / "files").mkdir(parents=True)
    mirror.import_bundle(made.path, mirror_dir, [parts.trusted])
    assert not left.exists()
    assert mirror.current_manifest(mirror_dir) == made.manifest


def test_a_folder_that_is_not_a_bundle_is_refused(parts, mirror_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, mirror_dir, "manifest.json is missing: this is not a bundle",
            [parts.trusted])
    refused(tmp_path / "nowhere", mirror_dir, "no such bundle", [parts.trusted])
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    refused(junk, mirror_dir, "not a readable tar", [parts.trusted])
    shutil.rmtree(empty)
