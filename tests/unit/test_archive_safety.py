"""Unpacking engine archives: a llama.cpp-shaped archive unpacks whole, and a corpus of
malicious or broken ones is refused, each naming the member and the rule, with nothing
written outside the scratch directory. Every archive is a real one, built here with
tarfile and zipfile."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmgw.agent.install.archive import UnsafeArchive, unpack_archive
from llmgw.agent.install.pypi import InstallError

MB = 2**20


@dataclass
class Entry:
    """One tar member: ``kind`` is a tarfile type, ``link`` a link's target."""

    name: str
    data: bytes = b""
    kind: bytes = tarfile.REGTYPE
    mode: int = 0o644
    link: str = ""
    extra: dict = field(default_factory=dict)


def make_tar(path: Path, entries: list[Entry], compression: str = "gz") -> Path:
    with tarfile.open(path, f"w:{compression}", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type, info.mode, info.linkname = e.kind, e.mode, e.link
            info.size = len(e.data) if e.kind == tarfile.REGTYPE else 0
            for key, value in e.extra.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(e.data) if e.kind == tarfile.REGTYPE else None)
    return path


def make_zip(path: Path, entries: list[tuple[str, bytes, int]]) -> Path:
    """``(name, data, unix st_mode)``: a symlink is S_IFLNK with its target as data."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name)
            info.create_system = 3  # unix, so the mode below is read
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return path


def tree(top: Path) -> dict[str, str]:
    """Every path under ``top`` and what it is, links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            what = ("link -> " + os.readlink(path) if stat.S_ISLNK(st.st_mode)
                    else "dir" if stat.S_ISDIR(st.st_mode) else f"file {st.st_size}")
            out[str(path.relative_to(top))] = what
    return out


@pytest.fixture
def box(tmp_path):
    """A directory holding the archive and the scratch directory, with a decoy beside
    them; ``box.outside()`` lists everything but the scratch directory."""
    root = tmp_path / "box"
    (root / "scratch").mkdir(parents=True)
    (root / "decoy").write_text("must survive\n")

    class Box:
        path = root
        scratch = root / "scratch"

        @staticmethod
        def outside() -> dict[str, str]:
            return {k: v for k, v in tree(tmp_path).items()
                    if not k.startswith("box/scratch/")}

    return Box


LLAMA_LIKE = [
    Entry("./", kind=tarfile.DIRTYPE, mode=0o755),
    Entry("./build/", kind=tarfile.DIRTYPE, mode=0o755),
    Entry("./build/bin/", kind=tarfile.DIRTYPE, mode=0o755),
    # Links before their target, as tar often stores them.
    Entry("./build/bin/libggml.so", kind=tarfile.SYMTYPE, link="libggml.so.0"),
    Entry("./build/bin/libggml.so.0", kind=tarfile.SYMTYPE, link="libggml.so.0.0.1"),
    Entry("./build/bin/libggml.so.0.0.1", data=b"\x7fELF shared", mode=0o755),
    Entry("./build/bin/llama-server", data=b"#!/bin/sh\necho version: 6000\n", mode=0o755),
    Entry("./build/bin/llama-cli", kind=tarfile.LNKTYPE, link="./build/bin/llama-server",
          mode=0o755),
    Entry("./LICENSE", data=b"MIT\n"),
]


@pytest.mark.parametrize("compression", ["gz", "xz"])
def test_a_llama_cpp_shaped_tar_unpacks_whole(box, compression):
    archive = make_tar(box.path / f"llama.tar.{compression}", LLAMA_LIKE, compression)
    unpack_archive(archive, box.scratch)
    bin_dir = box.scratch / "build" / "bin"
    assert tree(box.scratch) == {
        "build": "dir", "build/bin": "dir",
        "build/bin/libggml.so": "link -> libggml.so.0",
        "build/bin/libggml.so.0": "link -> libggml.so.0.0.1",
        "build/bin/libggml.so.0.0.1": "file 11",
        "build/bin/llama-server": "file 29", "build/bin/llama-cli": "file 29",
        "LICENSE": "file 4",
    }
    assert (bin_dir / "libggml.so").read_bytes() == b"\x7fELF shared"
    assert os.stat(bin_dir / "llama-cli").st_ino == os.stat(bin_dir / "llama-server").st_ino
    assert stat.S_IMODE(os.stat(bin_dir / "llama-server").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(box.scratch / "LICENSE").st_mode) == 0o644


def test_a_zip_with_a_link_beside_its_file_unpacks(box):
    archive = make_zip(box.path / "engine.zip", [
        ("engine/", b"", stat.S_IFDIR | 0o755),
        ("engine/run", b"#!/bin/sh\n", stat.S_IFREG | 0o755),
        ("engine/libx.so.1", b"lib", stat.S_IFREG | 0o644),
        ("engine/libx.so", b"libx.so.1", stat.S_IFLNK | 0o777),
    ])
    unpack_archive(archive, box.scratch)
    assert tree(box.scratch) == {"engine": "dir", "engine/run": "file 10",
                                 "engine/libx.so.1": "file 3",
                                 "engine/libx.so": "link -> libx.so.1"}
    assert os.access(box.scratch / "engine" / "run", os.X_OK)


