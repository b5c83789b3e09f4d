"""Installing a llama.cpp-shaped release archive end to end: a real executable built here
with gcc, packed with its shared library and links the way llama.cpp's releases are,
served from a GitHub-shaped release server on 127.0.0.1 (a 302 to the object store, as
GitHub answers), downloaded, checked against its sha256, unpacked, ldd-checked, run with
``--version``, renamed into place and marked. The failures leave nothing behind."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.install import archives as installer
from llmgw.agent.install.archive import UnsafeArchive
from llmgw.agent.install.archives import (
    MARKER,
    install_archive,
    installed_archive,
    read_marker,
    recheck,
)
from llmgw.agent.install.download import download
from llmgw.agent.install.pypi import InstallError

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldd") is None,
                                reason="needs gcc to build an engine binary, and ldd")

GOOD = "llama-b6000-bin-ubuntu-x64.tar.gz"
NO_LIB = "llama-b6001-bin-ubuntu-x64.tar.gz"
FAILS = "llama-b6002-bin-ubuntu-x64.tar.gz"
ESCAPE = "llama-b6003-bin-ubuntu-x64.tar.gz"

SERVER_C = r"""
#include <stdio.h>
#include <string.h>
int ggml_build(void);
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        fprintf(stderr, "version: %d (abc1234)\nbuilt with cc for x86_64-linux-gnu\n",
                ggml_build());
        return 0;
    }
    return 2;
}
"""


def gcc(*args: str, cwd: Path) -> None:
    subprocess.run(["gcc", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def pack(members: dict[str, Path | str | bytes], modes: dict[str, int] | None = None) -> bytes:
    """A .tar.gz of ``{name: file | symlink target (str) | content}``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, what in members.items():
            if isinstance(what, Path):
                tar.add(what, arcname=name)
                continue
            info = tarfile.TarInfo(name)
            info.mode = (modes or {}).get(name, 0o644)
            if isinstance(what, str):
                info.type, info.linkname = tarfile.SYMTYPE, what
                tar.addfile(info)
            else:
                info.size = len(what)
                tar.addfile(info, io.BytesIO(what))
    return out.getvalue()


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, bytes]:
    """Release archives: a good build; one whose binary needs a library it does not ship;
    one whose ``--version`` fails; one carrying the two-step link escape."""
    good = tmp_path_factory.mktemp("good")
    (good / "ggml.c").write_text("int ggml_build(void) { return 6000; }\n")
    gcc("-shared", "-fPIC", "-Wl,-soname,libggml.so.0", "-o", "libggml.so.0.0.1", "ggml.c",
        cwd=good)
    os.symlink("libggml.so.0.0.1", good / "libggml.so.0")
    (good / "server.c").write_text(SERVER_C)
    # $ORIGIN: the libraries beside the binary, as in llama.cpp's Linux releases.
    gcc("-o", "llama-server", "server.c", "-L.", "-l:libggml.so.0", "-Wl,-rpath,$ORIGIN",
        cwd=good)

    no_lib = tmp_path_factory.mktemp("nolib")
    (no_lib / "omp.c").write_text("int ggml_build(void) { return 6001; }\n")
    gcc("-shared", "-fPIC", "-Wl,-soname,libllmgw-omp.so.1", "-o", "libllmgw-omp.so.1",
        "omp.c", cwd=no_lib)
    (no_lib / "server.c").write_text(SERVER_C)
    gcc("-o", "llama-server", "server.c", "-L.", "-l:libllmgw-omp.so.1", cwd=no_lib)

    return {
        GOOD: pack({"llama-b6000/llama-server": good / "llama-server",
                    "llama-b6000/libggml.so.0.0.1": good / "libggml.so.0.0.1",
                    "llama-b6000/libggml.so.0": "libggml.so.0.0.1",
                    "llama-b6000/libggml.so": "libggml.so.0",
                    "llama-b6000/LICENSE": b"MIT License\n"}),
        NO_LIB: pack({"build/bin/llama-server": no_lib / "llama-server"}),
        FAILS: pack({"build/bin/llama-server": b"#!/bin/sh\necho 'Illegal instruction' >&2\n"
                                               b"exit 3\n"},
                    {"build/bin/llama-server": 0o755}),
        ESCAPE: pack({"a": ".", "a/a/b": "../..", "a/a/b/escaped": b"pwned\n"}),
    }


