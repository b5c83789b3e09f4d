"""Fetching weights from a real Hugging Face-shaped hub (tests/hub.py) over loopback:
what lands on disk, what is refused, and that a failure leaves nothing behind. Free-space
failures run in a child process with a 2 MiB tmpfs on the weights directory, in a mount
namespace of its own."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.weights import MANIFEST, MAX_FILES, WeightsError, WeightsStore, model_path
from llmgw.core.weights import directory_name, parse_source, weights_key
from tests.hub import Hub

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 10


def blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


SMALL = {  # small files are served by the hub itself, the rest by its CDN (LFS)
    "config.json": b'{"hidden_size": 64}\n',
    "tokenizer.json": blob(800, 1),
    "model.safetensors": blob(40_000, 2),
    "extra/weights-2.safetensors": blob(5_000, 3),
}
GGUF = {
    "README.md": b"# quantisations\n",
    "m-Q4_K_M.gguf": blob(3_000, 4),
    "m-Q8_0.gguf": blob(6_000, 5),
}
REPOS = {"org/small": SMALL, "org/gguf": GGUF}


def key(source: str, patterns: tuple[str, ...] = ()) -> str:
    return weights_key(parse_source(source), patterns)


SMALL_KEY = key("hf://org/small")


@pytest.fixture
async def hub():
    async with Hub(REPOS) as h:
        yield h


def make_store(hub: Hub, *dirs: tuple[Path, bool], token: str | None = None) -> WeightsStore:
    return WeightsStore(list(dirs), hub.url, token, read_timeout_s=0.5,
                        progress_interval_s=0.2)


async def ensure(store: WeightsStore, source: str, patterns=(), label="small", progress=None):
    return await asyncio.wait_for(
        store.ensure(key(source, tuple(sorted(patterns))), source, list(patterns), label,
                     progress or (lambda _: None)), WAIT_S)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


async def test_fetch_lands_complete_and_the_scan_holds_it(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    store.prepare()
    path = await ensure(store, "hf://org/small")
    assert path == tmp_path / "w" / directory_name(SMALL_KEY)
    for name, data in SMALL.items():
        assert (path / name).read_bytes() == data
    manifest = json.loads((path / MANIFEST).read_text())
    assert (manifest["key"], manifest["source"], manifest["revision"]) == \
        (SMALL_KEY, "hf://org/small", "main")
    files = {f["path"]: f for f in manifest["files"]}
    assert sorted(files) == sorted(SMALL)
    for name, data in SMALL.items():
        assert files[name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert files[name]["size"] == len(data)
    assert "git_oid" in files["config.json"] and "git_oid" not in files["model.safetensors"]
    [scanned] = store.scan()
    assert scanned.held == [SMALL_KEY] and scanned.note == ""
    assert leftovers(tmp_path / "w") == []
    # LFS files came from the CDN after a redirect, small ones from the hub itself.
    assert [e.site for e in hub.downloads("model.safetensors")] == ["cdn"]
    assert [e.site for e in hub.downloads("config.json")] == ["hub"]
    assert all(e.authorization is None for e in hub.log)


async def test_patterns_select_the_files(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    path = await ensure(store, "hf://org/gguf", ["*Q4_K_M.gguf"], label="gguf")
    assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST, "m-Q4_K_M.gguf"])
    assert model_path(path, "llama.cpp") == path / "m-Q4_K_M.gguf"
    assert store.scan()[0].held == ["org/gguf@main[*Q4_K_M.gguf]"]
    assert hub.downloads("m-Q8_0.gguf") == [] and hub.downloads("README.md") == []


async def test_a_second_ensure_does_not_touch_the_network(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    first = await ensure(store, "hf://org/small")
    hub.log.clear()
    assert await ensure(store, "hf://org/small") == first
    assert await ensure(make_store(hub, (tmp_path / "w", False)), "hf://org/small") == first
    assert hub.log == []


async def test_weights_placed_by_hand_are_used_without_a_source(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    with pytest.raises(WeightsError, match=r"no complete weights for my-model in .*llmgw "
                       r"weights manifest DIR --key 'my-model'"):
        await asyncio.wait_for(store.ensure("my-model", "", [], "my-model", print), WAIT_S)
    (tmp_path / "w" / "anything").mkdir(parents=True)
    (tmp_path / "w" / "anything" / "m.gguf").write_bytes(b"GGUF")
    from llmgw.agent.weights import write_manifest
    write_manifest(tmp_path / "w" / "anything", "my-model")
    found = await asyncio.wait_for(store.ensure("my-model", "", [], "my-model", print), WAIT_S)
    assert found == tmp_path / "w" / "anything"
    assert hub.log == []


async def test_a_checksum_mismatch_fails_cleanly_and_keeps_what_was_complete(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    held = await ensure(store, "hf://org/small")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in held.rglob("*")
              if p.is_file()}
    good = GGUF["m-Q8_0.gguf"]
    bad = bytes([good[0] ^ 1]) + good[1:]
    hub.corrupt["m-Q8_0.gguf"] = bad
    with pytest.raises(WeightsError) as err:
        await ensure(store, "hf://org/gguf", label="gguf")
    assert str(err.value) == (
        f"fetching gguf: m-Q8_0.gguf: sha256 mismatch: expected "
        f"{hashlib.sha256(good).hexdigest()}, got {hashlib.sha256(bad).hexdigest()}")
    assert leftovers(tmp_path / "w") == []
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [held.name]
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in held.rglob("*")
            if p.is_file()} == before
    assert store.scan()[0].held == [SMALL_KEY]


async def test_a_small_file_is_checked_by_its_git_oid(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    hub.corrupt["README.md"] = b"# quantisationz\n"
    with pytest.raises(WeightsError, match=r"README.md: git oid mismatch: expected "
                       rf"{hashlib.sha1(b'blob 16' + bytes(1) + GGUF['README.md']).hexdigest()}"):
        await ensure(store, "hf://org/gguf", label="gguf")
    assert list((tmp_path / "w").iterdir()) == []


@pytest.mark.parametrize("change, message", [
    ("longer", r"m-Q4_K_M.gguf is larger than the 2999 bytes the listing says"),
    ("shorter", r"m-Q4_K_M.gguf is 3000 bytes, the listing says 3001"),
])
async def test_a_size_other_than_listed_fails(hub, tmp_path, change, message):
    hub.listed_size["m-Q4_K_M.gguf"] = 2999 if change == "longer" else 3001
    store = make_store(hub, (tmp_path / "w", False))
    with pytest.raises(WeightsError, match=message):
        await ensure(store, "hf://org/gguf", label="gguf")
    assert list((tmp_path / "w").iterdir()) == []


@pytest.mark.parametrize("source, url", [
    ("hf://org/nothing", "/api/models/org/nothing/tree/main"),
    ("hf://org/small@v9", "/api/models/org/small/tree/v9"),
])
async def test_404_says_no_such_repository_or_revision(hub, tmp_path, source, url):
    store = make_store(hub, (tmp_path / "w", False))
    with pytest.raises(WeightsError) as err:
        await ensure(store, source)
    assert str(err.value) == (f"fetching small: GET {hub.url}{url} answered 404: no such "
                              "repository or revision")


async def test_a_gated_repository_needs_the_token_and_only_the_hub_sees_it(tmp_path):
    async with Hub(REPOS, token="hf_secret") as hub:
        with pytest.raises(WeightsError, match=r"answered 401: gated or private: set "
                           r"weights.token_file"):
            await ensure(make_store(hub, (tmp_path / "w", False)), "hf://org/small")
        with pytest.raises(WeightsError, match="answered 401: gated or private, and the token"):
            await ensure(make_store(hub, (tmp_path / "w", False), token="wrong"),
                         "hf://org/small")
        hub.log.clear()
        store = make_store(hub, (tmp_path / "w", False), token="hf_secret")
        await ensure(store, "hf://org/small")
        sites = {(e.site, e.authorization) for e in hub.log}
        assert sites == {("hub", "Bearer hf_secret"), ("cdn", None)}


async def test_a_repository_url_source_uses_its_own_host_without_the_hub_token(tmp_path):
    async with Hub(REPOS) as hub:
        store = WeightsStore([(tmp_path / "w", False)], "http://127.0.0.1:9", "hf_secret")
        path = await ensure(store, f"{hub.url}/org/gguf", ["*.md"], label="gguf")
        assert (path / "README.md").read_bytes() == GGUF["README.md"]
        assert hub.log and all(e.authorization is None for e in hub.log)
        hub.token = "hf_secret"  # gated there: the hub's token is still not sent
        with pytest.raises(WeightsError, match=r"answered 401: gated or private: the token in "
                           r"weights.token_file goes only to weights.hub \(http://127.0.0.1:9\)"):
            await ensure(store, f"{hub.url}/org/small")


async def test_concurrent_ensures_fetch_once(tmp_path):
    async with Hub(REPOS, chunk=4096, chunk_delay=0.005) as hub:
        store = make_store(hub, (tmp_path / "w", False))
        a, b = await asyncio.gather(ensure(store, "hf://org/small"),
                                    ensure(store, "hf://org/small"))
        assert a == b
        for name in SMALL:
            assert len(hub.downloads(name)) == 1, name
        assert len([e for e in hub.log if "/tree/" in e.path]) == 1


async def test_progress_is_throttled_and_ends_complete(tmp_path):
    data = {"big.safetensors": blob(1_200_000, 6)}
    async with Hub({"org/big": data}, chunk=64 * 1024, chunk_delay=0.04) as hub:
        store = make_store(hub, (tmp_path / "w", False))
        said: list[tuple[float, str]] = []
        start = time.monotonic()
        await ensure(store, "hf://org/big", label="qwen", progress=lambda m: said.append(
            (time.monotonic(), m)))
        took = time.monotonic() - start
    assert took > 0.6, "the hub was meant to be slow enough for several messages"
    texts = [m for _, m in said]
    assert all(re.fullmatch(r"fetching qwen: \d+\.\d/1\.2 MB", m) for m in texts), texts
    assert texts[-1] == "fetching qwen: 1.2/1.2 MB"
    assert 3 <= len(texts) <= took / 0.2 + 2, texts
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(said[:-1])]
    assert all(gap >= 0.19 for gap in gaps), gaps


@pytest.mark.parametrize("bad", ["../evil.bin", "/etc/evil.bin", "a\\evil.bin", "a//b",
                                 "a/./b", ""])
async def test_a_bad_path_in_the_listing_refuses_the_whole_fetch(hub, tmp_path, bad):
    hub.extra.append({"type": "file", "oid": "0" * 40, "size": 1, "path": bad})
    store = make_store(hub, (tmp_path / "w", False))
    store.prepare()
    with pytest.raises(WeightsError, match=r"not a safe relative path; nothing was fetched"):
        await ensure(store, "hf://org/small")
    assert hub.downloads() == []
    assert list((tmp_path / "w").iterdir()) == []


async def test_a_listing_past_the_limit_is_refused(hub, tmp_path):
    hub.extra.extend({"type": "file", "oid": "0" * 40, "size": 1, "path": f"f{i}"}
                     for i in range(MAX_FILES))
    store = make_store(hub, (tmp_path / "w", False))
    with pytest.raises(WeightsError, match=f"lists more than {MAX_FILES} files"):
        await ensure(store, "hf://org/small")
    assert hub.downloads() == []


async def test_a_paginated_listing_is_followed(tmp_path):
    async with Hub(REPOS, page_size=2) as hub:
        store = make_store(hub, (tmp_path / "w", False))
        path = await ensure(store, "hf://org/small")
        assert sorted(f.relative_to(path).as_posix() for f in path.rglob("*")
                      if f.is_file() and f.name != MANIFEST) == sorted(SMALL)
        assert len([e for e in hub.log if "/tree/" in e.path]) == 3  # 5 entries, 2 a page


@pytest.mark.parametrize("failure, message", [
    ("stall", r"GET http://127.0.0.1:\d+/cdn/[0-9a-f]{64} broke off after 20.0 of 40.0 KB: "
              "timed out"),
    ("drop", r"/cdn/[0-9a-f]{64} broke off after 20.0 of 40.0 KB: the connection closed "
             "before the end"),
])
async def test_a_broken_transfer_leaves_nothing(hub, tmp_path, failure, message):
    getattr(hub, failure).add("model.safetensors")
    store = make_store(hub, (tmp_path / "w", False))
    with pytest.raises(WeightsError, match=message) as err:
        await ensure(store, "hf://org/small")
    assert "X-Amz-Signature" not in str(err.value)  # signed URLs stay out of messages
    assert list((tmp_path / "w").iterdir()) == []


async def test_fetches_go_to_the_first_local_directory(hub, tmp_path):
    store = make_store(hub, (tmp_path / "filer", True), (tmp_path / "local", False))
    store.prepare()
    path = await ensure(store, "hf://org/small")
    assert path.parent == tmp_path / "local"
    filer, local = store.scan()
    assert (filer.shared, filer.held, local.shared, local.held) == (True, [], False, [SMALL_KEY])
    only_shared = make_store(hub, (tmp_path / "f1", True), (tmp_path / "f2", True))
    only_shared.prepare()
    assert (await ensure(only_shared, "hf://org/small")).parent == tmp_path / "f1"


async def test_incomplete_weights_in_the_way_are_replaced(hub, tmp_path):
    store = make_store(hub, (tmp_path / "w", False))
    path = await ensure(store, "hf://org/small")
    (path / "model.safetensors").write_bytes(b"truncated")
    assert store.scan()[0].held == []
    assert await ensure(store, "hf://org/small") == path
    assert (path / "model.safetensors").read_bytes() == SMALL["model.safetensors"]
    assert store.scan()[0].held == [SMALL_KEY] and leftovers(tmp_path / "w") == []


# --- free space, on a real 2 MiB filesystem ------------------------------------------------

CHILD = """
import asyncio, json, os, sys
from pathlib import Path
from llmgw.agent.weights import WeightsError, WeightsStore
from tests.hub import Hub