# --- the malicious corpus ------------------------------------------------------------------------

SETUID = Entry("bin/su", data=b"x", mode=0o4755)
CORPUS: dict[str, tuple[list[Entry], str, str]] = {
    # case: (members, the member named in the refusal, words of the rule)
    "absolute path": ([Entry("/tmp/evil", data=b"x")], "/tmp/evil", "absolute path"),
    "dot-dot": ([Entry("bin/../../evil", data=b"x")], "bin/../../evil", "'..' component"),
    "symlink to an absolute path": (
        [Entry("lib", kind=tarfile.SYMTYPE, link="/etc")], "lib", "absolute path '/etc'"),
    "symlink up": ([Entry("d/up", kind=tarfile.SYMTYPE, link="../../x")], "d/up",
                   "a file beside it"),
    "two-step link escape": ([
        Entry("a", kind=tarfile.SYMTYPE, link="."),
        Entry("a/a/b", kind=tarfile.SYMTYPE, link="../.."),
        Entry("a/a/b/escaped", data=b"pwned"),
    ], "a", "a file beside it"),
    "write through an earlier link": ([
        Entry("lib.so.1", data=b"x"),
        Entry("lib", kind=tarfile.SYMTYPE, link="lib.so.1"),
        Entry("lib/evil", data=b"pwned"),
    ], "lib/evil", "goes through 'lib'"),
    "symlink to a directory": ([
        Entry("sub/", kind=tarfile.DIRTYPE, mode=0o755),
        Entry("s", kind=tarfile.SYMTYPE, link="sub"),
    ], "s", "not a file beside it"),
    "dangling symlink": ([Entry("s", kind=tarfile.SYMTYPE, link="nothing")], "s",
                         "not a file beside it"),
    "hardlink out": ([Entry("passwd", kind=tarfile.LNKTYPE, link="../../etc/passwd")],
                     "passwd", "hardlink to '../../etc/passwd'"),
    "hardlink to an absolute path": ([Entry("passwd", kind=tarfile.LNKTYPE,
                                            link="/etc/passwd")], "passwd", "hardlink"),
    "hardlink to what is not unpacked yet": ([
        Entry("h", kind=tarfile.LNKTYPE, link="later"), Entry("later", data=b"x"),
    ], "h", "not a regular file this archive unpacked before it"),
    "character device": ([Entry("null", kind=tarfile.CHRTYPE, extra={"devmajor": 1,
                                                                     "devminor": 3})],
                         "null", "character device"),
    "block device": ([Entry("sda", kind=tarfile.BLKTYPE, extra={"devmajor": 8})], "sda",
                     "block device"),
    "fifo": ([Entry("pipe", kind=tarfile.FIFOTYPE)], "pipe", "fifo"),
    "setuid": ([SETUID], "bin/su", "setuid bit (mode 4755); refused rather than stripped"),
    "setgid directory": ([Entry("d/", kind=tarfile.DIRTYPE, mode=0o2755)], "d", "setgid"),
    "sticky": ([Entry("t", data=b"x", mode=0o1644)], "t", "sticky"),
    "overwrite": ([Entry("f", data=b"one"), Entry("f", data=b"two")], "f", "appears twice"),
}


@pytest.mark.parametrize("case", CORPUS)
def test_a_malicious_tar_is_refused_naming_member_and_rule(box, case):
    entries, member, rule = CORPUS[case]
    archive = make_tar(box.path / "evil.tar.gz", entries)
    before = box.outside()
    with pytest.raises(UnsafeArchive) as caught:
        unpack_archive(archive, box.scratch)
    assert caught.value.member == member
    assert rule in caught.value.rule, str(caught.value)
    assert f"member {member!r}" in str(caught.value)
    assert box.outside() == before
    assert (box.path / "decoy").read_text() == "must survive\n"


ZIP_CORPUS = {
    "absolute path": ([("/abs", b"x", stat.S_IFREG | 0o644)], "/abs", "absolute path"),
    "dot-dot": ([("a/../../x", b"x", stat.S_IFREG | 0o644)], "a/../../x", "'..'"),
    "symlink out": ([("l", b"/etc/passwd", stat.S_IFLNK | 0o777)], "l", "absolute path"),
    "setuid": ([("su", b"x", stat.S_IFREG | 0o4755)], "su", "setuid"),
    "character device": ([("null", b"", stat.S_IFCHR | 0o666)], "null", "character device"),
}


