"""Writing store files safely: private scratch directories, 0600, fsync, atomic rename,
and the owner of what they replace."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from llmgw.store.records import StoreError


@contextmanager
def private_dir(beside: Path, what: str) -> Iterator[Path]:
    """A temporary directory only we can enter (mkdtemp makes it 0700), removed after."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".llmgw-{what}-", dir=beside))
    except OSError as exc:
        raise StoreError(f"cannot make a temporary directory in {beside}: {exc.strerror}") from exc
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def create_private(path: Path) -> int:
    """Create `path` (which must not exist) as 0600, whatever the umask; returns it open
    for writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def publish(part: Path, dest: Path) -> None:
    os.chmod(part, 0o600)
    fsync_file(part)
    os.replace(part, dest)
    fsync_dir(dest.parent)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def chown_like(path: Path, like: os.stat_result, fd: int | None = None) -> None:
    """Give `path` (or the open `fd`) the owner and group of `like`, where they differ."""
    now = os.stat(path) if fd is None else os.fstat(fd)
    if (now.st_uid, now.st_gid) == (like.st_uid, like.st_gid):
        return
    try:
        if fd is None:
            os.chown(path, like.st_uid, like.st_gid)
        else:
            os.fchown(fd, like.st_uid, like.st_gid)
    except PermissionError:
        raise StoreError(
            f"cannot give {path} the owner uid {like.st_uid}, gid {like.st_gid} that the "
            "server needs; run this as root or as that user"
        ) from None


def write_like(path: Path, data: bytes, like: os.stat_result) -> None:
    """Create `path` (it must not exist) holding `data`, with the mode and owner of
    `like`; it is 0600 until its content and owner are right."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot write {path}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            chown_like(path, like, f.fileno())
            os.fchmod(f.fileno(), like.st_mode & 0o7777)
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def replace_like(path: Path, data: bytes, like: os.stat_result) -> None:
    """Replace `path` with `data` atomically, keeping its mode and owner."""
    tmp = path.with_name(f".{path.name}.llmgw-{secrets.token_hex(4)}")
    write_like(tmp, data, like)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot replace {path}: {exc.strerror}") from exc
    fsync_dir(path.parent)


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def unique(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate

