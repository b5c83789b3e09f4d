"""A bundle made from local parts holds what was asked for, pinned and hashed; it verifies,
as a folder and as a tar, and an import makes it the mirror's current bundle, keeping the
one before it and no older."""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import stat
from datetime import timedelta

import pytest

from llmgw.bundle import mirror, signing, verify
from llmgw.bundle.manifest import BundleError, engine_path, llmgw_path, model_path
from tests.bundle.conftest import (
    COMMIT,
    GGUF,
    LLMGW_VERSION,
    REPO,
    VERSION,
    assets,
    snapshot,
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_bundle_holds_the_engine_builds_model_files_and_wheels_asked_for(parts, made):
    m = made.manifest
    files = {f.path: f for f in m.files}

    [engine] = m.engines
    assert (engine.name, engine.version) == ("llama.cpp", VERSION)
    assert sorted(engine.files) == sorted(engine_path("llama.cpp", VERSION, a) for a in assets())
    assert len(engine.files) == 2  # the CPU and the Vulkan archive for x86_64
    for asset, data in parts.archives.items():
        entry = files[engine_path("llama.cpp", VERSION, asset)]
        assert (entry.size, entry.sha256) == (len(data), _sha(data))

    # Pinned to the commit "main" named; the repository's dotted git files left out.
    [model] = m.models
    assert (model.name, model.repo, model.revision) == ("smollm2", REPO, COMMIT)
    assert sorted(model.files) == sorted(model_path(REPO, COMMIT, f)
                                         for f in ("README.md", "config.json", GGUF))
    for name in ("README.md", "config.json", GGUF):
        entry = files[model_path(REPO, COMMIT, name)]
        assert entry.sha256 == _sha(parts.model_files[name])
    fetched = [e.path for e in parts.hub.log if "/resolve/" in e.path]
    assert fetched and all(f"/resolve/{COMMIT}/" in p for p in fetched)

    assert m.llmgw is not None
    assert (m.llmgw.version, m.llmgw.kind) == (LLMGW_VERSION, "wheels")
    assert m.llmgw.platforms == ["any", "manylinux_2_17_x86_64"]
    for wheel in parts.wheels.iterdir():
        entry = files[llmgw_path(LLMGW_VERSION, wheel.name)]
        assert entry.sha256 == _sha(wheel.read_bytes())

    assert m.llmgw_version == LLMGW_VERSION
    assert m.expires_at - m.created_at == timedelta(days=90)
    public = signing.load_public_key(parts.trusted)
    assert made.key_id == m.key_id == signing.key_id(public)
    assert made.sha256 == _sha((made.path / "manifest.json").read_bytes())
    # Every file on disk is what the manifest says, and nothing else is there.
    on_disk = {str(p.relative_to(made.path / "files")): p for p in
               (made.path / "files").rglob("*") if p.is_file()}
    assert sorted(on_disk) == sorted(files)
    assert all(_sha(p.read_bytes()) == files[k].sha256 for k, p in on_disk.items())
    assert sorted(p.name for p in made.path.iterdir()) == ["files", "manifest.json",
                                                           "manifest.sig"]


def test_a_bundle_verifies_then_imports_and_the_mirror_serves_its_files(parts, made, tmp_path):
    checked = verify.verify_bundle(made.path, [parts.trusted], made.sha256)
    assert (checked.manifest, checked.sha256) == (made.manifest, made.sha256)
    assert checked.files == len(made.manifest.files) == 7
    assert checked.size == sum(f.size for f in made.manifest.files)

    folder = tmp_path / "mirror"
    assert mirror.current_manifest(folder) is None
    done = mirror.import_bundle(made.path, folder, [parts.trusted], sha256=made.sha256)
    created = made.manifest.created_at.strftime("%Y%m%dT%H%M%SZ")
    assert done.bundle_id == f"{created}-{made.sha256[:12]}"
    assert (done.files, done.unchanged) == (7, False)
    assert os.readlink(folder / "current") == f".bundles/{done.bundle_id}"
    assert mirror.current_manifest(folder) == made.manifest
    gguf = mirror.file_path(folder, model_path(REPO, COMMIT, GGUF))
    assert gguf.read_bytes() == parts.model_files[GGUF]
    for asset, data in parts.archives.items():
        assert mirror.file_path(folder, engine_path("llama.cpp", VERSION, asset)
                                ).read_bytes() == data
    assert snapshot(folder).staging == []
    # What was imported is the bundle as signed: it verifies where it lies.
    assert verify.verify_bundle(folder / "current", [parts.trusted]).sha256 == made.sha256

    # The same bundle again changes nothing.
    again = mirror.import_bundle(made.path, folder, [parts.trusted])
    assert again.unchanged and again.bundle_id == done.bundle_id
    assert mirror.bundles(folder) == [done.bundle_id]


def test_a_tar_bundle_verifies_and_imports_as_its_folder_does(parts, made, tmp_path):
    tar = parts.make(tmp_path / "bundle.tar", tar=True)
    assert tar.path.is_file() and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    checked = verify.verify_bundle(tar.path, [parts.trusted], tar.sha256)
    assert checked.files == 7
    # Compressed on the way, it is the same bundle.
    gz = tmp_path / "bundle.tar.gz"
    gz.write_bytes(gzip.compress(tar.path.read_bytes()))
    assert verify.verify_bundle(gz, [parts.trusted], tar.sha256).files == 7
    folder = tmp_path / "mirror"
    mirror.import_bundle(tar.path, folder, [parts.trusted], sha256=tar.sha256)
    assert mirror.current_manifest(folder) == tar.manifest
    gguf = mirror.file_path(folder, model_path(REPO, COMMIT, GGUF))
    assert gguf.read_bytes() == parts.model_files[GGUF]
    # Staging is private while the import runs; the bundle keeps that mode.
    assert stat.S_IMODE((folder / ".bundles").joinpath(mirror.bundles(folder)[0]).stat()
                        .st_mode) == 0o700


def test_the_mirror_keeps_the_bundle_before_the_current_one_and_goes_back_only_if_asked(
        parts, made, tmp_path):
    folder = tmp_path / "mirror"
    base = made.manifest.created_at
    a, b, c = (parts.make_small(tmp_path / name, base - timedelta(days=days))
               for name, days in (("a", 3), ("b", 2), ("c", 1)))
    ids = {}
    for name, bundle in (("a", a), ("b", b), ("c", c)):
        ids[name] = mirror.import_bundle(bundle.path, folder, [parts.trusted]).bundle_id
    assert mirror.bundles(folder) == [ids["b"], ids["c"]]  # a was removed; b is kept
    assert os.readlink(folder / "current") == f".bundles/{ids['c']}"

    before = snapshot(folder)
    with pytest.raises(BundleError, match=r"before the mirror's current one .*"
                                          r"--allow-downgrade"):
        mirror.import_bundle(b.path, folder, [parts.trusted])
    assert snapshot(folder) == before

    back = mirror.import_bundle(b.path, folder, [parts.trusted], allow_downgrade=True)
    assert back.bundle_id == ids["b"] and mirror.current_manifest(folder) == b.manifest
    assert mirror.bundles(folder) == [ids["b"], ids["c"]]
    further = mirror.import_bundle(a.path, folder, [parts.trusted], allow_downgrade=True)
    assert mirror.current_manifest(folder) == a.manifest
    assert mirror.bundles(folder) == [further.bundle_id, ids["b"]]  # c went
    assert snapshot(folder).staging == []


def test_the_mirror_gives_paths_inside_the_current_bundle_only(parts, made, tmp_path):
    folder = tmp_path / "mirror"
    with pytest.raises(BundleError, match="holds no imported bundle"):
        mirror.file_path(folder, "engines/llama.cpp/b1/x.tar.gz")
    mirror.import_bundle(made.path, folder, [parts.trusted])
    for bad in ("../current/manifest.json", "/etc/passwd", "models/.hidden", "a//b", ""):
        with pytest.raises(BundleError):
            mirror.file_path(folder, bad)
    inside = mirror.file_path(folder, "engines/llama.cpp/b1/x.tar.gz")
    assert inside.resolve().is_relative_to((folder / ".bundles").resolve())
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{12}", inside.parts[-6])