@pytest.mark.parametrize("case", ZIP_CORPUS)
def test_a_malicious_zip_is_refused(box, case):
    entries, member, rule = ZIP_CORPUS[case]
    archive = make_zip(box.path / "evil.zip", entries)
    before = box.outside()
    with pytest.raises(UnsafeArchive) as caught:
        unpack_archive(archive, box.scratch)
    assert caught.value.member == member and rule in caught.value.rule, str(caught.value)
    assert box.outside() == before


def test_more_members_than_the_bound_are_refused(box):
    archive = make_tar(box.path / "many.tar.gz",
                       [Entry(f"f{i}", data=b"x") for i in range(41)])
    with pytest.raises(UnsafeArchive, match="past the limit of 40 members") as caught:
        unpack_archive(archive, box.scratch, max_members=40)
    assert caught.value.member == "f40"
    assert len(list(box.scratch.iterdir())) == 40


def test_a_zip_with_more_members_than_the_bound_writes_nothing(box):
    archive = make_zip(box.path / "many.zip",
                       [(f"f{i}", b"x", stat.S_IFREG | 0o644) for i in range(41)])
    with pytest.raises(UnsafeArchive, match="past the limit of 40 members"):
        unpack_archive(archive, box.scratch, max_members=40)
    assert list(box.scratch.iterdir()) == []


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_a_size_bomb_is_stopped_at_the_bound(box, fmt):
    # Three members of 2 MiB of zeros: each small alone, past the 5 MiB bound together;
    # compressed, the archive is a few kilobytes.
    zeros = bytes(2 * MB)
    if fmt == "tar":
        archive = make_tar(box.path / "bomb.tar.gz", [Entry(f"z{i}", zeros) for i in range(3)])
    else:
        archive = make_zip(box.path / "bomb.zip",
                           [(f"z{i}", zeros, stat.S_IFREG | 0o644) for i in range(3)])
    assert archive.stat().st_size < 64 * 1024
    with pytest.raises(UnsafeArchive, match=f"limit of {5 * MB} bytes") as caught:
        unpack_archive(archive, box.scratch, max_bytes=5 * MB)
    assert caught.value.member == "z2"
    assert sum(p.stat().st_size for p in box.scratch.iterdir()) <= 5 * MB


def test_a_member_whose_header_is_past_the_bound_is_refused_before_writing(box):
    archive = make_tar(box.path / "big.tar.gz", [Entry("big", bytes(3 * MB))])
    with pytest.raises(UnsafeArchive, match="would unpack past"):
        unpack_archive(archive, box.scratch, max_bytes=MB)
    assert list(box.scratch.iterdir()) == []


@pytest.mark.parametrize("name", ["engine.tar.gz", "engine.tar.xz", "engine.zip"])
def test_a_truncated_archive_is_refused(box, name):
    # Random bytes do not compress, so the cut lands inside a member's data.
    payload = os.urandom(256 * 1024)
    if name.endswith(".zip"):
        good = make_zip(box.path / name, [("bin/llama-server", payload, stat.S_IFREG | 0o755)])
    else:
        good = make_tar(box.path / name, [Entry("bin/llama-server", payload, mode=0o755)],
                        name.rsplit(".", 1)[1])
    whole = good.read_bytes()
    cut = box.path / f"cut-{name}"
    cut.write_bytes(whole[: len(whole) // 2])
    before = box.outside()
    with pytest.raises(UnsafeArchive, match="truncated or corrupt"):
        unpack_archive(cut, box.scratch)
    assert box.outside() == before


def test_an_archive_cut_between_members_is_refused(box):
    # tarfile alone takes a stream that stops between two members for a short archive;
    # the gzip trailer says otherwise.
    archive = make_tar(box.path / "two.tar.gz", [Entry("a", os.urandom(64 * 1024)),
                                                 Entry("b", os.urandom(64 * 1024))])
    raw = archive.read_bytes()
    archive.write_bytes(raw[:-8])  # the trailer: crc32 and length
    with pytest.raises(UnsafeArchive, match="truncated or corrupt"):
        unpack_archive(archive, box.scratch)


def test_a_corrupted_byte_is_refused(box):
    archive = make_tar(box.path / "flip.tar.gz", [Entry("f", os.urandom(64 * 1024))])
    raw = bytearray(archive.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    archive.write_bytes(bytes(raw))
    with pytest.raises(UnsafeArchive, match="truncated or corrupt"):
        unpack_archive(archive, box.scratch)


def test_what_is_not_an_archive_is_refused_by_its_content(box):
    page = box.path / "llama.tar.gz"
    page.write_text("<html>Not Found</html>")
    with pytest.raises(InstallError, match=r"is not a \.tar\.gz, \.tgz, \.tar\.xz or \.zip"):
        unpack_archive(page, box.scratch)


def test_the_scratch_directory_must_be_empty(box):
    archive = make_tar(box.path / "ok.tar.gz", [Entry("f", b"x")])
    (box.scratch / "left").write_text("over")
    with pytest.raises(InstallError, match="is not empty"):
        unpack_archive(archive, box.scratch)
