"""Making a bundle refuses a download that is not what its publisher or the hub's listing
says, and what it was asked for in words it cannot use; a refused bundle leaves nothing
behind, not even half of one."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from pathlib import Path

import pytest

from llmgw.bundle import create
from llmgw.bundle.manifest import BundleError
from tests.bundle.conftest import (
    GGUF,
    REPO,
    VERSION,
    assets,
    pinned_hub,
    release_archive,
    static_server,
)


def _refused(parts, out: Path, match: str, **changes) -> None:
    with pytest.raises(BundleError, match=match):
        parts.make(out, **changes)
    assert list(out.parent.iterdir()) == [], "a refused bundle leaves nothing"


def _release(root: Path, sums: str) -> Path:
    (root / VERSION).mkdir(parents=True)
    for asset in assets():
        (root / VERSION / asset).write_bytes(release_archive(asset))
    (root / VERSION / "SHA256SUMS").write_text(sums)
    return root


def test_an_archive_whose_sha256_is_not_the_publisher_s_is_refused(parts, tmp_path):
    sums = "".join(f"{'a' * 64}  {a}\n" for a in assets())
    with static_server(_release(tmp_path / "rel", sums)) as url:
        out = tmp_path / "out"
        out.mkdir()
        _refused(parts, out / "bundle", rf"{url}/{VERSION}/llama-{VERSION}-bin-ubuntu-x64"
                 rf"\.tar\.gz has sha256 [0-9a-f]{{64}}, but its publisher says {'a' * 64}",
                 release_url=url, models=[], wheels=None)


def test_an_archive_the_publisher_lists_no_sha256_for_is_refused(parts, tmp_path):
    with static_server(_release(tmp_path / "rel", "")) as url:
        out = tmp_path / "out"
        out.mkdir()
        _refused(parts, out / "bundle", rf"SHA256SUMS gives no sha256 for llama-{VERSION}-"
                 r"bin-ubuntu-x64\.tar\.gz: it is not published for this version",
                 release_url=url, models=[], wheels=None)


def test_a_model_file_larger_or_other_than_the_hub_lists_is_refused(parts, tmp_path):
    files = {GGUF: b"GGUF" + bytes(5000), "config.json": b"{}"}
    with pinned_hub({REPO: files}) as hub:
        out = tmp_path / "out"
        out.mkdir()
        model = [create.ModelWant("smollm2", REPO, "main", ("*.gguf",))]
        hub.listed_size[GGUF] = 4000  # the hub claims less than it sends
        _refused(parts, out / "bundle", r"is 5004 bytes, more than the 4000 expected",
                 hub=hub.url, models=model, engines=[], wheels=None)
        del hub.listed_size[GGUF]
        hub.corrupt[GGUF] = b"GGUF" + bytes(4999) + b"!"
        _refused(parts, out / "bundle", rf"{REPO}/{GGUF} has sha256 [0-9a-f]{{64}}; the hub's "
                 rf"listing says {hashlib.sha256(files[GGUF]).hexdigest()}",
                 hub=hub.url, models=model, engines=[], wheels=None)


def test_a_model_revision_is_pinned_to_the_commit_the_hub_names(parts, tmp_path):
    other = "1" * 40
    with pinned_hub({REPO: {"config.json": b"{}"}}, commit=other) as hub:
        made = parts.make(tmp_path / "b", hub=hub.url, engines=[], wheels=None,
                          models=[create.ModelWant("m", REPO, "main")])
        assert made.manifest.models[0].revision == other
        assert made.manifest.files[0].path == f"models/{REPO}/{other}/config.json"
        # A commit given is taken as it is: nothing asks the hub what it names.
        asked = len(hub.log)
        again = parts.make(tmp_path / "c", hub=hub.url, engines=[], wheels=None,
                           models=[create.ModelWant("m", REPO, other)])
        assert again.manifest.models[0].revision == other
        assert not any("/revision/" in e.path for e in hub.log[asked:])


def test_what_cannot_be_bundled_is_refused_in_words(parts, tmp_path):
    with pytest.raises(BundleError, match=r"--model 'x': write NAME=hf://ORG/REPO"):
        create.parse_model("x")
    with pytest.raises(BundleError, match=r"repository must be ORG/NAME"):
        create.parse_model("m=hf://../x")
    with pytest.raises(BundleError, match=r"file pattern '\.\./\*' is not allowed"):
        create.parse_model("m=hf://org/repo:../*")
    assert create.parse_model("m=hf://org/repo@v1:*.gguf,config.json") == create.ModelWant(
        "m", "org/repo", "v1", ("*.gguf", "config.json"))
    with pytest.raises(BundleError, match="no engine 'llama'"):
        create.parse_engine("llama", ("x86_64",), ())
    with pytest.raises(BundleError, match=r"the version '\.\.'"):
        create.parse_engine("llama.cpp@..", ("x86_64",), ())
    with pytest.raises(BundleError, match=r"llama\.cpp publishes no build for riscv64"):
        create.llama_cpp_assets(create.parse_engine("llama.cpp", ("riscv64",), ()))
    arm = create.llama_cpp_assets(create.parse_engine("llama.cpp@b1", ("aarch64",), ()))
    assert arm == ["llama-b1-bin-ubuntu-arm64.tar.gz"]  # no GPU builds for arm64
    assert create.parse_duration("30d") == timedelta(days=30)
    assert create.parse_duration("12h") == timedelta(hours=12)
    for bad in ("0d", "30", "1y", "-1d"):
        with pytest.raises(BundleError, match="write a number and d, h or m"):
            create.parse_duration(bad)
    (tmp_path / "taken").mkdir()
    with pytest.raises(BundleError, match="exists; give a new name"):
        asyncio.run(create.create_bundle(parts.request(tmp_path / "taken")))
