"""Unpacking an engine archive (.tar.gz, .tgz, .tar.xz, .zip) without trusting it.

The agent runs as root and the archive comes from the network, so every member is judged
before anything is written, and the rules are ours rather than a library's: no absolute
path, no ``..``, no device, fifo or socket, no setuid, setgid or sticky bit (refused, not
stripped: a release that needs one is not one we understand), a symlink only to a file
beside it in the same directory (llama.cpp's ``libggml.so -> libggml.so.0.0.1``), a
hardlink only to a regular file this archive already unpacked, member count and unpacked
bytes bounded (bytes counted as they are written, not taken from headers).

Writes go through directory descriptors this code created, one path element at a time
with ``O_NOFOLLOW``, and every file is created with ``O_EXCL``: a link placed by an
earlier member can never redirect a later write, whatever the name checks missed — the
two-step escape "a -> ." then "a/a/b -> ../.." fails at both steps. Python's tarfile
``data`` filter runs as a second opinion on tar members.
"""

from __future__ import annotations

import gzip
import lzma
import os
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from llmgw.agent.install.pypi import InstallError

CHUNK = 2**20
MAX_LINK_TARGET = 4096
_MAX_LINK_HOPS = 40

_GZIP = b"\x1f\x8b"
_XZ = b"\xfd7zXZ\x00"
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")
_ZIP_METHODS = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                          zipfile.ZIP_LZMA})
# Reading a damaged or cut-off archive fails in the decompressor or the container parser.
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, gzip.BadGzipFile, EOFError, zlib.error,
                lzma.LZMAError)
# What may follow a tar's end marker: the padding to its record size (10 KiB by default).
_MAX_TAR_TAIL = 16 * 2**20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeArchive(InstallError):
    """An archive refused: ``member`` is the name as the archive gives it (None where the
    fault is the archive's as a whole), ``rule`` the rule it broke."""

    def __init__(self, archive: str, member: str | None, rule: str) -> None:
        self.archive, self.member, self.rule = archive, member, rule
        super().__init__(f"refusing {archive}: "
                         + (f"member {member!r} {rule}" if member is not None else rule))


@dataclass(frozen=True, slots=True)
class _Member:
    name: str  # as the archive spells it, for messages
    kind: str  # "file", "dir", "symlink", "hardlink", or what special file it is
    mode: int  # permission bits, setuid/setgid/sticky included
    size: int  # as the header claims
    link: str  # a link's target ("" for others)
    data: Callable[[], BinaryIO] | None  # a regular file's content
    second_opinion: Callable[[], None] | None = None  # raises UnsafeArchive


def archive_format(archive: Path) -> str:
    """``"tar.gz"``, ``"tar.xz"`` or ``"zip"``, from the file's first bytes (not its name:
    a URL's last element need not say)."""
    with open(archive, "rb") as f:
        head = f.read(6)
    if head.startswith(_GZIP):
        return "tar.gz"
    if head.startswith(_XZ):
        return "tar.xz"
    if head.startswith(_ZIP):
        return "zip"
    raise InstallError(f"{archive.name} is not a .tar.gz, .tgz, .tar.xz or .zip archive "
                       f"(it starts with {head!r})")


def unpack_archive(archive: Path, scratch: Path, *, max_members: int = 20_000,
                   max_bytes: int = 8 * 2**30) -> None:
    """Unpack ``archive`` into ``scratch``, an existing empty directory. Raises
    UnsafeArchive naming the member (where there is one) and the rule it broke, a
    truncated or corrupt archive included; InstallError for a file that is no archive of
    these kinds. On failure ``scratch`` keeps what was written so far (always inside it);
    the caller removes it."""
    fmt = archive_format(archive)
    if any(scratch.iterdir()):
        raise InstallError(f"unpacking {archive.name}: {scratch} is not empty")
    root = os.open(scratch, _DIR_FLAGS)
    try:
        unpacker = _Unpacker(archive.name, root, max_members, max_bytes)
        unpacker.run(_zip_members(archive, max_members, unpacker.refuse) if fmt == "zip"
                     else _tar_members(archive, fmt, scratch, unpacker.refuse))
    finally:
        os.close(root)


# --- reading members ---------------------------------------------------------------------------


def _tar_kind(info: tarfile.TarInfo) -> str:
    if info.isreg():
        return "file"
    if info.isdir():
        return "dir"
    if info.issym():
        return "symlink"
    if info.islnk():
        return "hardlink"
    if info.ischr():
        return "character device"
    if info.isblk():
        return "block device"
    if info.isfifo():
        return "fifo"
    return f"special file (tar type {info.type!r})"