@dataclass
class Releases:
    """GitHub-shaped: ``/<org>/<repo>/releases/download/<tag>/<file>`` answers 302 to
    ``/objects/<file>``, which serves the bytes. ``tamper`` flips a byte of a file as
    served; ``drop`` sends half of it and closes the connection."""

    files: dict[str, bytes]
    tamper: set[str] = field(default_factory=set)
    drop: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)
    url: str = ""

    def release_url(self, file: str, tag: str = "b6000") -> str:
        return f"{self.url}/ggml-org/llama.cpp/releases/download/{tag}/{file}"

    async def _release(self, request: web.Request) -> web.StreamResponse:
        self.log.append(request.path)
        raise web.HTTPFound(f"/objects/{request.match_info['file']}")

    async def _object(self, request: web.Request) -> web.StreamResponse:
        self.log.append(request.path)
        name = request.match_info["file"]
        if name not in self.files:
            raise web.HTTPNotFound()
        data = self.files[name]
        if name in self.tamper:
            data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        response = web.StreamResponse()
        response.content_length = len(data)
        response.content_type = "application/octet-stream"
        await response.prepare(request)
        if name in self.drop:
            await response.write(data[: len(data) // 2])
            request.transport.close()
            return response
        await response.write(data)
        await response.write_eof()
        return response


@pytest.fixture
async def releases(archives):
    server = Releases(dict(archives))
    app = web.Application()
    app.router.add_get("/{org}/{repo}/releases/download/{tag}/{file}", server._release)
    app.router.add_get("/objects/{file}", server._object)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listing(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*")) if top.exists() else []


async def install(http, releases: Releases, root: Path, file: str = GOOD, *,
                  version: str = "b6000", digest: str | None = None, **kw) -> tuple[Path, list]:
    said: list[str] = []
    path = await install_archive(
        http, url=releases.release_url(file), sha256=digest or sha(releases.files[file]),
        root=root, name="llama.cpp", version=version, binary="llama-server",
        status=said.append, **kw)
    return path, said


async def test_a_good_archive_is_installed_checked_and_marked(http, releases, tmp_path):
    root = tmp_path / "engines"
    path, said = await install(http, releases, root)

    assert path == root / "llama.cpp" / "b6000"
    size = f"{len(releases.files[GOOD]) / 1e3:.1f} KB"
    assert said[0] == f"downloading {GOOD} ({size})"
    steps = [s for s in said if not s.startswith("downloading")]
    assert steps == [f"unpacking {GOOD}", "checking the libraries llama-server needs",
                     "running llama-server --version", "installed llama.cpp b6000"]
    assert releases.log == [f"/ggml-org/llama.cpp/releases/download/b6000/{GOOD}",
                            f"/objects/{GOOD}"]
    marker = read_marker(path)
    assert marker["binary"] == "llama-b6000/llama-server"
    assert marker["sha256"] == sha(releases.files[GOOD])
    assert marker["version_output"].startswith("version: 6000 (abc1234)")
    assert os.readlink(path / "llama-b6000" / "libggml.so") == "libggml.so.0"
    # Only the installed directory is left: no archive, no scratch directory.
    assert listing(root) == ["llama.cpp", "llama.cpp/b6000", f"llama.cpp/b6000/{MARKER}",
                             "llama.cpp/b6000/llama-b6000",
                             *(f"llama.cpp/b6000/llama-b6000/{n}" for n in sorted(
                                 ["LICENSE", "libggml.so", "libggml.so.0",
                                  "libggml.so.0.0.1", "llama-server"]))]
    assert installed_archive(root, "llama.cpp", "b6000") == path
    assert recheck(path, "llama-server") == []

    # Installed and still working: nothing is fetched again, nothing is said.
    again, said = await install(http, releases, root)
    assert again == path and said == [] and len(releases.log) == 2


async def test_a_library_taken_away_is_found_by_the_recheck_and_reinstalled(
        http, releases, tmp_path):
    root = tmp_path / "engines"
    path, _ = await install(http, releases, root)
    (path / "llama-b6000" / "libggml.so.0.0.1").unlink()

    assert recheck(path, "llama-server") == ["libggml.so.0 is missing"]
    again, said = await install(http, releases, root)
    assert said[0] == "reinstalling llama.cpp b6000: libggml.so.0 is missing"
    assert said[-1] == "installed llama.cpp b6000"
    assert again == path and recheck(path, "llama-server") == []
    assert [p for p in os.listdir(root) if p.startswith(".")] == []


async def test_a_binary_missing_a_library_is_refused_in_words(http, releases, tmp_path):
    root = tmp_path / "engines"
    with pytest.raises(InstallError) as caught:
        await install(http, releases, root, NO_LIB, version="b6001")
    assert str(caught.value) == (f"{NO_LIB}: llama-server cannot start on this node: "
                                 "libllmgw-omp.so.1 is missing")
    assert installed_archive(root, "llama.cpp", "b6001") is None
    assert listing(root) == []


async def test_a_binary_whose_version_fails_is_refused(http, releases, tmp_path):
    root = tmp_path / "engines"
    with pytest.raises(InstallError, match=r"llama-server --version failed \(exit 3\): "
                                           "Illegal instruction"):
        await install(http, releases, root, FAILS, version="b6002")
    assert listing(root) == []


async def test_an_unsafe_archive_leaves_nothing_anywhere(http, releases, tmp_path):
    root = tmp_path / "engines"
    with pytest.raises(UnsafeArchive, match=r"member 'a' is a symlink to '\.'"):
        await install(http, releases, root, ESCAPE, version="b6003")
    assert listing(tmp_path) == ["engines"]


@pytest.mark.parametrize("case", ["wrong sha of a good file", "bad checksum",
                                  "truncated download"])
async def test_a_download_that_is_not_the_published_file_is_refused(
        http, releases, tmp_path, case):
    root = tmp_path / "engines"
    published = sha(releases.files[GOOD])
    digest = published
    if case == "wrong sha of a good file":
        digest = sha(releases.files[NO_LIB])
    elif case == "bad checksum":
        releases.tamper.add(GOOD)
    else:
        releases.drop.add(GOOD)
    with pytest.raises(InstallError) as caught:
        await install(http, releases, root, digest=digest)
    message = str(caught.value)
    if case == "truncated download":
        assert f"broke off after {len(releases.files[GOOD]) // 2} of " in message, message
    else:
        served = releases.files[GOOD]
        if case == "bad checksum":
            served = served[:100] + bytes([served[100] ^ 1]) + served[101:]
        assert f"has sha256 {sha(served)}, but {digest} was expected" in message
    assert listing(root) == []


@pytest.mark.parametrize(("name", "version"), [
    ("llama.cpp", "../x"), ("llama.cpp", ".."), ("llama.cpp", ".hidden"),
    ("llama.cpp", "b6000/../../x"), ("llama.cpp", ""), ("../../etc", "b6000"),
])
async def test_names_and_versions_are_refused_before_any_path_is_built(
        http, releases, tmp_path, name, version):
    root = tmp_path / "engines"
    said: list[str] = []
    with pytest.raises(InstallError, match="is not allowed: use 1-64 letters"):
        await install_archive(http, url=releases.release_url(GOOD),
                              sha256=sha(releases.files[GOOD]), root=root, name=name,
                              version=version, binary="llama-server", status=said.append)
    with pytest.raises(InstallError, match="is not allowed"):
        installed_archive(root, name, version)
    assert listing(tmp_path) == [] and releases.log == [] and said == []


async def test_a_malformed_digest_and_too_little_space_are_refused_before_downloading(
        http, releases, tmp_path):
    root = tmp_path / "engines"
    with pytest.raises(InstallError, match="is not a sha256 digest"):
        await install(http, releases, root, digest="abc")
    with pytest.raises(InstallError, match=rf"llama.cpp needs 1000000.0 GB free in {root}; "):
        await install(http, releases, root, min_free_bytes=10**15)
    assert releases.log == [] and listing(root) == []


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its new parent counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_version_that_hangs_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(installer, "VERSION_TIMEOUT_S", 2.0)
    pids = tmp_path / "pids"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nsleep 600 &\necho $$ $! > {pids}.tmp\n"
                      f"mv {pids}.tmp {pids}\nwait\n")
    binary.chmod(0o755)
    with pytest.raises(InstallError, match="llama-server --version did not finish within 2 s"):
        installer.run_version(binary)
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2
    # SIGKILL has been sent to the group; the background sleep dies as the kernel gets to it.
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in started if not gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "run_version left its --version process group running"


async def test_download_reports_progress_and_bounds_the_size(http, releases, tmp_path):
    dest = tmp_path / GOOD
    seen: list[tuple[int, int | None]] = []
    data = releases.files[GOOD]
    await download(http, releases.release_url(GOOD), dest, sha256=sha(data).upper(),
                   max_bytes=len(data), progress=lambda done, total: seen.append((done, total)))
    assert dest.read_bytes() == data
    assert seen[0] == (0, len(data)) and seen[-1] == (len(data), len(data))
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)

    with pytest.raises(InstallError, match=f"is {len(data)} bytes, more than the 1000"):
        await download(http, releases.release_url(GOOD), tmp_path / "small", sha256=sha(data),
                       max_bytes=1000)
    with pytest.raises(InstallError, match=r"/download/b6000/missing\.tar\.gz \(redirected to "
                                           r"http://127\.0\.0\.1:\d+/objects/missing\.tar\.gz\) "
                                           "answered 404 Not Found"):
        await download(http, releases.release_url("missing.tar.gz"), tmp_path / "missing",
                       sha256=sha(b""), max_bytes=1000)
    assert sorted(os.listdir(tmp_path)) == [GOOD]