async def main(weights, size, fill):
    async with Hub({"org/big": {"model.safetensors": os.urandom(size)}}) as hub:
        if fill:  # another writer fills the disk as the download starts
            def filler(_):
                st = os.statvfs(weights)
                (weights / "filler").write_bytes(bytes(st.f_bavail * st.f_frsize - 100_000))
            hub.before_file = filler
        store = WeightsStore([(weights, False)], hub.url)
        out = {}
        try:
            await asyncio.wait_for(store.ensure("org/big@main", "hf://org/big", [], "big",
                                                lambda _: None), 10)
        except WeightsError as err:
            out["error"] = str(err)
        out["left"] = sorted(os.listdir(weights))
        out["downloads"] = len(hub.downloads())
    print(json.dumps(out))

asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "fill"))
"""


def on_small_disk(weights: Path, size: int, mode: str) -> dict:
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MiB tmpfs in a private mount namespace needs root")
    weights.mkdir()
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=2m,mode=0755 llmgw-test "$1" && exec "$2" -c "$3" "$1" "$4" '
         '"$5"', "sh", str(weights), sys.executable, CHILD, str(size), mode],
        capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_not_enough_free_space_is_refused_before_fetching(tmp_path):
    out = on_small_disk(tmp_path / "w", 3_000_000, "check")
    assert out == {"error": f"fetching big needs 3.0 MB; {tmp_path / 'w'} has 2.1 MB free: "
                   "free space or add a weights directory", "left": [], "downloads": 0}


def test_a_disk_that_fills_during_the_fetch_fails_cleanly(tmp_path):
    out = on_small_disk(tmp_path / "w", 1_500_000, "fill")
    assert out == {"error": f"fetching big: the disk holding {tmp_path / 'w'} is full: the "
                   "weights need 1.5 MB and 2.1 MB was free when the fetch began; free space "
                   "or add a weights directory", "left": ["filler"], "downloads": 1}