def _tar_members(archive: Path, fmt: str, scratch: Path,
                 refuse: Callable[[str | None, str], UnsafeArchive]) -> Iterator[_Member]:
    # The decompressor is ours, not tarfile's, so that a cut-off file is noticed: tarfile
    # takes a stream that ends between two members for the end of the archive, and gzip
    # and xz check their trailers only when read to the end, which the drain below does.
    # Stream mode: members are read once, in order, never held for random access.
    opener = gzip.open if fmt == "tar.gz" else lzma.open
    with opener(archive, "rb") as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            kind = _tar_kind(info)

            def second_opinion(info: tarfile.TarInfo = info) -> None:
                try:
                    tarfile.data_filter(info, str(scratch))
                except tarfile.FilterError as err:
                    raise refuse(info.name, f"is refused by tarfile's data filter: {err}") \
                        from None

            yield _Member(info.name, kind, info.mode & 0o7777, info.size, info.linkname,
                          (lambda i=info: tar.extractfile(i)) if kind == "file" else None,
                          second_opinion)
        tail = 0
        while chunk := stream.read(CHUNK):
            tail += len(chunk)
            if tail > _MAX_TAR_TAIL:
                raise refuse(None, f"has more than {_MAX_TAR_TAIL} bytes after the end of "
                                   "the tar")


def _zip_kind(info: zipfile.ZipInfo, mode: int) -> str:
    if info.is_dir():
        return "dir"
    fmt = stat.S_IFMT(mode)
    kinds = {stat.S_IFLNK: "symlink", stat.S_IFCHR: "character device",
             stat.S_IFBLK: "block device", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket"}
    if fmt in (0, stat.S_IFREG):
        return "file"
    return kinds.get(fmt, f"special file (mode {mode:o})")


def _zip_members(archive: Path, max_members: int,
                 refuse: Callable[[str | None, str], UnsafeArchive]) -> Iterator[_Member]:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        if len(infos) > max_members:
            raise refuse(infos[max_members].filename,
                         f"is past the limit of {max_members} members")
        for info in infos:
            # Unix permissions (and the file type) sit in the high half of external_attr.
            mode = info.external_attr >> 16 if info.create_system == 3 else 0
            kind = _zip_kind(info, mode)
            if info.flag_bits & 0x1:
                raise refuse(info.filename, "is encrypted; an engine archive is not")
            if info.compress_type not in _ZIP_METHODS:
                raise refuse(info.filename, f"uses zip compression method "
                                            f"{info.compress_type}, which llmgw cannot read")
            link = ""
            if kind == "symlink":
                if info.file_size > MAX_LINK_TARGET:
                    raise refuse(info.filename, "is a symlink with an overlong target")
                link = zf.read(info).decode("utf-8", "replace")
            yield _Member(info.filename, kind, mode & 0o7777, info.file_size, link,
                          (lambda i=info: zf.open(i)) if kind == "file" else None)


# --- writing them ------------------------------------------------------------------------------


class _Unpacker:
    def __init__(self, archive: str, root: int, max_members: int, max_bytes: int) -> None:
        self.archive, self.root = archive, root
        self.max_members, self.max_bytes = max_members, max_bytes
        self.count = 0
        self.written = 0
        self.kinds: dict[tuple[str, ...], str] = {}  # what each path became: file/dir/symlink
        self.links: dict[tuple[str, ...], str] = {}  # symlink path -> its target
        self.reading: str | None = None  # the member being unpacked
        self.last: str | None = None  # the last member unpacked

    def refuse(self, member: str | None, rule: str) -> UnsafeArchive:
        return UnsafeArchive(self.archive, member, rule)

    def run(self, members: Iterator[_Member]) -> None:
        try:
            for member in members:
                self.reading = member.name
                self.add(member)
                self.reading, self.last = None, member.name
        except _READ_ERRORS as err:
            if self.reading is not None:
                raise self.refuse(self.reading, f"is cut off or damaged ({err}): the archive "
                                                "is truncated or corrupt; download it again"
                                  ) from None
            where = f" after member {self.last!r}" if self.last is not None else ""
            raise self.refuse(None, f"the archive is truncated or corrupt{where} ({err}); "
                                    "download it again") from None
        self.check_links()

    def add(self, m: _Member) -> None:
        self.count += 1
        if self.count > self.max_members:
            raise self.refuse(m.name, f"is past the limit of {self.max_members} members")
        parts = self.judge(m)
        if parts is None:
            return
        if m.second_opinion:
            m.second_opinion()
        try:
            if m.kind == "dir":
                os.close(self.open_dir(m.name, parts))
            elif m.kind == "symlink":
                self.symlink(m, parts)
            elif m.kind == "hardlink":
                self.hardlink(m, parts)
            else:
                self.write(m, parts)
        except _READ_ERRORS:
            raise
        except OSError as err:
            raise InstallError(f"unpacking {self.archive}: {m.name!r}: "
                               f"{err.strerror or err}") from None

    def judge(self, m: _Member) -> tuple[str, ...] | None:
        """The member's path as elements, once every rule that needs no disk is met; None
        for the archive's own root ("./")."""
        name = m.name
        if "\0" in name:
            raise self.refuse(name, "has a NUL byte in its name")
        if name.startswith("/"):
            raise self.refuse(name, "is an absolute path; an archive may only write inside "
                                    "its own directory")
        if ".." in name.split("/"):
            raise self.refuse(name, "has a '..' component; an archive may only write inside "
                                    "its own directory")
        parts = _elements(name)
        if m.kind not in ("file", "dir", "symlink", "hardlink"):
            raise self.refuse(name, f"is a {m.kind}; an engine archive holds only files, "
                                    "directories and links")
        bits = [what for bit, what in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"),
                                       (stat.S_ISVTX, "sticky")) if m.mode & bit]
        if bits:
            raise self.refuse(name, f"has the {' and '.join(bits)} bit "
                                    f"(mode {m.mode:04o}); refused rather than stripped")
        if not parts:
            if m.kind == "dir":
                return None
            raise self.refuse(name, "has no name")
        if parts in self.kinds and not (m.kind == "dir" and self.kinds[parts] == "dir"):
            raise self.refuse(name, "appears twice; an archive may not overwrite a member")
        target = m.link
        if m.kind == "symlink":
            if target.startswith("/"):
                raise self.refuse(name, f"is a symlink to the absolute path {target!r}")
            if not target or "/" in target or target in (".", "..") or "\0" in target:
                raise self.refuse(name, f"is a symlink to {target!r}; a link may only point "
                                        "at a file beside it in the same directory")
        if m.kind == "hardlink" and (target.startswith("/") or ".." in target.split("/")
                                     or self.kinds.get(_elements(target)) != "file"):
            raise self.refuse(name, f"is a hardlink to {target!r}, which is not a regular "
                                    "file this archive unpacked before it")
        if m.kind == "file" and m.size > self.max_bytes - self.written:
            raise self.refuse(name, f"would unpack past the limit of {self.max_bytes} bytes "
                                    f"({m.size} bytes on top of {self.written})")
        return parts

    def open_dir(self, name: str, parts: tuple[str, ...]) -> int:
        """A descriptor for the directory ``parts``, made where missing, one element at a
        time, never through a link."""
        fd = os.dup(self.root)
        try:
            for i, part in enumerate(parts):
                path = parts[:i + 1]
                if path not in self.kinds:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    self.kinds[path] = "dir"
                elif self.kinds[path] != "dir":
                    raise self.refuse(name, f"goes through {'/'.join(path)!r}, which is a "
                                            f"{self.kinds[path]}, not a directory")
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as err:
                    raise self.refuse(name, f"goes through {'/'.join(path)!r}, which is not "
                                            f"a directory this unpacking made ({err.strerror})"
                                      ) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write(self, m: _Member, parts: tuple[str, ...]) -> None:
        parent = self.open_dir(m.name, parts[:-1])
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
        finally:
            os.close(parent)
        self.kinds[parts] = "file"
        assert m.data is not None
        with os.fdopen(fd, "wb") as out, m.data() as src:
            while chunk := src.read(CHUNK):
                # Counted as written: a header may understate what a stream inflates to.
                self.written += len(chunk)
                if self.written > self.max_bytes:
                    raise self.refuse(m.name, f"unpacks past the limit of {self.max_bytes} "
                                              "bytes (a size bomb?)")
                out.write(chunk)
            os.fchmod(out.fileno(), 0o755 if m.mode & 0o111 else 0o644)

    def symlink(self, m: _Member, parts: tuple[str, ...]) -> None:
        parent = self.open_dir(m.name, parts[:-1])
        try:
            os.symlink(m.link, parts[-1], dir_fd=parent)
        finally:
            os.close(parent)
        self.kinds[parts] = "symlink"
        self.links[parts] = m.link

    def hardlink(self, m: _Member, parts: tuple[str, ...]) -> None:
        source = _elements(m.link)
        src_dir = self.open_dir(m.name, source[:-1])
        try:
            dst_dir = self.open_dir(m.name, parts[:-1])
            try:
                os.link(source[-1], parts[-1], src_dir_fd=src_dir, dst_dir_fd=dst_dir,
                        follow_symlinks=False)
            finally:
                os.close(dst_dir)
        finally:
            os.close(src_dir)
        self.kinds[parts] = "file"

    def check_links(self) -> None:
        """Every symlink ends, within its own directory, at a regular file of the archive
        (checked at the end: a link may come before its target)."""
        for path, first in self.links.items():
            name, target = path, first
            for _ in range(_MAX_LINK_HOPS):
                at = (*name[:-1], target)
                kind = self.kinds.get(at)
                if kind == "file":
                    break
                if kind != "symlink":
                    raise self.refuse("/".join(path), f"is a symlink to {first!r}, which is "
                                                      "not a file beside it in the archive")
                name, target = at, self.links[at]
            else:
                raise self.refuse("/".join(path), "is a symlink in a loop")


def _elements(name: str) -> tuple[str, ...]:
    return tuple(p for p in name.split("/") if p not in ("", "."))
